"""The run lifecycle every flow shares: a job of every kind holds its GPU slots from before its
workers start until they stop, and warm-up workers start with the job's own resources."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowrl.backends.policy.placement import InProcess, OwnWorkers, WorkerBuild
from flowrl.backends.policy.resources import ActorResources
from flowrl.environments.arithmetic import ArithmeticTask
from flowrl.tasks.schemas import (
    InferenceJobConfig,
    RLJobConfig,
    SelfPlayJobConfig,
    SFTJobConfig,
)
from flowrl.tasks.types import JobContext

# Each policy's two workers ask for a quarter GPU, so even self-play's two policies fit on the
# two logical GPUs of the test's Ray; the job holds both of the scheduler's slots.
TWO_GPUS = {"gpus": 2, "gpus_per_worker": 0.25}
SMALL_RL = {
    "warmup": {"enabled": False},
    "rollout": {"prompts_per_step": 2, "group_size": 2},
    "schedule": {"steps": 1, "eval_every": 1, "checkpoint_every": 1},
    "resources": TWO_GPUS,
}


def test_warmup_workers_start_with_the_jobs_resources_and_backends(tmp_path, monkeypatch):
    from flowrl.tasks.model import prepare_model, warmup

    started: list[tuple[str, ActorResources, str, str, int, int | None]] = []

    def record(placement, name, spec):
        assert not placement.colocate  # two samplers: never colocated; workers of its own
        build = placement.build
        started.append(
            (
                name,
                build.resources,
                build.sampler_backend,
                build.trainer_backend,
                placement.samplers,
                build.trainer_threads,
            )
        )
        in_process = InProcess(build, samplers=placement.samplers)
        return in_process.start_policy(name, spec)  # real workers, in-process

    monkeypatch.setattr(OwnWorkers, "start_policy", record)
    cfg = RLJobConfig.model_validate(
        {
            "name": "warm-plan",
            "warmup": {"max_steps": 2, "eval_every": 2, "batch_size": 4},
            "resources": {
                "gpus_per_worker": 0.5,
                "trainer_backend": "torch",
                "torch_threads": 1,
                "trainer_threads": 2,
                "samplers": 2,
            },
        }
    )
    ctx = JobContext(cfg.name, str(tmp_path / "s"), str(tmp_path / "c"), "warm-plan-run")
    result = warmup.fn(cfg, ctx, prepare_model.fn(cfg, ctx))
    assert result.steps == 2 and not result.cached
    assert started == [("warm-plan-run-warmup", ActorResources(1, 0.5), "hf", "torch", 2, 2)]
    build = WorkerBuild(ActorResources(1, 0.5), "hf", "torch", 1, "auto", trainer_threads=2)
    assert cfg.resources.placement_for() == OwnWorkers(build, samplers=2)


def _chat_file(folder: Path, n: int) -> str:
    task = ArithmeticTask()
    path = folder / "chat.jsonl"
    rows = [{"messages": task.sft_example(task.problem(i))} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _job(kind: str, folder: Path, base_model: str) -> tuple[Any, Any]:
    """(flow, config) of a small job of ``kind`` that holds 2 GPU slots."""
    from flowrl.flows.inference import batch_inference
    from flowrl.flows.rl import rl_train
    from flowrl.flows.selfplay import self_play
    from flowrl.flows.sft import sft_train

    if kind == "rl-train":
        return rl_train, RLJobConfig.model_validate({"name": "slots-rl", **SMALL_RL})
    if kind == "self-play":
        return self_play, SelfPlayJobConfig.model_validate({"name": "slots-sp", **SMALL_RL})
    if kind == "sft-train":
        data = {"train": _chat_file(folder, 80), "eval_size": 8}
        train = {"steps": 2, "eval_every": 2, "batch_size": 4}
        cfg = {"name": "slots-sft", "data": data, "train": train, "resources": TWO_GPUS}
        return sft_train, SFTJobConfig.model_validate(cfg)
    cfg = {"name": "slots-inf", "model": base_model, "num_prompts": 4, "resources": TWO_GPUS}
    return batch_inference, InferenceJobConfig.model_validate(cfg)


LIMIT = "gpu-lifecycle"
DECLARATION = f"""
pool: {{name: lifecycle-pool, type: process, gpus: 2}}
gpu_limit: {LIMIT}
queues:
  - {{name: jobs, priority: 1}}
