"""The RL training flow: warm-up, then rollout → reward → update per step, with periodic
eval and checkpoints; at the end the policy is evaluated and registered in MLflow.

Run it as a Python call (``rl_train(RLJobConfig(...))``), from the CLI
(``flowrl train CONFIG.yaml``) or as a Prefect deployment. Resubmitting a job with the same
name resumes from its last complete checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.utilities.annotations import quote

from flowrl.flows.lifecycle import JobRun, StepClock, due, resumable, task_runner
from flowrl.flows.rollouts import RolloutStream, step_times
from flowrl.flows.run_page import Column, job_run_name
from flowrl.tasks.model import describe_warmup, prepare_model, register, warmup, warmup_plan
from flowrl.tasks.rl import checkpoint, evaluate, restore, rollout, score, update
from flowrl.tasks.schemas import RLJobConfig


@dataclass(frozen=True)
class RLResult:
    """What an RL job hands back."""

    job: str
    model_uri: str
    """The registered version, e.g. ``models:/arithmetic-demo/3``."""
    accuracy_start: float
    """Held-out accuracy when RL began (after warm-up)."""
    accuracy_end: float
    mlflow_run_id: str
    steps: int
    """RL steps done in total (including those before a resume)."""
    resumed_from: int | None
    """The checkpoint step this run resumed from, or None for a fresh start."""


COLUMNS = (
    Column("reward/mean", ("reward/mean",), "reward {:.3f}", plot=True),
    Column("accuracy", ("eval/accuracy", "final/accuracy"), "accuracy {:.3f}", True, plot=True),
    Column("loss", ("train/loss",), "loss {:.4f}"),
    Column("seconds", ("time/step_s",), "{:.2f} s/step"),
)
"""The results table, step lines and curve of an RL job: the step's mean reward, held-out
accuracy where evaluated (before RL at step 0, every ``eval_every``, the final), the update's
loss and the step's wall seconds."""


@flow(
    name="rl-train",
    task_runner=task_runner(),
    log_prints=True,
    flow_run_name=job_run_name(RLJobConfig),
)
@resumable
def rl_train(config: RLJobConfig = RLJobConfig()) -> RLResult:  # noqa: B008
    # GPU slots are held from before any worker starts until every worker has stopped.
    with JobRun(config, resume=True, columns=COLUMNS) as job:
        # Every stage is submitted to the task runner: each runs as a Ray task on the cluster.
        base_uri = prepare_model.submit(config, job.ctx).result()
        config = job.pick_sampler(base_uri)  # warm-up places workers with it
        # A warm-up that ran hands over its workers: RL restarts them, no new processes.
        with job.phase("warm-up", warmup_plan(config)) as phase:
            warm = warmup.submit(config, job.ctx, base_uri, keep_workers=True).result()
            phase.result = describe_warmup(warm)
        policy = job.start_policy(warm.model_uri, adopt=warm.workers)
        resumed = restore.submit(job.ctx, policy).result()
        start, cursor, acc_start = resume_point(resumed)
        if acc_start is None:
            with job.phase("evaluation before RL") as phase:
                start_eval = evaluate.submit(config, job.ctx, warm.model_uri, policy).result()
                acc_start = start_eval.accuracy
                job.log(start_eval.metrics(), step=0)
                phase.result = f"held-out accuracy {acc_start:.3f}"
        # The per-step stages get the config and context quoted: Prefect does not walk them
        # looking for futures on every submit (~1 ms a task run at the default job).
        cfg, ctx = quote(config), quote(job.ctx)
        rollouts = RolloutStream(
            lambda step, at, skip: rollout.submit(cfg, ctx, warm.model_uri, policy, step, at, skip),
            cursor,
            ahead=config.schedule.staleness_bound,
            total_steps=config.schedule.steps,
        )
        clock, total = StepClock(), config.schedule.steps
        plan = f"steps {start + 1}-{total}" if start < total else "no steps left"
        plan += f", resumed from the checkpoint at step {start}" if resumed else ", fresh start"
        with job.phase("RL", plan) as phase:
            for step in job.steps(start, total):
                batch = rollouts.take(step)  # max_staleness k: starts steps up to step + k too
                scored = score.submit(cfg, ctx, policy, quote(batch)).result()
                updated = update.submit(cfg, ctx, policy, quote(scored)).result()
                settled = rollouts.settle(policy)  # then eval and checkpoints see no rollout
                times = step_times(clock.lap(), scored, updated, settled)
                job.log(scored.metrics | updated.metrics | times, step + 1)
                if step % 10 == 0 and scored.samples:
                    job.log_json(scored.samples, f"samples/step-{step + 1:05d}.json")
                if due(step, total, config.schedule.eval_every):
                    result = evaluate.submit(config, job.ctx, warm.model_uri, policy).result()
                    job.log(result.metrics(), step + 1)
                job.advance(step + 1, reward=scored.metrics.get("reward/mean", 0.0))
                if due(step, total, config.schedule.checkpoint_every, at_end=True):
                    meta = {"cursor": batch.cursor, "accuracy_start": acc_start}
                    job.flush_metrics(wait=False)  # on disk: the steps a checkpoint keeps keep them
                    checkpoint.submit(config, job.ctx, policy, step + 1, meta).result()
            phase.result = f"done, {job.done_steps - start} steps"
        with job.phase("final evaluation") as phase:
            final = evaluate.submit(config, job.ctx, warm.model_uri, policy).result()
            metrics = final.metrics("final")
            job.log(metrics, total)
            phase.result = f"held-out accuracy {final.accuracy:.3f} ({acc_start:.3f} before RL)"
        job.flush_metrics()  # the version links the run's own points of these metrics
        model_name = config.registered_model_name(job.ctx.namespace)
        with job.phase("registration", f"as a version of {model_name}") as ph:
            registered = register.submit(
                config, job.ctx, policy, job.run_id, metrics, base_uri
            ).result()
            ph.result = f"registered {registered}"
        result = RLResult(
            job=config.name,
            model_uri=registered,
            accuracy_start=acc_start,
            accuracy_end=final.accuracy,
            mlflow_run_id=job.run_id,
            steps=job.done_steps,
            resumed_from=start if resumed else None,
        )
        job.finish(result)
    return result


def resume_point(meta: dict[str, Any] | None) -> tuple[int, dict | None, float | None]:
    """(first step to run, data cursor, accuracy at the start of RL) from a checkpoint's meta."""
    if meta is None:
        return 0, None, None
    return int(meta["step"]), meta.get("cursor"), meta.get("accuracy_start")
