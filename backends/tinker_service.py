"""The Tinker API, self-hosted: the REST service the official ``tinker`` SDK talks to
(``ServiceClient``, ``TrainingClient``, ``SamplingClient``, ``RestClient``), with flowrl's
models behind it.

    flowrl serve tinker [--host 127.0.0.1] [--port 8790] [--keys-file F | --insecure-loopback]

What it serves (``/api/v1/...``): client config, health, server capabilities (the base-model
catalogue), sessions and heartbeats, ``create_model`` (LoRA), ``forward_backward`` /
``forward`` (protobuf, optionally zstd), ``optim_step``, ``save_weights`` /
``load_weights`` (``save_state`` / ``load_state[_with_optimizer]`` and
``create_training_client_from_state[_with_optimizer]``), ``save_weights_for_sampler``, sampling
sessions and ``asample``, ``retrieve_future`` (long-polled; ``try_again`` while running),
``unload_model``, ``get_info``, ``weights_info``, training runs and checkpoints (list, get,
delete), sessions, samplers, telemetry (accepted and dropped).

Work is asynchronous as the SDK expects: a verb answers a future id at once, its work runs on the
model's own worker thread in arrival order, and ``retrieve_future`` answers the result (protobuf
for ``forward_backward`` and ``sample``, JSON for the rest), ``{"error", "category"}`` when it
failed, or 408 ``try_again`` after a long poll. A request the service cannot serve (malformed
JSON or protobuf, lengths that do not match, token ids outside the vocabulary, an unknown loss,
model, sampler or future, an oversized body) gets a 4xx naming it; nothing a client sends
answers 500.

Where models live is a ``Placement``: ``LocalPlacement`` (in this process, for development and
tests) or ``backends.tinker_actor.SessionPlacement`` (each training model a Prefect flow run of the
``tinker-session`` deployment, admitted by the scheduler, holding the Ray actor with the weights).

Tenancy: an API key (``X-API-Key: tml-…``) maps to a flowrl namespace; keys come from
``--keys-file`` (lines ``namespace:tml-key``) or ``FLOWRL_TINKER_KEYS``
(``namespace:key,namespace:key``), never from a config. A namespace's runs and checkpoints live
under its own storage prefix (``ns/<namespace>/tinker/``): another key's run id, sampler or
``tinker://`` path is not found there (404). Without keys the service starts only with
``--insecure-loopback`` on a loopback address, every caller one owner.

Checkpoints (``tinker://<run>/weights/<name>``, ``tinker://<run>/sampler_weights/<name>``) are
folders of flowrl storage (a local folder or ``s3://``): ``<prefix>/<run>/<kind>/<name>/``
with ``adapter.safetensors``, ``optimizer.pt`` (``weights`` only) and ``checkpoint.json``;
``<prefix>/<run>/run.json`` describes the run. They outlive the service: after a restart a
saved path loads as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import ipaddress
import json
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from flowrl.backends.tinker_types import (
    SampleParams,
    TinkerInputError,
    check_batch,
    check_tokens,
    read_tinker_lora,
    tinker_lora,
    tinker_lora_config,
)
from flowrl.backends.tinker_wire import (
    decompress,
    read_forward_backward,
    write_forward_output,
    write_sample_response,
)
from flowrl.backends.types import LoraSettings
from flowrl.infra.servers import body_size_refusal
from flowrl.infra.settings import get_settings
from flowrl.infra.storage import Storage

API = "/api/v1"
KEYS_VAR = "FLOWRL_TINKER_KEYS"
INSECURE_NAMESPACE = None
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_PATTERN = re.compile(r"^([0-9a-f]{16}):train:([0-9]{1,6})$")
KINDS = {"weights": "training", "sampler_weights": "sampler"}


class ServiceError(Exception):
    """An answer with an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def not_found(what: str) -> ServiceError:
    return ServiceError(404, what)


# --------------------------------------------------------------------------- settings


@dataclass
class Limits:
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


def read_keys(path: str | None = None) -> dict[str, str | None]:
    """API key → namespace, from ``path`` (lines ``namespace:key``) or ``FLOWRL_TINKER_KEYS``."""
    entries: list[str] = []
    if path:
        entries += [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    entries += [e for e in os.environ.get(KEYS_VAR, "").split(",") if e.strip()]
    keys: dict[str, str | None] = {}
    for entry in entries:
        namespace, sep, key = entry.strip().partition(":")
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", namespace):
            raise SystemExit("a key entry must be namespace:tml-key (namespace: a-z, 0-9, -)")
        if not key.startswith("tml-") or len(key) < 20:
            raise SystemExit("an API key must start with tml- and have 20+ characters")
        keys[key] = namespace
    return keys


def tinker_prefix(namespace: str | None) -> str:
    """A namespace's Tinker runs in storage: ``ns/<namespace>/tinker`` (``tinker`` without)."""
    return f"ns/{namespace}/tinker" if namespace else "tinker"


def run_folder(namespace: str | None, run_id: str) -> str:
    """A training run's storage folder: ``[ns/<namespace>/]tinker/<session>-train-<n>``."""
    match = RUN_PATTERN.match(run_id)
    if not match:
        raise not_found(f"no training run {run_id[:80]!r}")
    return f"{tinker_prefix(namespace)}/{match[1]}-train-{match[2]}"


def checkpoint_folder(storage: Storage, namespace: str | None, path: Any) -> tuple[str, str, str]:
    """``tinker://<run>/<kind>/<name>`` → (run id, kind, storage folder). The run must be
    ``namespace``'s and the checkpoint must exist (``ServiceError`` 400 / 404 naming it)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ServiceError(400, f"not a tinker:// path: {str(path)[:120]!r}")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not NAME_PATTERN.match(parts[2]):
        raise ServiceError(
            400, f"a path is tinker://<run>/weights|sampler_weights/<name>: {path[:120]!r}"
        )
    run_id, kind, name = parts
    folder = f"{run_folder(namespace, run_id)}/{kind}/{name}"
    if not storage.exists(f"{folder}/checkpoint.json"):
        raise not_found(f"no checkpoint {path!r}")
    return run_id, kind, folder


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# --------------------------------------------------------------------------- placement


class ModelHandle(Protocol):
    """Where one training model's ``TinkerModel`` lives; ``call`` runs one of its methods."""

    info: dict[str, Any]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def close(self) -> None: ...


class Placement(Protocol):
    def start(self, spec: dict[str, Any]) -> ModelHandle:
        """A new model from ``spec`` (model_id, namespace, base_model, base_uri, lora: its
        ``LoraSettings``, seed: the model's or None)."""
        ...


class LocalHandle:
    def __init__(self, model: Any):
        self.model = model
        self.info = {"vocab_size": model.vocab_size, "context_length": model.context_length}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.model, method)(*args, **kwargs)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()  # its adapter leaves the shared base
            self.model = None


