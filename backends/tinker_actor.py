"""Where a Tinker session's model lives when sessions are flowrl jobs: the Ray actor that holds
it (``TinkerActor``, started by the ``tinker-session`` flow run) and the service's side
(``SessionPlacement``: submit the run, find its actor by name; ``RayHandle``: call it). Or,
``SharedWorkerPlacement``: each model a tenant of its base model's shared worker
(``backends.shared_worker``), next to ``rl-train`` jobs' adapters.

The actor is named ``tinker-<model>`` in Ray's ``flowrl`` namespace. One call at a time runs on
the model, while ``poll`` (the flow run's supervision) waits for the metrics it records (loss per
``forward_backward``, tokens, learning rate and gradient norm per ``optim_step``) or for
``close`` (the service unloads the model): then the run ends and its GPU slots are freed.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import ray

from flowrl.backends.types import LoraSettings
from flowrl.infra.settings import get_settings

ACTOR_PREFIX = "tinker-"
RAY_NAMESPACE = "flowrl"
START_TIMEOUT_S = 900.0


def actor_name(model_id: str) -> str:
    return ACTOR_PREFIX + model_id.replace(":", "-")


@ray.remote(max_concurrency=4)
class TinkerActor:
    """A ``TinkerModel`` in a Ray worker: one call at a time on the model, while ``poll``
    (the flow run's) waits for metrics or the end."""

    def __init__(self, base_uri: str, lora: LoraSettings, seed: int | None, cache_dir: str):
        from flowrl.backends.tinker_engine import TinkerModel
        from flowrl.backends.tinker_service import resolve_base_model

        self.model = TinkerModel(resolve_base_model(base_uri, cache_dir), lora, seed)
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.metrics: list[dict[str, float]] = []
        self.closed = False
        self.step = 0

    def info(self) -> dict[str, int]:
        return {"vocab_size": self.model.vocab_size, "context_length": self.model.context_length}

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        with self.lock:
            if self.closed:
                raise RuntimeError("this model is unloaded")
            out = getattr(self.model, method)(*args, **kwargs)
            self._record(method, args, out)
        return out

    def _record(self, method: str, args: tuple, out: Any) -> None:
        row: dict[str, float] = {}
        if method == "forward_backward" and not args[3]:  # forward-only calls train nothing
            row = {"train/loss_sum": out.metrics["loss:sum"]}
            row["train/tokens"] = float(sum(len(d.tokens) for d in args[0]))
            row["train/datums"] = float(len(args[0]))
        elif method == "optim_step":
            self.step += 1
            row = {"optim/lr": out["learning_rate:mean"], "optim/grad_norm": out["grad_norm:mean"]}
        if row:
            with self.changed:
                self.metrics.append({**row, "step": float(self.step)})
                self.changed.notify_all()

    def poll(self, timeout: float) -> tuple[bool, list[dict[str, float]]]:
        """The metrics recorded since the last poll, and whether the model is unloaded."""
        with self.changed:
            if not self.metrics and not self.closed:
                self.changed.wait(timeout)
            rows, self.metrics = self.metrics, []
            return self.closed, rows

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


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


class SessionPlacement:
    """Each training model a run of the ``tinker-session`` deployment (``resources.gpus`` =
    ``gpus``, queue ``queue``); ``start`` waits until the run's actor answers."""

    def __init__(self, gpus: int = 1, queue: str | None = None, deployment: str = "tinker-session"):
        self.gpus = gpus
        self.queue = queue
        self.deployment = deployment

    def start(self, spec: dict[str, Any]) -> RayHandle:
        from flowrl.infra.client import JobClient

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
        jobs = JobClient()
        run_id = jobs.submit(self.deployment, {"config": config}, queue=self.queue)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor(actor_name(model_id), namespace=RAY_NAMESPACE)
                return RayHandle(actor, run_id, ray.get(actor.info.remote()))
            except ValueError:  # not started yet
                pass
            status = jobs.status(run_id)
            if status.state in ("FAILED", "CRASHED", "CANCELLED", "COMPLETED"):
                raise RuntimeError(
                    f"session run {run_id} ended {status.state} before its model was ready: "
                    f"{status.message or ''}"
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
            join_shared_worker,
            shared_worker_name,
        )
        from flowrl.backends.tinker_service import resolve_base_model
        from flowrl.backends.types import WorkerSpec
        from flowrl.infra.scheduler import adapter_slots

        _connect_ray()
        settings = get_settings()
        path = resolve_base_model(spec["base_uri"], self.cache_dir)
        base = WorkerSpec(model_uri=path, cache_dir=self.cache_dir)
        slot = contextlib.ExitStack()
        name = shared_worker_name(base)
        slot.enter_context(adapter_slots(f"adapter-slots-{name}", settings.shared_adapter_slots))
        placement = SharedPlacement(
            idle_timeout_s=settings.shared_idle_s,
            mix_batches=settings.shared_mix_batches,
            resident=settings.shared_resident,
        )
        try:
            worker, info = join_shared_worker(
                base,
                placement,
                ActorResources(),
                "tinker_join",
                spec["model_id"],
                spec["lora"],
                spec["seed"],
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
        return _answer(self.actor.do.remote("tinker_call", self.model_id, method, args, kwargs))

    def close(self) -> None:
        """Unload the model (the worker goes on for its others) and give its slot back."""
        try:
            ray.get(self.actor.do.remote("tinker_leave", self.model_id), timeout=30)
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
