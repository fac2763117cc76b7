"""Tinker API sessions as flowrl jobs: each training model a flow run of ``tinker-session``.

The Tinker service (``backends.tinker_service``) with ``SessionPlacement`` submits one run of
the ``tinker-session`` deployment per training model. The run is admitted like any job (its work
queue, then ``resources.gpus`` slots of the scheduler's ``gpu`` limit, held through ``JobRun``),
starts the Ray actor that holds the weights (``TinkerActor``, named ``tinker-<model>`` in
Ray's ``flowrl`` namespace, where the service finds it), and supervises it: every few seconds it
takes the actor's new metrics (loss per ``forward_backward``, tokens, learning rate and gradient
norm per ``optim_step``) to the run's MLflow run and log. When the service unloads the model
(the client finished its session, unloaded the model, or stopped heartbeating past the TTL), the
actor says so, the run ends COMPLETED and its GPU slots are given back. A killed run takes its
actor with it: the service's next call to that model fails, and its saved states stay.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from prefect import flow
from pydantic import Field

from flowrl.flows.lifecycle import JobRun, connect_ray
from flowrl.infra.settings import worker_environment
from flowrl.tasks.jobs import JobConfig

ACTOR_PREFIX = "tinker-"
RAY_NAMESPACE = "flowrl"
POLL_S = 2.0
START_TIMEOUT_S = 900.0


class TinkerSessionConfig(JobConfig, title="Tinker session"):
    """One training model of a Tinker API session (the service fills it in)."""

    model_id: str = Field(description="The Tinker model id (<session>:train:<n>).")
    base_model: str = Field(description="Catalogue name of the base model.")
    base_uri: str = Field(description="Where the base model is (folder, s3://, models:/, tiny).")
    lora: dict[str, Any] = Field(description="rank, seed, train_mlp, train_attn, train_unembed.")
    owner: str | None = Field(default=None, description="The API key's namespace.")


@dataclass
class SessionResult:
    model_id: str
    optim_steps: int
    forward_backward_calls: int


def actor_name(model_id: str) -> str:
    return ACTOR_PREFIX + model_id.replace(":", "-")


@ray.remote(max_concurrency=4)
class TinkerActor:
    """A ``TinkerModel`` in a Ray worker: one call at a time on the model, while ``poll``
    (the flow run's) waits for metrics or the end."""

    def __init__(self, base_uri: str, lora: dict[str, Any], cache_dir: str):
        from flowrl.backends.tinker_engine import TinkerModel
        from flowrl.backends.tinker_service import resolve_base_model
        from flowrl.backends.tinker_types import LoraSpec

        self.model = TinkerModel(resolve_base_model(base_uri, cache_dir), LoraSpec(**lora))
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


@flow(name="tinker-session", log_prints=False)
def tinker_session(config: TinkerSessionConfig) -> SessionResult:
    """Hold one Tinker training model for its session (see the module docstring)."""
    if config.owner:
        os.environ["FLOWRL_NAMESPACE"] = config.owner  # this run's storage prefix and names
    with JobRun(config) as run:
        connect_ray()
        started = time.monotonic()
        actor = TinkerActor.options(
            name=actor_name(config.model_id),
            namespace=RAY_NAMESPACE,
            num_gpus=config.resources.gpus_per_worker if config.resources.gpus else 0,
            runtime_env={"env_vars": worker_environment()},
        ).remote(config.base_uri, config.lora, run.ctx.cache_dir)
        try:
            info = ray.get(actor.info.remote())
            run.say(
                f"model {config.model_id} ready: {config.base_model}, LoRA rank "
                f"{config.lora.get('rank')}, vocabulary {info['vocab_size']} "
                f"({time.monotonic() - started:.1f} s)"
            )
            steps, losses = 0, 0
            while True:
                closed, rows = ray.get(actor.poll.remote(POLL_S))
                for row in rows:
                    step = int(row.pop("step"))
                    run.log(row, step)
                    if "optim/lr" in row:
                        steps += 1
                        if steps == 1 or steps % 10 == 0:
                            run.say(f"optim_step {steps}: lr {row['optim/lr']:g}")
                    else:
                        losses += 1
                if closed:
                    break
        finally:
            ray.kill(actor)
        run.say(f"model {config.model_id} unloaded after {steps} optimizer steps")
        result = SessionResult(config.model_id, steps, losses)
        run.finish(result, table=("train/loss_sum", "train/tokens", "optim/lr"))
        return result


# --------------------------------------------------------------------------- the service side


class RayHandle:
    """The service's handle on a session's actor."""

    def __init__(self, actor: Any, flow_run_id: str, info: dict[str, int]):
        self.actor = actor
        self.flow_run_id = flow_run_id
        self.info = info

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from ray.exceptions import RayTaskError

        try:
            return ray.get(self.actor.call.remote(method, args, kwargs))
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e) from None

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

        connect_ray()
        model_id = spec["model_id"]
        name = f"tinker-{model_id.split(':')[0]}-{model_id.rsplit(':', 1)[-1]}"
        config = {
            "name": name,
            "experiment": "tinker",
            "model_id": model_id,
            "base_model": spec["base_model"],
            "base_uri": spec["base_uri"],
            "lora": spec["lora"],
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