class LocalPlacement:
    """Models in this process (development, tests, the service's own samplers). Every model of
    one base model is a tenant of one ``SharedBase``: the base weights are loaded once, each
    model holds only its LoRA adapter, AdamW state and RNG; with ``adapter_slots`` at most that
    many adapters are resident, the least recently used parked and restored exactly."""

    in_process = True

    def __init__(self, cache_dir: str | None = None, adapter_slots: int | None = None):
        self.cache_dir = cache_dir or get_settings().model_cache_dir
        self.adapter_slots = adapter_slots
        self.bases: dict[str, Any] = {}
        self.lock = threading.Lock()

    def base(self, uri: str) -> Any:
        """The shared base of a catalogue URI (loaded on first use)."""
        from flowrl.backends.tinker_engine import SharedBase

        path = resolve_base_model(uri, self.cache_dir)
        with self.lock:
            if path not in self.bases:
                self.bases[path] = SharedBase(path, slots=self.adapter_slots)
            return self.bases[path]

    def start(self, spec: dict[str, Any]) -> ModelHandle:
        from flowrl.backends.tinker_engine import TinkerModel

        base = self.base(spec["base_uri"])
        return LocalHandle(TinkerModel(base, spec["lora"], spec["seed"], name=spec["model_id"]))


def resolve_base_model(uri: str, cache_dir: str) -> str:
    """A catalogue URI as a local folder: ``tiny`` (the default tiny model, built once into
    the model cache), a local folder, ``s3://`` or ``models:/``."""
    from flowrl.backends.model_uri import (
        build_tiny_model_once,
        resolve_model_uri,
        tiny_model_key,
        tiny_model_slot,
    )
    from flowrl.backends.tiny_model import TinyModelSpec

    if uri == "tiny":  # the build a job of the default tiny model uses too
        spec = TinyModelSpec()
        return str(build_tiny_model_once(spec, tiny_model_slot(cache_dir, tiny_model_key(spec))))
    return resolve_model_uri(uri, cache_dir)


# --------------------------------------------------------------------------- state


@dataclass
class _Session:
    session_id: str
    namespace: str | None
    display_name: str | None
    user_metadata: dict[str, str]
    heartbeat: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    ended: str | None = None


@dataclass
class _Model:
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


@dataclass
class _Sampler:
    sampler_id: str
    namespace: str | None
    base_model: str
    model_path: str | None
    model_id: str | None  # the live training model whose worker samples, else a pool model
    weights: str | None  # the snapshot key on that model; None: the base model alone
    pool: _Model | None = None  # the model that serves a saved path (set when it is loaded)
    clients: int = 0


@dataclass
class _Future:
    namespace: str | None
    kind: str
    future: concurrent.futures.Future
    created: float = field(default_factory=time.monotonic)


def _now() -> str:
    return datetime.now(UTC).isoformat()


