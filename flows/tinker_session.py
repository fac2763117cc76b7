"""Tinker API sessions as flowrl jobs: each training model a flow run of ``tinker-session``.

The Tinker service (``backends.services.tinker``) with its models on ``OwnWorkers``
(``backends.policy.placement``; ``flowrl serve tinker --placement sessions``) submits one run of the
``tinker-session`` deployment per training model, through ``DeploymentRuns``: the flow layer
names the deployment, the backend only calls what it is given. The run is admitted like any job
(its work queue, then ``resources.gpus`` slots of the scheduler's ``gpu`` limit, held through
``JobRun``), starts the Ray actor that holds the weights (``TinkerActor``, named
``tinker-<model>`` in Ray's ``flowrl`` namespace, where the service finds it), and supervises
it: every few seconds it takes the actor's new metrics (loss per ``forward_backward``, tokens,
learning rate and gradient norm per ``optim_step``) to the run's MLflow run and log. When the
service unloads the model (the client finished its session, unloaded the model, or stopped
heartbeating past the TTL), the actor says so, the run ends COMPLETED and its GPU slots are
given back. A killed run takes its actor with it, and a run whose actor dies (with its node or
the Ray head) ends CRASHED saying so: the service makes the model again, exactly, from its
journal, in a new session run (``Training.restore``)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import ray
from prefect import flow
from prefect.states import Crashed, State
from ray.exceptions import RayActorError

from flowrl.backends.engines.tinker.actor import TinkerActor, actor_name
from flowrl.flows.engines import connect_ray
from flowrl.flows.lifecycle import JobRun
from flowrl.infra.settings import RAY_NAMESPACE, worker_environment
from flowrl.tasks.schemas import TinkerSessionConfig

POLL_S = 2.0
DEPLOYMENT = "tinker-session"


class DeploymentRuns:
    """``OwnWorkers``' session runs: runs of this flow's deployment (``DEPLOYMENT``) on the
    Prefect API of the environment, on ``queue`` (default: the deployment's own)."""

    def __init__(self, queue: str | None = None, deployment: str = DEPLOYMENT) -> None:
        from flowrl.infra.client import JobClient

        self.jobs = JobClient()
        self.queue = queue
        self.deployment = deployment

    def submit(self, config: dict) -> str:
        return self.jobs.submit(self.deployment, {"config": config}, queue=self.queue)

    def state(self, run_id: str) -> tuple[str, str]:
        status = self.jobs.status(run_id)
        return status.state, status.message or ""


@dataclass
class SessionResult:
    model_id: str
    optim_steps: int
    forward_backward_calls: int


@flow(name="tinker-session", log_prints=False)
def tinker_session(config: TinkerSessionConfig) -> SessionResult | State:
    """Hold one Tinker training model for its session (see the module docstring)."""
    if config.owner:
        os.environ["FLOWRL_NAMESPACE"] = config.owner  # this run's storage prefix and names
    with JobRun(config) as run:
        connect_ray()
        started = time.monotonic()
        actor = TinkerActor.options(
            name=actor_name(config.model_id, config.generation),
            namespace=RAY_NAMESPACE,
            num_gpus=config.resources.gpus_per_worker if config.resources.gpus else 0,
            runtime_env={"env_vars": worker_environment()},
        ).remote(config.base_uri, config.lora, config.seed, run.ctx.cache_dir)
        try:
            info = ray.get(actor.info.remote())
            run.say(
                f"model {config.model_id} ready: {config.base_model}, LoRA rank "
                f"{config.lora.r}, vocabulary {info['vocab_size']} "
                f"({time.monotonic() - started:.1f} s)"
            )
            steps, losses = 0, 0
            while True:
                try:
                    closed, rows = ray.get(actor.poll.remote(POLL_S))
                except RayActorError as err:  # its process, node or Ray head died
                    lost = (
                        f"model {config.model_id}'s actor was lost ({type(err).__name__}): the "
                        "Tinker service makes it again from its journal, in a new session run"
                    )
                    run.say(lost)
                    return Crashed(message=f"flowrl: {lost}")
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
            with contextlib.suppress(Exception):  # a lost actor is gone already
                ray.kill(actor)
        run.say(f"model {config.model_id} unloaded after {steps} optimizer steps")
        result = SessionResult(config.model_id, steps, losses)
        run.finish(result, table=("train/loss_sum", "train/tokens", "optim/lr"))
        return result
