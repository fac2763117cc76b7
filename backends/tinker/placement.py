"""Where a Tinker training model lives: a ``Placement`` starts it from a spec and gives the
service a ``ModelHandle`` to call its verbs on.

- ``LocalPlacement``: in the service's process (development, tests, the service's own
  samplers); every model of one base model a LoRA tenant of one ``SharedBase``.
- ``SessionPlacement``: each training model a flowrl job, a run of the ``tinker-session`` flow
  that holds the model in a Ray actor (``backends.tinker.actor``), admitted by the scheduler.
  Which runs it submits and how it reads their state are the flow layer's (``SessionRuns``,
  given by ``flows.tinker_session``): a backend never names a deployment.
- ``SharedWorkerPlacement``: each model a tenant of its base model's shared worker
  (``backends.shared_worker``), next to ``rl-train`` jobs' adapters.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Protocol

import ray

from flowrl.backends.tinker.actor import actor_name
from flowrl.backends.tinker.checkpoints import resolve_base_model
from flowrl.infra.settings import RAY_NAMESPACE, get_settings

START_TIMEOUT_S = 900.0


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
    model holds only its LoRA adapter, AdamW state and RNG; with ``resident_adapters`` at most that
    many adapters are resident, the least recently used parked and restored exactly."""

    in_process = True

    def __init__(self, cache_dir: str | None = None, resident_adapters: int | None = None):
        self.cache_dir = cache_dir or get_settings().model_cache_dir
        self.resident_adapters = resident_adapters
        self.bases: dict[str, Any] = {}
        self.lock = threading.Lock()

    def base(self, uri: str) -> Any:
        """The shared base of a catalogue URI (loaded on first use)."""
        from flowrl.backends.tinker.engine import SharedBase

        path = resolve_base_model(uri, self.cache_dir)
        with self.lock:
            if path not in self.bases:
                self.bases[path] = SharedBase(path, resident=self.resident_adapters)
            return self.bases[path]

    def start(self, spec: dict[str, Any]) -> ModelHandle:
        from flowrl.backends.tinker.engine import TinkerModel

        base = self.base(spec["base_uri"])
        return LocalHandle(TinkerModel(base, spec["lora"], spec["seed"], name=spec["model_id"]))


class RayHandle:
    """The service's handle on a session's actor."""

    def __init__(self, actor: Any, flow_run_id: str, info: dict[str, int]):
        self.actor = actor
        self.flow_run_id = flow_run_id
        self.info = info

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _answer(self.actor.call.remote(method, args, kwargs))

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - an actor already gone is closed
            pass


class SessionRuns(Protocol):
    """How a ``SessionPlacement`` starts a session's run and follows it (the flow layer's)."""

    def submit(self, config: dict[str, Any]) -> str:
        """Submit a run of the session flow with this ``TinkerSessionConfig``; its id."""
        ...

    def state(self, run_id: str) -> tuple[str, str]:
        """The run's state name (``RUNNING``, ``FAILED``, …) and message."""
        ...


class SessionPlacement:
    """Each training model a run of the session flow (``resources.gpus`` = ``gpus``), submitted
    through ``runs``; ``start`` waits until the run's actor answers."""

    def __init__(self, runs: SessionRuns, gpus: int = 1):
        self.runs = runs
        self.gpus = gpus

    def start(self, spec: dict[str, Any]) -> RayHandle:
        _connect_ray()
        model_id = spec["model_id"]
        name = f"tinker-{model_id.split(':')[0]}-{model_id.rsplit(':', 1)[-1]}"
        config = {
            "name": name,
            "experiment": "tinker",
            "model_id": model_id,
            "base_model": spec["base_model"],
            "base_uri": spec["base_uri"],
            "lora": spec["lora"].model_dump(mode="json"),
            # The model's seed; a Tinker client that sets none gets a random one, drawn here.
            "seed": secrets.randbits(62) if spec["seed"] is None else spec["seed"],
            "owner": spec["namespace"],
            "resources": {"gpus": self.gpus},
        }
        run_id = self.runs.submit(config)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor(actor_name(model_id), namespace=RAY_NAMESPACE)
                return RayHandle(actor, run_id, ray.get(actor.info.remote()))
            except ValueError:  # not started yet
                pass
            state, message = self.runs.state(run_id)
            if state in ("FAILED", "CRASHED", "CANCELLED", "COMPLETED"):
                raise RuntimeError(
                    f"session run {run_id} ended {state} before its model was ready: {message}"
                )
            time.sleep(0.5)
        raise TimeoutError(f"session run {run_id} did not start its model in {START_TIMEOUT_S} s")


def _answer(ref: Any) -> Any:
    """The call's result, or the error the model raised (a bad input stays a 4xx)."""
    from ray.exceptions import RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        raise (cause if isinstance(cause, Exception) else e) from None


class SharedWorkerPlacement:
    """Each training model a tenant of the shared base-model worker of its base model
    (``backends.shared_worker``: the Ray actor that ``rl-train`` jobs with
    ``resources.placement: shared`` use): the base is held once for Tinker models and jobs
    alike, each model holds its adapter, AdamW and RNG there, and one slot of the worker's
    Prefect limit ``adapter-slots-<worker>`` while it is loaded (a model waits for one)."""

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir or get_settings().model_cache_dir

    def start(self, spec: dict[str, Any]) -> SharedModelHandle:
        import contextlib

        from flowrl.backends.actors import (
            ActorResources,
            SharedPlacement,
            admission,
            join_shared_worker,
        )
        from flowrl.backends.types import ModelTenancy, WorkerSpec

        _connect_ray()
        settings = get_settings()
        path = resolve_base_model(spec["base_uri"], self.cache_dir)
        base = WorkerSpec(model_uri=path, cache_dir=self.cache_dir)
        slot = contextlib.ExitStack()
        slot.enter_context(admission(base, settings.shared_adapter_slots))
        placement = SharedPlacement(
            idle_timeout_s=settings.shared_idle_s,
            mix_batches=settings.shared_mix_batches,
            resident=settings.shared_resident,
        )
        try:
            tenancy = ModelTenancy(spec["lora"], spec["seed"])
            worker, info = join_shared_worker(
                base, placement, ActorResources(), spec["model_id"], tenancy
            )
        except BaseException:
            slot.close()
            raise
        actor = ray.get_actor(worker, namespace=RAY_NAMESPACE)
        return SharedModelHandle(actor, worker, spec["model_id"], info, slot)


class SharedModelHandle:
    """The service's handle on a Tinker model that is a tenant of a shared worker."""

    def __init__(self, actor: Any, worker: str, model_id: str, info: dict, slot: Any):
        self.actor = actor
        self.worker = worker
        self.model_id = model_id
        self.info = info
        self._slot = slot

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _answer(self.actor.call_as.remote(self.model_id, "model", method, *args, **kwargs))

    def close(self) -> None:
        """Unload the model (the worker goes on for its others) and give its slot back."""
        try:
            ray.get(self.actor.do.remote("leave", self.model_id), timeout=30)
        except Exception:  # noqa: BLE001 - a worker already gone holds nothing
            pass
        finally:
            self._slot.close()


def _connect_ray() -> None:
    """This process (the service) joins the stack's Ray cluster, in flowrl's namespace."""
    if ray.is_initialized():
        return
    address = get_settings().ray_address
    if address is None:
        raise RuntimeError("sessions need a Ray cluster: set FLOWRL_RAY_ADDRESS (flowrl stack up)")
    ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