class TinkerService:
    """The service's state and verbs (``create_app`` puts HTTP in front of it)."""

    def __init__(
        self,
        placement: Placement,
        catalogue: dict[str, str] | None = None,
        keys: dict[str, str | None] | None = None,
        storage_url: str | None = None,
        limits: Limits | None = None,
        sampler_placement: Placement | None = None,
    ):
        settings = get_settings()
        self.placement = placement
        if sampler_placement is None:  # in this process; sharing the models' bases if they are
            in_process = getattr(placement, "in_process", False)
            sampler_placement = placement if in_process else LocalPlacement()
        self.sampler_placement = sampler_placement
        self.catalogue = dict(catalogue if catalogue is not None else settings.tinker_models)
        self.keys = {_digest(k): ns for k, ns in (keys or {}).items()}
        self.storage = Storage(storage_url or settings.storage_root)
        self.limits = limits or Limits()
        self.lock = threading.RLock()
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.futures: dict[str, _Future] = {}
        self.pool: dict[tuple, _Model] = {}  # samplers of saved paths and base models
        self.try_again = 0  # 408 answers to retrieve_future (a result not ready in a long poll)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="tinker-reaper")
        self._reaper.start()

    # ------------------------------------------------------------------- auth and paths

    def namespace_of(self, key: str | None) -> str | None:
        """The caller's namespace; ``ServiceError(401)`` for a missing or unknown key."""
        if not self.keys:
            return INSECURE_NAMESPACE
        if not key:
            raise ServiceError(401, "missing API key (X-API-Key)")
        digest = _digest(key)
        for known, namespace in self.keys.items():
            if hmac.compare_digest(known, digest):
                return namespace
        raise ServiceError(401, "unknown API key")

    def prefix(self, namespace: str | None) -> str:
        return tinker_prefix(namespace)

    def run_dir(self, namespace: str | None, run_id: str) -> str:
        return run_folder(namespace, run_id)

    def parse_path(self, namespace: str | None, path: Any) -> tuple[str, str, str]:
        """(run id, kind, storage folder) of the caller's checkpoint at ``path``."""
        return checkpoint_folder(self.storage, namespace, path)

    def base_uri(self, name: str) -> str:
        if name not in self.catalogue:
            raise ServiceError(
                400,
                f"unknown base model {name[:120]!r} (this server has: {sorted(self.catalogue)})",
            )
        return self.catalogue[name]

    # ------------------------------------------------------------------- futures

    def submit(self, namespace: str | None, kind: str, worker: Any, fn: Callable[[], Any]) -> str:
        request_id = secrets.token_hex(12)
        future = worker.submit(fn)
        with self.lock:
            self.futures[request_id] = _Future(namespace, kind, future)
        return request_id

    def future(self, namespace: str | None, request_id: str) -> _Future:
        with self.lock:
            entry = self.futures.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry.namespace != namespace:
            raise not_found(f"no future {str(request_id)[:80]!r}")
        return entry

    # ------------------------------------------------------------------- sessions

    def create_session(self, namespace: str | None, body: dict) -> str:
        session_id = secrets.token_hex(8)
        meta = body.get("user_metadata") or {}
        if not isinstance(meta, dict):
            raise ServiceError(400, "user_metadata must be an object")
        with self.lock:
            self.sessions[session_id] = _Session(
                session_id,
                namespace,
                body.get("display_name"),
                {str(k): str(v) for k, v in meta.items()},
            )
        return session_id

    def session(self, namespace: str | None, session_id: Any, live: bool = True) -> _Session:
        with self.lock:
            s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None or s.namespace != namespace:
            raise not_found(f"no session {str(session_id)[:80]!r}")
        if live and s.ended:
            raise ServiceError(410, f"session {session_id} has ended ({s.ended})")
        return s

    def heartbeat(self, namespace: str | None, session_id: Any) -> None:
        s = self.session(namespace, session_id)
        s.heartbeat = time.monotonic()

    def end_session(self, session: _Session, why: str) -> None:
        with self.lock:
            if session.ended:
                return
            session.ended = why
            models = [self.models[m] for m in session.models if m in self.models]
        for model in models:
            self.unload(model, why)

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            with self.lock:
                stale = [
                    s
                    for s in self.sessions.values()
                    if not s.ended and now - s.heartbeat > self.limits.session_ttl_s
                ]
                old = [
                    k
                    for k, f in self.futures.items()
                    if f.future.done() and now - f.created > self.limits.future_ttl_s
                ]
                for k in old:
                    del self.futures[k]
            for s in stale:
                self.end_session(s, f"no heartbeat for {self.limits.session_ttl_s:g} s")

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            sessions = list(self.sessions.values())
            pool = list(self.pool.values())
        for s in sessions:
            self.end_session(s, "server stopped")
        for model in pool:
            self.unload(model, "server stopped")

    # ------------------------------------------------------------------- models

    def model(self, namespace: str | None, model_id: Any) -> _Model:
        with self.lock:
            m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or m.namespace != namespace:
            raise not_found(f"no model {str(model_id)[:80]!r}")
        if m.ended:
            raise ServiceError(410, f"model {model_id} is unloaded ({m.ended})")
        return m

    def new_model(
        self,
        namespace: str | None,
        session_id: str,
        seq: int,
        base_model: str,
        lora: LoraSettings,
        meta: dict,
        seed: int | None = None,
    ) -> _Model:
        session = self.session(namespace, session_id)
        uri = self.base_uri(base_model)
        model_id = f"{session_id}:train:{int(seq)}"
        if not RUN_PATTERN.match(model_id):
            raise ServiceError(400, f"bad model_seq_id {seq!r}")
        with self.lock:
            if model_id in self.models:
                raise ServiceError(409, f"model {model_id} exists")
            live = sum(1 for m in self.models.values() if m.namespace == namespace and not m.ended)
            if live >= self.limits.max_models_per_namespace:
                raise ServiceError(  # 403, not 429: the SDK would retry a 429 for minutes
                    403,
                    f"at most {self.limits.max_models_per_namespace} live models per key: "
                    "close a session or unload a model first",
                )
            model = _Model(model_id, namespace, session_id, base_model, lora, seed)
            self.models[model_id] = model
            session.models.append(model_id)
        run = {
            "training_run_id": model_id,
            "base_model": base_model,
            "lora": tinker_lora_config(lora, seed),
            "model_owner": namespace or "local",
            "created": _now(),
            "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()},
        }
        self.storage.write_json(f"{self.run_dir(namespace, model_id)}/run.json", run)
        spec = {
            "model_id": model_id,
            "namespace": namespace,
            "base_model": base_model,
            "base_uri": uri,
            "lora": lora,
            "seed": seed,
            "session_id": session_id,
        }

        def start() -> dict:
            try:
                model.handle = self.placement.start(spec)
            except BaseException as e:
                model.ended = f"it did not start: {type(e).__name__}: {e}"[:500]  # slot freed
                raise
            return {"model_id": model_id, "type": "create_model"}

        model.start = start
        return model

    def unload(self, model: _Model, why: str) -> None:
        with self.lock:
            if model.ended:
                return
            model.ended = why

        def stop() -> None:
            if model.handle is not None:
                model.handle.close()
                model.handle = None

        model.worker.submit(stop)
        model.worker.shutdown(wait=False)

    def run_on(
        self,
        model: _Model,
        kind: str,
        fn: Callable[[ModelHandle], Any],
        namespace: str | None = None,
    ) -> str:
        """Queue ``fn(handle)`` on the model's worker; the id of the future, which belongs to
        ``namespace`` (default the model's; a shared sampling model's futures are the
        caller's)."""

        def work() -> Any:
            if model.handle is None:
                raise ServiceError(410, f"model {model.model_id} is unloaded ({model.ended})")
            return fn(model.handle)

        try:
            return self.submit(namespace or model.namespace, kind, model.worker, work)
        except RuntimeError:  # the worker was shut down: the model was unloaded meanwhile
            raise ServiceError(410, f"model {model.model_id} is unloaded ({model.ended})") from None

    # ------------------------------------------------------------------- checkpoints

    def save(self, model: _Model, kind: str, name: str | None, optimizer: bool, meta: dict) -> str:
        """Queue a save of ``model`` as ``kind`` (weights | sampler_weights) named ``name``."""
        if name is None:
            name = f"{'state' if kind == 'weights' else 'sampler'}-{secrets.token_hex(4)}"
        if not NAME_PATTERN.match(name):
            raise ServiceError(400, f"bad checkpoint name {name[:80]!r} (letters, digits, . _ -)")
        folder = f"{self.run_dir(model.namespace, model.model_id)}/{kind}/{name}"
        path = f"tinker://{model.model_id}/{kind}/{name}"
        storage = self.storage

        def work(handle: ModelHandle) -> dict:
            files = handle.call("state_bytes", optimizer)
            for file, data in files.items():
                storage.write_bytes(f"{folder}/{file}", data)
            record = {
                "checkpoint_id": f"{kind}/{name}",
                "checkpoint_type": KINDS[kind],
                "time": _now(),
                "tinker_path": path,
                "size_bytes": sum(len(v) for v in files.values()),
                "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()} or None,
                "base_model": model.base_model,
                "lora": tinker_lora_config(model.lora, model.seed),
            }
            storage.write_json(f"{folder}/checkpoint.json", record)
            if kind == "sampler_weights":
                handle.call("add_snapshot_bytes", path, files["adapter.safetensors"])
            return {
                "path": path,
                "type": "save_weights" if kind == "weights" else "save_weights_for_sampler",
            }

        return self.run_on(model, "save", work)

    def read_checkpoint(self, folder: str, optimizer: bool) -> dict[str, bytes]:
        files = {"adapter.safetensors": self.storage.read_bytes(f"{folder}/adapter.safetensors")}
        if optimizer:
            if not self.storage.exists(f"{folder}/optimizer.pt"):
                raise ServiceError(400, "this checkpoint has no optimizer state")
            files["optimizer.pt"] = self.storage.read_bytes(f"{folder}/optimizer.pt")
        return files

    def checkpoint_record(self, folder: str) -> dict:
        return self.storage.read_json(f"{folder}/checkpoint.json")

    def runs(self, namespace: str | None) -> list[dict]:
        prefix = self.prefix(namespace)
        out = []
        for entry in self.storage.list(prefix) if self.storage.exists(prefix) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if self.storage.exists(f"{prefix}/{name}/run.json"):
                out.append(self.storage.read_json(f"{prefix}/{name}/run.json"))
        return sorted(out, key=lambda r: r.get("created", ""), reverse=True)

    def checkpoints(self, namespace: str | None, run_id: str) -> list[dict]:
        run_dir = self.run_dir(namespace, run_id)
        if not self.storage.exists(f"{run_dir}/run.json"):
            raise not_found(f"no training run {run_id!r}")
        out = []
        for kind in KINDS:
            base = f"{run_dir}/{kind}"
            if not self.storage.exists(base):
                continue
            for entry in self.storage.list(base):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if self.storage.exists(f"{base}/{name}/checkpoint.json"):
                    out.append(self.storage.read_json(f"{base}/{name}/checkpoint.json"))
        return sorted(out, key=lambda c: c["time"])

    # ------------------------------------------------------------------- samplers

    def sampler_pool_model(
        self, base_model: str, lora: LoraSettings, seed: int | None = None
    ) -> _Model:
        """A model of this service for sampling saved paths of ``lora``'s shape (or the base
        model alone), shared by every caller: it holds no one's training state."""
        key = (base_model, tuple(sorted(tinker_lora_config(lora, seed).items())))
        with self.lock:
            model = self.pool.get(key)
            if model is None:
                model = _Model(f"pool-{len(self.pool)}", None, "", base_model, lora, seed)
                self.pool[key] = model
                uri = self.base_uri(base_model)
                spec = {
                    "model_id": model.model_id,
                    "namespace": None,
                    "base_model": base_model,
                    "base_uri": uri,
                    "lora": lora,
                    "seed": seed,
                    "session_id": "",
                }

                def start() -> None:
                    model.handle = self.sampler_placement.start(spec)

                model.worker.submit(start)
        return model

    def add_sampler(self, namespace: str | None, session: _Session, sampler: _Sampler) -> str:
        with self.lock:
            self.samplers[sampler.sampler_id] = sampler
            session.samplers.append(sampler.sampler_id)
        return sampler.sampler_id

    def sampler(self, namespace: str | None, sampler_id: Any) -> _Sampler:
        with self.lock:
            s = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if s is None or s.namespace != namespace:
            raise not_found(f"no sampler {str(sampler_id)[:80]!r}")
        return s

    def sampler_from_path(self, namespace: str | None, session: _Session, path: str) -> str:
        run_id, kind, folder = self.parse_path(namespace, path)
        record = self.checkpoint_record(folder)
        lora, seed = read_tinker_lora(record["lora"])
        with self.lock:
            live = self.models.get(run_id)
        if live is not None and not live.ended and live.namespace == namespace:
            target = live
        else:
            target = self.sampler_pool_model(record["base_model"], lora, seed)
        data = self.storage.read_bytes(f"{folder}/adapter.safetensors")
        target.worker.submit(lambda: target.handle.call("add_snapshot_bytes", path, data)).result()
        sampler = _Sampler(
            f"{session.session_id}:sample:{secrets.token_hex(4)}",
            namespace,
            record["base_model"],
            path,
            target.model_id if target is live else None,
            path,
            pool=target,
        )
        return self.add_sampler(namespace, session, sampler)

    def sampler_target(self, sampler: _Sampler) -> _Model:
        if sampler.pool is not None:
            return sampler.pool
        if sampler.model_id is not None:
            return self.model(sampler.namespace, sampler.model_id)
        return self.sampler_pool_model(sampler.base_model, tinker_lora(rank=1))


