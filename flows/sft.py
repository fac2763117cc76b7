"""The SFT flow: chat data → steps on assistant tokens, evaluated every k steps → register.

Run it as a Python call (``sft_train(SFTJobConfig(...))``) or as a Prefect deployment. Stages
run as Ray tasks; the weights live in the policy's workers (LoRA or full, as configured).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from flowrl.flows.lifecycle import JobRun, resumable, task_runner
from flowrl.flows.run_page import Column, job_run_name
from flowrl.tasks.model import prepare_model, register
from flowrl.tasks.schemas import SFTJobConfig
from flowrl.tasks.sft import evaluate_exact_match, prepare_data, train_steps


@dataclass(frozen=True)
class SFTResult:
    """What an SFT job hands back."""

    job: str
    model_uri: str
    """The registered version, e.g. ``models:/sft/1``."""
    exact_match_start: float
    exact_match_end: float
    mlflow_run_id: str
    steps: int


COLUMNS = (
    Column("loss", ("train/loss",), "loss {:.4f}", plot=True),
    Column("exact_match", ("eval/exact_match",), "exact match {:.3f}", True, plot=True),
    Column("seconds", ("time/step_s",), "{:.3f} s/step"),
)
"""The results table, step lines and curve of an SFT job: the step's loss, held-out exact
match where evaluated (before training at step 0 and every ``eval_every`` steps), and the
step's seconds (its chunk's training time over its steps)."""


@flow(
    name="sft-train",
    task_runner=task_runner(),
    log_prints=True,
    flow_run_name=job_run_name(SFTJobConfig),
)
@resumable
def sft_train(config: SFTJobConfig) -> SFTResult:
    with JobRun(config, columns=COLUMNS) as job:
        base_uri = prepare_model.submit(config, job.ctx).result()
        data = prepare_data.submit(config, job.ctx).result()
        policy = job.start_policy(base_uri)
        with job.phase("evaluation before SFT") as phase:
            first = evaluate_exact_match.submit(config, job.ctx, base_uri, policy, data).result()
            job.log(first.metrics(), step=0)
            phase.result = f"held-out exact match {first.exact_match:.3f}"
        cursor, last, total = None, first, config.train.steps
        with job.phase("SFT", f"{total} steps, evaluated every {config.train.eval_every}") as ph:
            for step in job.steps(0, total, stride=config.train.eval_every):
                n = min(config.train.eval_every, total - step)
                chunk = train_steps.submit(
                    config, job.ctx, base_uri, policy, data, n, cursor
                ).result()
                cursor = chunk.cursor
                for i, loss in enumerate(chunk.losses):
                    job.log({"train/loss": loss, "time/step_s": chunk.seconds / n}, step + 1 + i)
                job.log(chunk.metrics, step + n)
                last = evaluate_exact_match.submit(config, job.ctx, base_uri, policy, data).result()
                job.log(last.metrics(), step + n)
                job.advance(step + n, exact_match=last.exact_match)
            ph.result = f"held-out exact match {first.exact_match:.3f} -> {last.exact_match:.3f}"
        job.flush_metrics()  # the version links the run's own points of these metrics
        model_name = config.registered_model_name(job.ctx.namespace)
        with job.phase("registration", f"as a version of {model_name}") as ph:
            registered = register.submit(
                config, job.ctx, policy, job.run_id, last.metrics(), base_uri
            ).result()
            ph.result = f"registered {registered}"
        result = SFTResult(
            config.name, registered, first.exact_match, last.exact_match, job.run_id, total
        )
        job.finish(result, plot="sft_curve.svg")
    return result
