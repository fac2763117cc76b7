"""The SFT flow: chat data → steps on assistant tokens, evaluated every k steps → register.

Run it as a Python call (``sft_train(SFTJobConfig(...))``) or as a Prefect deployment. Stages
run as Ray tasks; the weights live in the policy's workers (LoRA or full, as configured).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mlflow.entities import Metric
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from backends.actors import ActorResources, PolicyRef, start_policy, stop_policy
from backends.types import WorkerSpec
from flows.common import task_runner
from infra import tracking
from infra.settings import get_settings
from infra.sft_config import SFTJobConfig
from infra.storage import Storage
from tasks.model import prepare_model, register
from tasks.sft import evaluate_exact_match, prepare_data, train_steps
from tasks.types import JobContext


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


@flow(name="sft-train", task_runner=task_runner(), log_prints=True)
def sft_train(config: SFTJobConfig) -> SFTResult:
    logger = get_run_logger()
    with SFTRun(config) as job:
        base_uri = prepare_model.submit(config, job.ctx).result()
        data = prepare_data.submit(config, job.ctx).result()
        policy = job.start_policy(base_uri)
        first = evaluate_exact_match.submit(config, job.ctx, base_uri, policy, data).result()
        job.log(first, step=0)
        step, cursor, last = 0, None, first
        while step < config.train.steps:
            n = min(config.train.eval_every, config.train.steps - step)
            chunk = train_steps.submit(config, job.ctx, base_uri, policy, data, n, cursor).result()
            step, cursor = step + n, chunk.cursor
            job.log_chunk(step, chunk.losses, chunk.metrics)
            last = evaluate_exact_match.submit(config, job.ctx, base_uri, policy, data).result()
            job.log(last, step)
        registered = register.submit(config, job.ctx, policy, job.run_id, last).result()
        job.finish(registered)
    start, end = first["eval/exact_match"], last["eval/exact_match"]
    logger.info("exact match %.3f -> %.3f; registered %s", start, end, registered)
    return SFTResult(config.name, registered, start, end, job.run_id, step)


class SFTRun:
    """One run of an SFT job: its storage context, MLflow run and workers."""

    def __init__(self, config: SFTJobConfig):
        settings = get_settings()
        settings.apply_to_environment()
        self.config = config
        run_name = f"{config.name}-{(flow_run.get_id() or 'local')[:8]}"
        self.ctx = JobContext(
            config.name, settings.storage_root, settings.model_cache_dir, run_name
        )
        self.run_id = tracking.start_run(config.experiment, config.name, config.model_dump())
        self._policy: PolicyRef | None = None

    def __enter__(self) -> SFTRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._policy is not None:
            stop_policy(self._policy)
        if exc_type is not None:
            tracking.end_run(self.run_id, status="FAILED")

    def start_policy(self, model_uri: str) -> PolicyRef:
        c = self.config
        spec = WorkerSpec(
            model_uri=model_uri,
            cache_dir=self.ctx.cache_dir,
            lora=c.model.lora,
            learning_rate=c.train.learning_rate,
            max_grad_norm=c.train.max_grad_norm,
            seed=c.seed,
            torch_threads=c.resources.torch_threads,
        )
        gpus = c.resources.gpus_per_worker or c.resources.gpus / 2
        self._policy = start_policy(
            self.ctx.run_name,
            spec,
            ActorResources(num_cpus=1, num_gpus=gpus),
            c.resources.sampler_backend,
            c.resources.trainer_backend,
        )
        return self._policy

    def log(self, metrics: dict[str, float], step: int) -> None:
        tracking.log_metrics(self.run_id, metrics, step)

    def log_chunk(self, last_step: int, losses: list[float], metrics: dict[str, Any]) -> None:
        first, now = last_step - len(losses) + 1, int(time.time() * 1000)
        per_step = [Metric("train/loss", loss, now, first + i) for i, loss in enumerate(losses)]
        tracking.client().log_batch(self.run_id, metrics=per_step)
        self.log(metrics, last_step)

    def finish(self, model_uri: str) -> None:
        tracking.log_reward_curve(self.run_id, ["train/loss", "eval/exact_match"], "sft_curve.png")
        Storage(self.ctx.storage_url).write_json(
            f"{self.ctx.prefix}/result.json", {"model_uri": model_uri, "mlflow_run_id": self.run_id}
        )
        tracking.end_run(self.run_id)
