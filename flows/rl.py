"""The RL training flow: warm-up, then rollout → reward → update per step, with periodic
eval and checkpoints; at the end the policy is evaluated and registered in MLflow.

Run it as a Python call (``rl_train(RLJobConfig(...))``), from the CLI
(``flowrl train CONFIG.yaml``) or as a Prefect deployment. Resubmitting a job with the same
name resumes from its last complete checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow, get_run_logger

from flows.common import JobRun, RolloutStream, task_runner
from infra.config import RLJobConfig
from infra.scheduler import gpu_slots
from tasks.model import prepare_model, register, warmup
from tasks.rl import checkpoint, evaluate, restore, rollout, score, update


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


@flow(name="rl-train", task_runner=task_runner(), log_prints=True)
def rl_train(config: RLJobConfig = RLJobConfig()) -> RLResult:  # noqa: B008
    logger = get_run_logger()
    # The job holds its GPU slots from before its workers start until they are released.
    with gpu_slots(config.resources.gpus), JobRun(config) as job:
        # Every stage is submitted to the task runner: each runs as a Ray task on the cluster.
        base_uri = prepare_model.submit(config, job.ctx).result()
        warm = warmup.submit(config, job.ctx, base_uri).result()
        logger.info("warm-up: %s", warm)
        model_uri = warm["model_uri"]
        policy = job.start_policy(model_uri)
        resumed = restore.submit(job.ctx, policy).result()
        start, cursor, acc_start = job.resume_point(resumed)
        if acc_start is None:
            start_eval = evaluate.submit(config, job.ctx, model_uri, policy).result()
            acc_start = start_eval.accuracy
            job.log(start_eval.metrics(), step=0)
        rollouts = RolloutStream(
            lambda step, at: rollout.submit(config, job.ctx, model_uri, policy, step, at),
            cursor,
            ahead=config.schedule.off_policy_steps,
            total_steps=config.schedule.steps,
        )
        for step in job.steps(start):
            batch = rollouts.take(step)  # off_policy_steps 1: starts step + 1's rollout too
            scored = score.submit(config, job.ctx, batch).result()
            stats = update.submit(config, job.ctx, policy, scored).result()
            stats |= rollouts.settle(policy)  # then eval and checkpoints see no rollout running
            cursor = batch.cursor
            job.record_step(step, scored, stats)
            if job.due(step, config.schedule.eval_every):
                result = evaluate.submit(config, job.ctx, model_uri, policy).result()
                job.log(result.metrics(), step + 1)
            if job.due(step, config.schedule.checkpoint_every, at_end=True):
                meta = job.meta(cursor, acc_start)
                checkpoint.submit(config, job.ctx, policy, step + 1, meta).result()
        final = evaluate.submit(config, job.ctx, model_uri, policy).result()
        job.log(final.metrics("final"), config.schedule.steps)
        metrics = final.metrics("final")
        registered = register.submit(config, job.ctx, policy, job.run_id, metrics).result()
        job.finish(registered)
    logger.info("accuracy %.3f -> %.3f; registered %s", acc_start, final.accuracy, registered)
    return RLResult(
        job=config.name,
        model_uri=registered,
        accuracy_start=acc_start,
        accuracy_end=final.accuracy,
        mlflow_run_id=job.run_id,
        steps=job.done_steps,
        resumed_from=start if resumed else None,
    )