# --------------------------------------------------------------------------- HTTP


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ServiceError(
            400, f"malformed {model.__name__}: {where}: {first.get('msg', 'invalid')}"[:300]
        ) from None


def _params(params: Any) -> SampleParams:
    """The sampling parameters, checked (what depends on the model: ``_fits``)."""
    max_tokens = 64 if params.max_tokens is None else params.max_tokens
    if not 1 <= max_tokens <= 2**20:
        raise ServiceError(400, f"max_tokens must be >= 1, got {max_tokens}")
    temperature, top_p = float(params.temperature), float(params.top_p)
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1):
        raise ServiceError(400, "temperature must be a finite number >= 0 and top_p in (0, 1]")
    if params.seed is not None and not 0 <= params.seed < 2**63:
        raise ServiceError(400, f"seed must be in [0, 2**63), got {params.seed}")
    stop = params.stop
    tokens: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop:
        items = list(stop)
        if all(isinstance(s, str) for s in items):
            strings = tuple(items)
        elif all(isinstance(s, int) for s in items):
            tokens = tuple(items)
        else:
            raise ServiceError(400, "stop must be token ids or strings, not both")
    return SampleParams(
        max_tokens=int(max_tokens),
        temperature=temperature,
        top_k=int(params.top_k),
        top_p=top_p,
        stop_tokens=tokens,
        stop_strings=strings,
        seed=params.seed,
    )


