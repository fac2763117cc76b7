"""The Tinker service's records: its limits, and what it holds of each session, training
model, sampler and future (each resource's owner keeps its own: ``calls``, ``registry``,
``sampling``)."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from flowrl.backends.engines.tinker.custom_loss import CustomLoss
from flowrl.backends.policy.tinker_handles import ModelHandle
from flowrl.backends.types import LoraSettings
from flowrl.infra.serving import ServiceError, ServingLimits


@dataclass
class Limits(ServingLimits):
    max_body_bytes: int = 64 * 2**20
    session_ttl_s: float = 120.0
    """A session whose client has not sent a heartbeat (every 10 s) for this long ends: its
    models are unloaded (slots freed), its saved states kept."""
    max_models_per_namespace: int = 8
    max_samples: int = 64
    future_ttl_s: float = 3600.0
    long_poll_s: float = 20.0
    """How long ``retrieve_future`` waits for a result before answering 408 ``try_again`` (the
    SDK asks again at once; its own timeout per ask is 45 s)."""


@dataclass
class Session:
    session_id: str
    namespace: str | None
    display_name: str | None
    user_metadata: dict[str, str]
    heartbeat: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    ended: str | None = None
    losses: dict[str, CustomLoss] = field(default_factory=dict)
    """Its clients' uploaded losses (``create_custom_loss``) by loss id."""
    tags: list[str] = field(default_factory=list)
    """Its client's tags (``TINKER_TAGS``), shown with it (``GET sessions/{id}``)."""
    project_id: str | None = None
    """The project its client named (``ServiceClient(project_id=…)``); searches filter by it."""
    created_at: float = field(default_factory=lambda: round(time.time(), 6))  # µs, as listed
    status: dict[str, Any] | None = None
    """How it ended, as the SDK's ``SessionStatus`` (a client's finish and its reason); None
    while it runs, or when it ended otherwise (no heartbeat, the server stopped)."""


@dataclass
class Model:
    model_id: str
    namespace: str | None
    session_id: str
    base_model: str
    lora: LoraSettings
    seed: int | None = None  # the client's LoraConfig.seed (None: the model draws one)
    handle: ModelHandle | None = None
    worker: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, "tinker-model")
    )
    snapshots: int = 0
    ended: str | None = None
    start: Callable[[], Any] | None = None
    """Starts the model (its placement's ``start``) as the first work on its worker."""
    redone: dict[str, Any] = field(default_factory=dict)
    """What calls its restore ran again answered, by future id, for their replays."""
    history_bytes: int = 0
    """The journaled bodies of its history since its last saved state."""
    generation: int = 0
    """How many times it was made again (``Training.restore``)."""
    restoring: int | None = None
    """The generation of a restore whose end was never journaled (its service died in it)."""
    restore_folder: str | None = None
    """The state the service saved to cut its history (``Training.bound_history``)."""


@dataclass
class Sampler:
    sampler_id: str
    namespace: str | None
    base_model: str
    model_path: str | None
    model_id: str | None  # the live training model whose worker samples, else a pool model
    weights: str | None  # the snapshot key on that model; None: the base model alone
    pool: Model | None = None  # the model that serves a saved path (set when it is loaded)
    clients: int = 0


@dataclass
class Future:
    namespace: str | None
    kind: str
    future: concurrent.futures.Future
    created: float = field(default_factory=time.monotonic)


def live(model: Model) -> ModelHandle:
    """The model's handle, or a 503 saying why it has none (its start failed)."""
    if model.handle is None:
        raise ServiceError(503, f"model {model.model_id} is not available ({model.ended})")
    return model.handle


def now() -> str:
    return datetime.now(UTC).isoformat()