"""


@pytest.fixture(scope="module")
def two_gpu_pool(prefect_api, flowrl_home, tmp_path_factory) -> Iterator[str]:
    """A scheduler declaration of its own (a 2-GPU pool, limit ``gpu-lifecycle``) applied to
    the session's Prefect API, in force for this module; yields a tiny base model's URI."""
    from flowrl.infra.scheduler import apply_scheduler, load_scheduler
    from flowrl.infra.settings import get_settings
    from flowrl.tasks.model import prepare_model

    declaration = tmp_path_factory.mktemp("scheduler") / "scheduler.yaml"
    declaration.write_text(DECLARATION)
    os.environ["FLOWRL_SCHEDULER_FILE"] = str(declaration)
    asyncio.run(apply_scheduler(load_scheduler()))
    s = get_settings()
    ctx = JobContext("slots", s.storage_root, s.model_cache_dir, "slots")
    yield prepare_model.fn(RLJobConfig(), ctx)
    os.environ.pop("FLOWRL_SCHEDULER_FILE")


async def _read_records(run_id: Any) -> tuple[Any, list[Any]]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        run = await client.read_flow_run(run_id)
        tasks = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    return run, tasks


async def _active_slots() -> int:
    from prefect import get_client

    async with get_client() as client:
        return (await client.read_global_concurrency_limit_by_name(LIMIT)).active_slots


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["rl-train", "sft-train", "self-play", "batch-inference"])
def test_a_job_of_every_kind_holds_its_gpu_slots_until_it_ends(kind, two_gpu_pool, tmp_path):
    from flowrl.flows.probe import gpu_probe

    flow, config = _job(kind, tmp_path, two_gpu_pool)
    outcome: dict[str, Any] = {}

    def run_job() -> None:  # on the session's Ray, which has two logical GPUs (conftest)
        outcome["job"] = flow(config, return_state=True)

    job = threading.Thread(target=run_job)
    job.start()
    deadline = time.monotonic() + 300
    while asyncio.run(_active_slots()) < 2:  # the job holds both slots
        assert job.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.2)
    probe = gpu_probe(seconds=0.0, gpus=1, return_state=True)  # waits for a slot
    job.join(timeout=600)
    job_state = outcome["job"]
    assert job_state.is_completed(), job_state
    held = probe.result()
    run, task_runs = asyncio.run(_read_records(job_state.state_details.flow_run_id))
    last_task_end = max(t.end_time for t in task_runs if t.end_time is not None)
    # The probe got its slot only after the job's last stage ended: the job held both slots.
    assert held["acquired"] >= last_task_end.timestamp(), (held, last_task_end)
    assert asyncio.run(_active_slots()) == 0


def test_an_actor_that_fails_to_start_is_the_jobs_error_a_killed_one_the_platforms(ray_local):
    """``infrastructure_fault`` decides whether a run ends CRASHED (resumed by the stack) or
    FAILED: an actor whose ``__init__`` raises fails the same way on every attempt (a bad model
    source, say), so it is the job's error; an actor killed under the job is the platform's."""
    import ray

    from flowrl.flows.engines import infrastructure_fault

    @ray.remote(num_cpus=0)
    class Broken:
        def __init__(self) -> None:
            raise FileNotFoundError("no model folder at 'nowhere'")

        def ping(self) -> str:
            return "pong"

    @ray.remote(num_cpus=0)
    class Fine:
        def ping(self) -> str:
            return "pong"

        def pid(self) -> int:
            return os.getpid()

    with pytest.raises(ray.exceptions.RayActorError) as failed:
        ray.get(Broken.remote().ping.remote(), timeout=60)
    assert infrastructure_fault(failed.value) is None
    assert "no model folder at 'nowhere'" in str(failed.value)  # the cause, said

    fine = Fine.remote()
    assert ray.get(fine.ping.remote(), timeout=60) == "pong"
    # SIGKILLed under the job, as the OOM killer would; the next calls fail once Ray has seen
    # the death (a call that was on its way as the process died may still have its answer).
    os.kill(ray.get(fine.pid.remote(), timeout=60), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError) as killed:
        for _ in range(300):
            ray.get(fine.ping.remote(), timeout=60)
            time.sleep(0.1)
    assert infrastructure_fault(killed.value).startswith("Ray lost the job's workers")


def test_a_stage_cut_short_by_its_jobs_stop_logs_one_line_not_a_traceback(flowrl_home, prefect_api):
    """A job that stops (SIGTERM, a failed stage) stops its workers while a stage may still be
    waiting on them (a rollout sampled ahead, the update the flow waited for). That stage's
    failure is one line saying the job is stopping, not a Ray traceback after the job's own
    reason; a stage failing for a reason of its own keeps its traceback."""
    import logging

    import ray
    from prefect import flow, task

    from flowrl.flows.lifecycle import JobRun, task_runner

    @ray.remote(num_cpus=0)
    class Worker:
        def work(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    @task(name="waits-on-a-worker")
    def waits(worker: Any) -> float:
        return ray.get(worker.work.remote(120.0))

    @task(name="fails-by-itself")
    def fails() -> None:
        raise ValueError("a reason of its own")

    @flow(name="stopping-job", task_runner=task_runner())
    def stopping_job(config: RLJobConfig) -> None:
        worker = Worker.remote()
        try:
            with JobRun(config):
                with pytest.raises(ValueError):
                    fails.submit().result()
                waits.submit(worker)
                ray.get(worker.work.remote(0.0))  # up: the stage's call is on its way
                time.sleep(1.0)
                raise RuntimeError("the job's own reason")
        finally:
            ray.kill(worker)  # as the job's exit stops its workers

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(logging.Formatter().format(record))

    seen = Lines()
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(seen)
    try:
        with pytest.raises(RuntimeError, match="the job's own reason"):
            stopping_job(RLJobConfig(name="stopping-job"))
    finally:
        logger.removeHandler(seen)
    own = [x for x in seen.lines if "a reason of its own" in x]
    assert any("Traceback" in x for x in own), own  # its own failure, told in full
    cut = [x for x in seen.lines if "ActorDiedError" in x and "Finished in state" not in x]
    assert cut and all(x.endswith("(its job is stopping)") for x in cut), cut
    assert not any("Traceback" in x for x in cut), cut
    from flowrl.environments.timeouts import calls_abandoned

    assert not calls_abandoned()  # the next job in this process waits on its calls again