def _fits(prompt: list[int], params: SampleParams, info: dict[str, int]) -> None:
    """The prompt and stop tokens are in the model's vocabulary, and prompt + max_tokens fits
    its context (``TinkerInputError``, a 400, otherwise)."""
    check_tokens(prompt, info["vocab_size"], "prompt")
    check_tokens(params.stop_tokens, info["vocab_size"], "stop")
    context = info["context_length"]
    if context and len(prompt) + params.max_tokens > context:
        raise TinkerInputError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context length {context}"
        )


def _prompt_tokens(prompt: Any) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise ServiceError(
                400, f"prompt chunk {getattr(chunk, 'type', '?')!r} is not supported here"
            )
        tokens.extend(int(t) for t in chunk.tokens)
    return tokens


def create_app(service: TinkerService) -> FastAPI:
    """HTTP in front of ``service`` (see the module docstring)."""
    from tinker import types as t

    app = FastAPI(title="flowrl Tinker API")
    app.state.service = service
    limits = service.limits

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        refusal = body_size_refusal(
            request.method, request.headers.get("content-length"), limits.max_body_bytes
        )
        if refusal is not None:
            return _error(*refusal)
        path = request.url.path
        if path not in (f"{API}/healthz", f"{API}/client/config", f"{API}/client/dynamic_config"):
            try:
                request.state.ns = service.namespace_of(request.headers.get("x-api-key"))
            except ServiceError as e:
                return _error(e.status, str(e))
        try:
            return await call_next(request)
        except ServiceError as e:
            return _error(e.status, str(e))
        except TinkerInputError as e:
            return _error(400, str(e))

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> Response:
        return _error(exc.status, str(exc))

    @app.exception_handler(TinkerInputError)
    async def input_error(request: Request, exc: TinkerInputError) -> Response:
        return _error(400, str(exc))

    async def body(request: Request) -> dict:
        raw = await request.body()
        try:
            data = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ServiceError(400, "malformed JSON body") from None
        if not isinstance(data, dict):
            raise ServiceError(400, "the JSON body must be an object")
        return data

    def future_answer(request_id: str, model_id: str | None = None, **extra: Any) -> dict:
        return {"request_id": request_id, "model_id": model_id, **extra}

    # ---------------------------------------------------------------- config, health

    @app.post(f"{API}/client/config")
    async def client_config() -> dict:
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": False,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get(f"{API}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict:
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True}
                for name in sorted(service.catalogue)
            ]
        }

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    # ---------------------------------------------------------------- sessions

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict:
        data = await body(request)
        _parse(t.CreateSessionRequest, data)
        return {
            "type": "create_session",
            "session_id": service.create_session(request.state.ns, data),
        }

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        data = await body(request)
        service.heartbeat(request.state.ns, data.get("session_id"))
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(request: Request, session_id: str) -> Response:
        session = service.session(request.state.ns, session_id, live=False)
        await asyncio.to_thread(service.end_session, session, "finished by the client")
        return Response(status_code=200, content=b"null", media_type="application/json")

    @app.get(f"{API}/sessions")
    async def sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
        ns = request.state.ns
        with service.lock:
            ids = [s.session_id for s in service.sessions.values() if s.namespace == ns]
        return {"sessions": ids[offset : offset + limit]}

    @app.get(f"{API}/sessions/{{session_id}}")
    async def get_session(request: Request, session_id: str) -> dict:
        s = service.session(request.state.ns, session_id, live=False)
        return {
            "training_run_ids": list(s.models),
            "sampler_ids": list(s.samplers),
            "user_metadata": s.user_metadata or None,
            "display_name": s.display_name,
        }

    # ---------------------------------------------------------------- models

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict:
        req = _parse(t.CreateModelRequest, await body(request))
        if req.lora_config is None:
            raise ServiceError(400, "only LoRA training models are served here (lora_config)")
        if not 1 <= req.lora_config.rank <= 256:
            raise ServiceError(400, f"LoRA rank must be 1..256, got {req.lora_config.rank}")
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise ServiceError(
                400, f"optimizer {req.optimizer_config.type!r} is not supported (adamw)"
            )
        c = req.lora_config
        lora = tinker_lora(c.rank, c.train_mlp, c.train_attn, c.train_unembed)
        ns = request.state.ns
        model = await asyncio.to_thread(
            service.new_model,
            ns,
            req.session_id,
            req.model_seq_id,
            req.base_model,
            lora,
            req.user_metadata or {},
            c.seed,
        )
        rid = service.submit(ns, "create_model", model.worker, model.start)
        return future_answer(rid, model.model_id)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict:
        req = _parse(t.GetInfoRequest, await body(request))
        model = service.model(request.state.ns, req.model_id)
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {"arch": "lora", "model_name": model.base_model, "tokenizer_id": None},
            "is_lora": True,
            "lora_rank": model.lora.r,
            "model_name": model.base_model,
        }

    @app.post(f"{API}/unload_model")
    async def unload_model(request: Request) -> dict:
        req = _parse(t.UnloadModelRequest, await body(request))
        model = service.model(request.state.ns, req.model_id)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result({"model_id": model.model_id, "type": "unload_model"})
        await asyncio.to_thread(service.unload, model, "unloaded by the client")
        rid = secrets.token_hex(12)
        with service.lock:
            service.futures[rid] = _Future(model.namespace, "unload", done)
        return future_answer(rid, model.model_id)

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict:
        data = await body(request)
        _, _, folder = await asyncio.to_thread(
            service.parse_path, request.state.ns, data.get("tinker_path")
        )
        record = await asyncio.to_thread(service.checkpoint_record, folder)
        lora = record["lora"]
        return {
            "base_model": record["base_model"],
            "is_lora": True,
            "lora_rank": lora["rank"],
            "train_unembed": lora["train_unembed"],
            "train_mlp": lora["train_mlp"],
            "train_attn": lora["train_attn"],
        }

    # ---------------------------------------------------------------- training

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        raw = await request.body()
        ctype = request.headers.get("content-type", "")
        if "protobuf" not in ctype:
            raise ServiceError(415, "forward_backward takes application/x-protobuf")
        raw = decompress(raw, request.headers.get("content-encoding"), 4 * limits.max_body_bytes)
        call = read_forward_backward(raw)
        model = service.model(request.state.ns, call.model_id)
        if model.handle is not None:
            check_batch(call.data, call.loss_fn, call.config, model.handle.info["vocab_size"])

        def work(handle: ModelHandle) -> bytes:  # the model checks the batch again, once up
            out = handle.call(
                "forward_backward", call.data, call.loss_fn, call.config, call.forward_only
            )
            return write_forward_output(out)

        return future_answer(service.run_on(model, "forward_backward", work), model.model_id)

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict:
        req = _parse(t.OptimStepRequest, await body(request))
        model = service.model(request.state.ns, req.model_id)
        params = req.optim_params
        if not isinstance(params, t.AdamParams):
            raise ServiceError(
                400, f"optimizer params {getattr(params, 'type', '?')!r} are not supported (adam)"
            )
        for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            if not 0 <= getattr(params, name) < float("inf"):
                raise ServiceError(400, f"adam_params.{name} must be a finite number >= 0")
        if not (0 <= params.beta1 < 1 and 0 <= params.beta2 < 1):
            raise ServiceError(400, "adam_params.beta1 and beta2 must be in [0, 1)")
        kwargs = params.model_dump()

        def work(handle: ModelHandle) -> dict:
            return {"metrics": handle.call("optim_step", **kwargs)}

        return future_answer(service.run_on(model, "optim_step", work), model.model_id)

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict:
        req = _parse(t.SaveWeightsRequest, await body(request))
        model = service.model(request.state.ns, req.model_id)
        rid = service.save(model, "weights", req.path, True, req.user_metadata or {})
        return future_answer(rid, model.model_id)

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        req = _parse(t.SaveWeightsForSamplerRequest, await body(request))
        ns = request.state.ns
        model = service.model(ns, req.model_id)
        if req.path is not None:
            rid = service.save(model, "sampler_weights", req.path, False, req.user_metadata or {})
            return future_answer(rid, model.model_id)
        session = service.session(ns, model.session_id)
        with service.lock:
            model.snapshots += 1
            key = f"snapshot-{model.snapshots}"
        sampler_id = service.add_sampler(
            ns,
            session,
            _Sampler(
                f"{model.model_id}:snapshot:{model.snapshots}",
                ns,
                model.base_model,
                None,
                model.model_id,
                key,
            ),
        )

        def work(handle: ModelHandle) -> dict:
            handle.call("snapshot", key)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return future_answer(
            service.run_on(model, "save_weights_for_sampler", work), model.model_id
        )

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict:
        req = _parse(t.LoadWeightsRequest, await body(request))
        ns = request.state.ns
        _, kind, folder = await asyncio.to_thread(service.parse_path, ns, req.path)
        if req.optimizer and kind != "weights":
            raise ServiceError(
                400, "a sampler checkpoint has no optimizer state (save_state saves one)"
            )
        record = await asyncio.to_thread(service.checkpoint_record, folder)
        lora, seed = read_tinker_lora(record["lora"])
        if req.model_id is not None:
            model = service.model(ns, req.model_id)
            # The adapter's shape must match; its init seed need not.
            if lora != model.lora or record["base_model"] != model.base_model:
                raise ServiceError(
                    400, f"{req.path} was saved from another base model or LoRA shape"
                )
        else:
            if req.session_id is None or req.model_seq_id is None:
                raise ServiceError(
                    400, "load_weights needs model_id, or session_id and model_seq_id"
                )
            base = req.base_model or record["base_model"]
            if base != record["base_model"]:
                raise ServiceError(
                    400, f"{req.path} was trained on {record['base_model']!r}, not {base!r}"
                )
            model = await asyncio.to_thread(
                service.new_model,
                ns,
                req.session_id,
                req.model_seq_id,
                base,
                lora,
                req.user_metadata or {},
                seed,
            )
        files = await asyncio.to_thread(service.read_checkpoint, folder, req.optimizer)
        start = model.start if model.handle is None else None
        path = req.path

        def work(handle: ModelHandle | None = None) -> dict:
            if start is not None:
                start()
            model.handle.call("load_state_bytes", files, req.optimizer)
            return {"path": path, "model_id": model.model_id, "type": "load_weights"}

        if start is not None:
            rid = service.submit(ns, "load_weights", model.worker, work)
        else:
            rid = service.run_on(model, "load_weights", work)
        return future_answer(rid, model.model_id)

    # ---------------------------------------------------------------- sampling

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        req = _parse(t.CreateSamplingSessionRequest, await body(request))
        ns = request.state.ns
        session = service.session(ns, req.session_id)
        if req.model_path:
            sid = await asyncio.to_thread(service.sampler_from_path, ns, session, req.model_path)
        else:
            if not req.base_model:
                raise ServiceError(400, "create_sampling_session needs model_path or base_model")
            service.base_uri(req.base_model)
            sid = service.add_sampler(
                ns,
                session,
                _Sampler(
                    f"{session.session_id}:sample:{secrets.token_hex(4)}",
                    ns,
                    req.base_model,
                    None,
                    None,
                    None,
                ),
            )
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.post(f"{API}/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict:
        req = _parse(t.JoinSamplingSessionRequest, await body(request))
        sampler = service.sampler(request.state.ns, req.sampling_session_id)
        with service.lock:
            sampler.clients += 1
            return {"type": "join_sampling_session", "client_counter": sampler.clients}

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(request: Request, sampler_id: str) -> dict:
        s = service.sampler(request.state.ns, sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict:
        req = _parse(t.SampleRequest, await body(request))
        ns = request.state.ns
        if req.sampling_session_id is None:
            raise ServiceError(
                400, "asample needs a sampling_session_id (create a sampling client first)"
            )
        sampler = service.sampler(ns, req.sampling_session_id)
        unsupported = [
            name
            for name, value in (
                ("topk_prompt_logprobs", req.topk_prompt_logprobs),
                ("topk_sample_logprobs", req.topk_sample_logprobs),
                ("target_prompt_logprobs", req.target_prompt_logprobs),
                ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
                ("prompt_logprobs_last_n", req.prompt_logprobs_last_n),
            )
            if value
        ]
        if unsupported:
            raise ServiceError(400, f"not supported here: {', '.join(unsupported)}")
        if not 1 <= req.num_samples <= limits.max_samples:
            raise ServiceError(
                400, f"num_samples must be 1..{limits.max_samples}, got {req.num_samples}"
            )
        prompt = _prompt_tokens(req.prompt)
        if not prompt:
            raise ServiceError(400, "the prompt is empty")
        params = _params(req.sampling_params)
        target = service.sampler_target(sampler)
        if target.handle is not None:  # else checked on the model's worker, once it is up
            _fits(prompt, params, target.handle.info)
        weights = sampler.weights
        n = req.num_samples
        want_prompt = bool(req.prompt_logprobs)

        def work(handle: ModelHandle) -> bytes:  # the model checks prompt and context again
            return write_sample_response(
                handle.call("sample", prompt, n, params, weights, want_prompt)
            )

        rid = service.run_on(target, "sample", work, namespace=ns)
        return future_answer(rid, None, sample_sequence_ids=[f"{rid}:{i}" for i in range(n)])

    # ---------------------------------------------------------------- futures

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        data = await body(request)
        entry = service.future(request.state.ns, data.get("request_id"))
        if entry.future.cancelled():
            return JSONResponse({"error": "the request was cancelled", "category": "user"})
        try:
            result = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(entry.future)), limits.long_poll_s
            )
        except TimeoutError:
            service.try_again += 1
            return JSONResponse(
                {"type": "try_again", "request_id": data["request_id"], "queue_state": "active"},
                status_code=408,
            )
        except (ServiceError, TinkerInputError) as e:
            return JSONResponse({"error": str(e), "category": "user"})
        except Exception as e:  # the model's own failure: the future fails, the server serves on
            return JSONResponse({"error": f"{type(e).__name__}: {e}"[:2000], "category": "server"})
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return JSONResponse(result)

    @app.post(f"{API}/cancel_future")
    async def cancel_future(request: Request) -> Response:
        data = await body(request)
        service.future(request.state.ns, data.get("request_id")).future.cancel()
        return Response(status_code=200, content=b"null", media_type="application/json")

    # ---------------------------------------------------------------- runs, checkpoints

    def run_view(run: dict, checkpoints: list[dict]) -> dict:
        last = {k: None for k in ("training", "sampler")}
        for c in checkpoints:
            last[c["checkpoint_type"]] = c
        return {
            "training_run_id": run["training_run_id"],
            "base_model": run["base_model"],
            "model_owner": run["model_owner"],
            "is_lora": True,
            "lora_rank": run["lora"]["rank"],
            "last_request_time": run["created"],
            "last_checkpoint": checkpoint_view(last["training"]),
            "last_sampler_checkpoint": checkpoint_view(last["sampler"]),
            "user_metadata": run.get("user_metadata") or None,
        }

    def checkpoint_view(c: dict | None) -> dict | None:
        if c is None:
            return None
        keys = (
            "checkpoint_id",
            "checkpoint_type",
            "time",
            "tinker_path",
            "size_bytes",
            "user_metadata",
        )
        return {k: c.get(k) for k in keys}

    @app.get(f"{API}/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
        ns = request.state.ns
        runs = await asyncio.to_thread(service.runs, ns)
        page = runs[offset : offset + max(0, limit)]
        views = []
        for run in page:
            cps = await asyncio.to_thread(service.checkpoints, ns, run["training_run_id"])
            views.append(run_view(run, cps))
        return {
            "training_runs": views,
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def training_run(request: Request, run_id: str) -> dict:
        ns = request.state.ns
        cps = await asyncio.to_thread(service.checkpoints, ns, run_id)
        run = await asyncio.to_thread(
            service.storage.read_json, f"{service.run_dir(ns, run_id)}/run.json"
        )
        return run_view(run, cps)

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def run_checkpoints(request: Request, run_id: str) -> dict:
        cps = await asyncio.to_thread(service.checkpoints, request.state.ns, run_id)
        return {"checkpoints": [checkpoint_view(c) for c in cps]}

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(request: Request, run_id: str, kind: str, name: str) -> Response:
        _, _, folder = await asyncio.to_thread(
            service.parse_path, request.state.ns, f"tinker://{run_id}/{kind}/{name}"
        )
        await asyncio.to_thread(service.storage.delete, folder)
        return Response(status_code=200, content=b"null", media_type="application/json")

    @app.get(f"{API}/checkpoints")
    async def all_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
        ns = request.state.ns
        out: list[dict] = []
        for run in await asyncio.to_thread(service.runs, ns):
            out += await asyncio.to_thread(service.checkpoints, ns, run["training_run_id"])
        page = out[offset : offset + max(0, limit)]
        return {
            "checkpoints": [checkpoint_view(c) for c in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(out)},
        }

    return app


# --------------------------------------------------------------------------- main


def check_keys(args: Any) -> dict[str, str | None]:
    """The keys to serve, or an error naming why the service may not start without them."""
    keys = read_keys(args.keys_file)
    if not keys:
        if not args.insecure_loopback:
            raise SystemExit(
                "no keys: give --keys-file or FLOWRL_TINKER_KEYS, or "
                "--insecure-loopback on a loopback address"
            )
        host = args.host if args.host != "localhost" else "127.0.0.1"
        if not ipaddress.ip_address(host).is_loopback:
            raise SystemExit(f"--insecure-loopback serves loopback addresses only, not {args.host}")
    return keys


def serve(args: Any, placement: Placement) -> None:
    """Run the service until interrupted; its models are unloaded on the way out."""
    import uvicorn

    keys = check_keys(args)
    limits = Limits(session_ttl_s=args.session_ttl, max_body_bytes=args.max_body_bytes)
    service = TinkerService(placement, keys=keys, limits=limits)
    try:
        uvicorn.run(
            create_app(service),
            host=args.host,
            port=args.port,
            log_level="warning",
            limit_concurrency=512,
            timeout_keep_alive=30,
        )
    finally:
        service.close()
