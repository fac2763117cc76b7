"""What every training flow needs around its stages: the Ray task runner, the job's storage
context, its MLflow run, its policy workers, progress and step bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect_ray import RayTaskRunner
from tqdm import tqdm

from backends.actors import ActorResources, PolicyRef, start_policy, stop_policy
from backends.types import WorkerSpec
from infra import tracking
from infra.config import RLJobConfig
from infra.settings import get_settings
from infra.storage import Storage
from tasks.rl import weight_sync
from tasks.types import JobContext, RolloutBatch, ScoredBatch


def task_runner() -> RayTaskRunner:
    """prefect-ray's runner: a local Ray by default, or the cluster at ``FLOWRL_RAY_ADDRESS``."""
    s = get_settings()
    init: dict[str, Any] = {"namespace": "flowrl", "log_to_driver": False}
    if s.ray_address is None:
        init |= {"num_cpus": s.ray_num_cpus, "include_dashboard": False}
        if s.ray_num_gpus is not None:
            init["num_gpus"] = s.ray_num_gpus
    init["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
    return RayTaskRunner(address=s.ray_address, init_kwargs=init)


class JobRun:
    """One run of a job: its storage context, MLflow run and step bookkeeping."""

    def __init__(self, config: RLJobConfig):
        settings = get_settings()
        settings.apply_to_environment()
        self.config = config
        run_suffix = (flow_run.get_id() or "local")[:8]
        self.ctx = JobContext(
            name=config.name,
            storage_url=settings.storage_root,
            cache_dir=settings.model_cache_dir,
            run_name=f"{config.name}-{run_suffix}",
        )
        self.storage = Storage(self.ctx.storage_url)
        job_file = f"{self.ctx.prefix}/job.json"
        previous = self.storage.read_json(job_file) if self.storage.exists(job_file) else {}
        self.run_id = tracking.start_run(
            config.experiment, config.name, config.model_dump(), previous.get("mlflow_run_id")
        )
        self.storage.write_json(
            job_file, {"mlflow_run_id": self.run_id, "config": config.model_dump()}
        )
        self.done_steps = 0
        self._last_tick = time.perf_counter()
        self._progress_id: Any = None
        self._bar: tqdm | None = None
        self._policies: list[PolicyRef] = []

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Release the workers; a failed job leaves its MLflow run marked FAILED (resumable)."""
        for policy in self._policies:
            stop_policy(policy)
        if self._bar is not None:
            self._bar.close()
        if exc_type is not None:
            tracking.end_run(self.run_id, status="FAILED")

    def start_policy(self, model_uri: str, name: str | None = None) -> PolicyRef:
        """Start a policy's workers (named ``name``, default the run name); stopped on exit."""
        c = self.config
        spec = WorkerSpec(
            model_uri=model_uri,
            cache_dir=self.ctx.cache_dir,
            lora=c.model.lora,
            learning_rate=c.algorithm.learning_rate,
            max_grad_norm=c.algorithm.max_grad_norm,
            seed=c.seed,
            torch_threads=c.resources.torch_threads,
        )
        # The job's GPU slots are split between its sampler and trainer unless set per worker.
        gpus = c.resources.gpus_per_worker or c.resources.gpus / 2
        policy = start_policy(
            name or self.ctx.run_name,
            spec,
            ActorResources(num_cpus=1, num_gpus=gpus),
            c.resources.sampler_backend,
            c.resources.trainer_backend,
        )
        self._policies.append(policy)
        return policy

    def resume_point(self, meta: dict[str, Any] | None) -> tuple[int, dict | None, float | None]:
        """(first step to run, data cursor, accuracy at the start of RL) from a checkpoint."""
        if meta is None:
            return 0, None, None
        return int(meta["step"]), meta.get("cursor"), meta.get("accuracy_start")

    def meta(self, cursor: dict | None, accuracy_start: float) -> dict[str, Any]:
        return {"cursor": cursor, "accuracy_start": accuracy_start, "mlflow_run_id": self.run_id}

    def steps(self, start: int) -> Iterator[int]:
        total = self.config.schedule.steps
        self._progress_id = create_progress_artifact(
            progress=100.0 * start / total, description=f"RL steps of {self.config.name}"
        )
        self._bar = tqdm(total=total, initial=start, desc=self.config.name, unit="step")
        self._last_tick = time.perf_counter()
        self.done_steps = start
        yield from range(start, total)

    def due(self, step: int, every: int, at_end: bool = False) -> bool:
        """Whether a periodic stage runs after ``step``; ``at_end`` adds the last step."""
        last = step + 1 == self.config.schedule.steps
        return (at_end and last) or ((step + 1) % every == 0 and not last)

    def record_step(self, step: int, scored: ScoredBatch, stats: dict[str, float]) -> None:
        now = time.perf_counter()
        wall = now - self._last_tick
        self._last_tick = now
        inside = stats.get("time/update_s", 0.0) + scored.metrics.get("time/rollout_s", 0.0)
        if "time/rollout_ahead_s" in stats:  # the next rollout ran alongside reward + update
            update_s = scored.metrics.get("time/reward_s", 0.0) + stats.get("time/update_s", 0.0)
            inside = max(stats["time/rollout_ahead_s"], update_s) + stats["time/sync_s"]
        metrics = {**scored.metrics, **stats, "time/step_s": wall, "time/overhead_s": wall - inside}
        self.log(metrics, step + 1)
        if step % 10 == 0 and scored.samples:
            tracking.log_json(self.run_id, scored.samples, f"samples/step-{step + 1:05d}.json")
        self.advance(step, reward=scored.metrics.get("reward/mean", 0.0))

    def advance(self, step: int, **postfix: float) -> None:
        """Mark ``step`` done: progress bar, Prefect progress artifact (every 10 steps)."""
        self.done_steps = step + 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({k: f"{v:.2f}" for k, v in postfix.items()})
        total = self.config.schedule.steps
        if (step + 1) % 10 == 0 or step + 1 == total:  # each update is an API round trip
            update_progress_artifact(self._progress_id, progress=100.0 * (step + 1) / total)

    def log(self, metrics: dict[str, float], step: int) -> None:
        tracking.log_metrics(self.run_id, metrics, step)

    def finish(self, model_uri: str) -> None:
        tracking.log_reward_curve(self.run_id, ["reward/mean", "eval/accuracy"], "reward_curve.png")
        self.storage.write_json(
            f"{self.ctx.prefix}/result.json", {"model_uri": model_uri, "mlflow_run_id": self.run_id}
        )
        tracking.end_run(self.run_id)


class RolloutStream:
    """The run's rollouts, each started ``ahead`` steps before its update
    (``schedule.off_policy_steps``).

    ``ahead=0``: step n's rollout starts when ``take(n)`` is called, after update n-1 and its
    weight sync: on-policy. ``ahead=1``: as soon as step n's batch is in, step n+1's rollout
    starts on the sampler, so it runs while update n runs on the trainer; ``settle`` then waits
    for it and syncs the weights. Each batch is sampled by weights one update behind the trainer
    (staleness 1; the first step and the first step after a resume: 0).

    Between ``settle`` and the next ``take`` nothing runs: eval and checkpoints see the sampler
    equal to the trainer. A checkpoint's cursor is that of the last *trained* batch, so the
    rollout sampled ahead is not in it: a resumed run samples that step again, from the
    checkpoint's weights.
    """

    def __init__(
        self,
        start_rollout: Callable[[int, dict | None], PrefectFuture],
        cursor: dict | None,
        ahead: int,
        total_steps: int,
    ):
        self._start = start_rollout
        self._cursor = cursor
        self._ahead = ahead
        self._total = total_steps
        self._pending: PrefectFuture | None = None

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch; with ``ahead=1`` also starts step ``step + 1``'s rollout."""
        future = self._pending or self._start(step, self._cursor)
        batch = future.result()
        self._cursor, self._pending = batch.cursor, None
        if self._ahead and step + 1 < self._total:
            self._pending = self._start(step + 1, batch.cursor)
        return batch

    def settle(self, policy: PolicyRef) -> dict[str, float]:
        """After an update: wait for the rollout sampled ahead, then sync the weights (with
        ``ahead=0`` the update has synced them already). Returns timing metrics."""
        if not self._ahead:
            return {}
        ahead_s = self._pending.result().seconds if self._pending is not None else 0.0
        # Called, not submitted: a task run in the flow process (~5 ms, not a Ray task's ~150).
        return weight_sync(policy) | {"time/rollout_ahead_s": ahead_s}
