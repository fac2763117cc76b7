"""The scheduler declaration: pool, queues and the gpu limit are applied idempotently; every
flow has a deployment on a declared queue; a job asking for more GPUs than exist is refused."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import pytest

from flowrl.infra.deployments import check_deployments, load_deployments
from flowrl.infra.scheduler import AdmissionError, check_admission, load_scheduler
from flowrl.tasks.schemas import RLJobConfig, load_job

REPO = Path(__file__).resolve().parents[1]


def _flow_entrypoints() -> set[str]:
    """``flowrl.flows.<module>.<function>`` of every @flow in flows/ (a module path: what a
    worker with flowrl installed imports)."""
    found = set()
    for path in sorted((REPO / "flows").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "flow"
                for d in node.decorator_list
            ):
                found.add(f"flowrl.flows.{path.stem}.{node.name}")
    return found


def test_every_flow_has_a_deployment_on_a_declared_queue():
    spec = load_scheduler()
    deployments = load_deployments()
    check_deployments(deployments, spec)  # pool and queue names exist in the declaration
    assert _flow_entrypoints() <= {d["entrypoint"] for d in deployments}
    names = {q.name for q in spec.queues}
    assert names == {"rl-full", "rl-lora", "tinker", "sft", "eval", "inference"}
    assert sorted(q.priority for q in spec.queues) == [1, 2, 3, 4, 5, 6]
    retrain = next(d for d in deployments if d["name"] == "retrain")
    assert retrain["schedules"][0]["cron"]


def test_kubernetes_template_requests_the_jobs_gpus():
    from flowrl.infra.scheduler import base_job_template

    template = base_job_template("kubernetes")
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert "gpus" in template["variables"]["properties"]
    assert "command" in base_job_template("process")["variables"]["properties"]


def test_gpu_count_comes_from_settings(monkeypatch):
    assert load_scheduler().pool.gpus == 2
    monkeypatch.setenv("FLOWRL_POOL_GPUS", "8")
    assert load_scheduler().pool.gpus == 8


def test_resources_gpus_defaults_to_a_cpu_job():
    assert RLJobConfig().resources.gpus == 0
    assert load_job(None, ["resources.gpus=2"]).resources.gpus == 2


def test_a_job_larger_than_the_pool_is_refused_with_the_numbers():
    check_admission(2, 2)
    with pytest.raises(AdmissionError, match=r"resources.gpus=3 but the pool has 2 GPU"):
        check_admission(3, 2)


async def _forget_scheduler(spec) -> None:
    """Remove the declaration's pool (with its queues), gpu limit and automations from the API,
    if there."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from flowrl.infra.scheduler import RESUME_AUTOMATION, ZOMBIE_AUTOMATION

    async with get_client() as c:
        for name in (RESUME_AUTOMATION, ZOMBIE_AUTOMATION):
            for automation in await c.read_automations_by_name(name):
                await c.delete_automation(automation.id)
        for delete, name in (
            (c.delete_work_pool, spec.pool.name),
            (c.delete_global_concurrency_limit_by_name, spec.gpu_limit),
        ):
            try:
                await delete(name)
            except ObjectNotFound:
                pass


def test_infra_up_is_idempotent_and_a_too_big_job_fails_at_once(prefect_api, monkeypatch):
    from prefect import get_client

    from flowrl.flows.probe import gpu_probe
    from flowrl.infra.scheduler import apply_scheduler

    monkeypatch.setenv("FLOWRL_POOL_GPUS", "3")
    spec = load_scheduler()
    asyncio.run(_forget_scheduler(spec))  # an earlier test (the wheel's `infra up`) may have
    first = asyncio.run(apply_scheduler(spec))  # applied it to this session's API
    second = asyncio.run(apply_scheduler(spec))
    assert all("created" in line for line in first)
    assert all("updated" in line for line in second)

    async def read():
        async with get_client() as c:
            pool = await c.read_work_pool(spec.pool.name)
            queues = {q.name: q for q in await c.read_work_queues(work_pool_name=spec.pool.name)}
            limit = await c.read_global_concurrency_limit_by_name("gpu")
            return pool, queues, limit

    pool, queues, limit = asyncio.run(read())
    assert pool.type == "process" and pool.concurrency_limit == spec.pool.concurrency_limit
    for q in spec.queues:
        assert (queues[q.name].priority, queues[q.name].concurrency_limit) == (
            q.priority,
            q.concurrency_limit,
        )
    assert limit.limit == 3 and limit.active

    held = gpu_probe(seconds=0.1, gpus=3)  # exactly the pool: admitted
    assert held["released"] > held["acquired"]
    start = time.monotonic()
    with pytest.raises(AdmissionError, match="pool has 3 GPU"):
        gpu_probe(seconds=0.1, gpus=4)
    assert time.monotonic() - start < 30  # refused, never left waiting
