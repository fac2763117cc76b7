"""Shared base-model workers (``resources.placement: shared``): one Ray actor holds a base model
once and many jobs' LoRA adapters. Real Ray (the session's), a real Prefect API, real MLflow.

What a user relies on: a tenant computes exactly what a job with workers of its own would;
tenants cannot see or change each other, and one that fails fails alone; the next job joins
the running worker without a restart; admission is Prefect's (adapter slots); the worker
holds its GPU slots once and ends when idle; what a tenant trains registers like any version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pandas as pd
import pytest
import ray

from flowrl.backends.actors import (
    NAMESPACE,
    SharedPlacement,
    sampler,
    shared_worker_name,
    shared_worker_stats,
    start_policy,
    stop_policy,
    trainer,
)
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
DATA = [
    Datum(tokens=[5, 6, 7, 8, 9, 10, 11, 12], loss_mask=[0, 0, 1, 1, 1, 1, 1, 1], advantage=1.0),
    Datum(tokens=[15, 16, 17, 18, 19], loss_mask=[0, 1, 1, 1, 1], advantage=-1.0),
]


@pytest.fixture
def spec(model_dir: str, tmp_path) -> WorkerSpec:
    lora = LoraSettings(enabled=True, r=8)
    return WorkerSpec(
        model_uri=model_dir, cache_dir=str(tmp_path), lora=lora, seed=1, learning_rate=3e-3
    )


def _samples(policy) -> list[tuple[list[int], list[float]]]:
    return [(r.tokens, r.logprobs) for r in sampler(policy).sample(PROMPTS, 6, 1.0, seed=3)]


def _train(policy, steps: int = 3) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(trainer(policy).forward_backward(DATA, "cross_entropy")["loss"])
        trainer(policy).optim_step()
    policy.sync()
    return losses


def _pid(name: str) -> int:
    return ray.get(ray.get_actor(name, namespace=NAMESPACE).where.remote())[1]


def _gone(name: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


def test_a_tenant_computes_what_its_own_workers_would(ray_local, spec: WorkerSpec) -> None:
    """The same LoRA job step by step, own workers vs a tenant of a shared worker: the same
    losses, and after a sync the same sampled tokens and log-probs, bit for bit."""
    own = start_policy("own-parity", spec)
    try:
        expected = (_train(own), _samples(own))
    finally:
        stop_policy(own)
    tenant = start_policy("tenant-parity", spec, shared=SharedPlacement(idle_timeout_s=2))
    try:
        assert (_train(tenant), _samples(tenant)) == expected
        assert tenant.weights_version() == 3
    finally:
        stop_policy(tenant)


def test_tenants_share_one_base_and_are_isolated_bit_for_bit(ray_local, spec: WorkerSpec) -> None:
    placement = SharedPlacement(idle_timeout_s=2)
    a = start_policy("tenant-a", spec, shared=placement)
    began = time.monotonic()
    b = start_policy("tenant-b", spec.model_copy(update={"seed": 2}), shared=placement)
    joined_s = time.monotonic() - began
    try:
        assert a.trainer == b.trainer == shared_worker_name(spec)
        stats = shared_worker_stats(a.trainer)
        assert set(stats["tenants"]) == {"tenant-a", "tenant-b"} and stats["base_loads"] == 1
        print(f"\nsecond tenant joined the running worker in {joined_s:.2f} s")
        b_before = _samples(b)
        a_before = _samples(a)
        _train(a)  # A trains and syncs between B's calls
        assert _samples(b) == b_before  # B sees nothing of it, bit for bit
        assert _samples(a) != a_before
        assert (a.weights_version(), b.weights_version()) == (3, 0)
    finally:
        stop_policy(a)
        stop_policy(b)


def test_a_failing_tenant_fails_alone(ray_local, spec: WorkerSpec) -> None:
    placement = SharedPlacement(idle_timeout_s=2)
    a = start_policy("failing-a", spec, shared=placement)
    b = start_policy("healthy-b", spec.model_copy(update={"seed": 2}), shared=placement)
    try:
        pid = _pid(a.trainer)
        b_before = _samples(b)
        bad = [Datum(tokens=[5, 10**6, 7], loss_mask=[0, 1, 1], advantage=1.0)]  # no such token
        with pytest.raises(ray.exceptions.RayTaskError, match="index"):
            trainer(a).forward_backward(bad, "cross_entropy")
        nan = [dataclasses.replace(d, advantage=float("nan")) for d in DATA]
        trainer(a).forward_backward(nan, "ppo_clip")  # a NaN loss: A's own problem
        trainer(a).optim_step()
        a.sync()
        assert _samples(b) == b_before  # B goes on, bit for bit, in the same process
        assert _pid(b.trainer) == pid
        assert all(loss == loss for loss in _train(b))  # B still trains: finite losses
        stop_policy(a)  # the failed tenant leaves; B stays
        assert set(shared_worker_stats(b.trainer)["tenants"]) == {"healthy-b"}
    finally:
        stop_policy(a)
        stop_policy(b)


def test_an_idle_worker_ends_and_the_next_tenant_starts_a_new_one(
    ray_local, spec: WorkerSpec
) -> None:
    placement = SharedPlacement(idle_timeout_s=1.5)
    a = start_policy("idle-a", spec, shared=placement)
    pid = _pid(a.trainer)
    stop_policy(a)
    assert _gone(a.trainer, within_s=15), "a worker without tenants outlived its idle timeout"
    b = start_policy("idle-b", spec, shared=placement)
    try:
        assert _pid(b.trainer) != pid and shared_worker_stats(b.trainer)["base_loads"] == 1
    finally:
        stop_policy(b)


def _gpu_limit_active(name: str = "gpu") -> int:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_the_worker_holds_its_gpu_slots_once(prefect_api, ray_local, spec, monkeypatch) -> None:
    """Two tenants of a worker that asks for 1 GPU: the `gpu` limit has 1 slot taken, not 2;
    the slot comes back when the idle worker ends."""
    from prefect.settings import PREFECT_API_URL

    from flowrl.infra.scheduler import apply_scheduler, load_scheduler

    monkeypatch.setenv("FLOWRL_POOL_GPUS", "2")
    asyncio.run(apply_scheduler(load_scheduler()))
    before = _gpu_limit_active()
    placement = SharedPlacement(gpus=1, idle_timeout_s=1.5, prefect_api_url=PREFECT_API_URL.value())
    on_cpu = spec.model_copy(update={"device": "cpu"})
    a = start_policy("gpu-a", on_cpu, shared=placement)
    b = start_policy("gpu-b", on_cpu.model_copy(update={"seed": 2}), shared=placement)
    try:
        assert _gpu_limit_active() == before + 1
    finally:
        stop_policy(a)
        stop_policy(b)
    assert _gone(a.trainer, within_s=15)
    deadline = time.monotonic() + 15
    while _gpu_limit_active() > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gpu_limit_active() == before


# ------------------------------------------------------------------ rl-train jobs as tenants


def _job(name: str, seed: int):
    from flowrl.tasks.jobs import load_job

    return load_job(
        None,
        [
            f"name={name}",
            f"seed={seed}",
            "model.lora.enabled=true",
            "resources.placement=shared",
            "algorithm.learning_rate=1e-3",
            "schedule.steps=6",
            "schedule.eval_every=6",
            "schedule.checkpoint_every=6",
            "rollout.prompts_per_step=8",
        ],
    )


def test_rl_jobs_are_tenants_admitted_by_adapter_slots(prefect_api, flowrl_home, monkeypatch):
    """One adapter slot, two rl-train jobs submitted together: one waits in Prefect until
    the other has left, then joins the same running worker (no restart, the base
    loaded once); both register versions that load with mlflow.pyfunc."""
    import mlflow.pyfunc
    from prefect import get_client

    from flowrl.flows.rl import rl_train

    monkeypatch.setenv("FLOWRL_SHARED_ADAPTER_SLOTS", "1")
    monkeypatch.setenv("FLOWRL_SHARED_IDLE_S", "60")
    results: dict[str, object] = {}

    def run(name: str, seed: int) -> None:
        try:
            results[name] = rl_train(_job(name, seed))
        except BaseException as exc:  # reported below
            results[name] = exc

    first = threading.Thread(target=run, args=("tenant-job-a", 1))
    first.start()
    time.sleep(2.0)  # A asks for the slot first
    second = threading.Thread(target=run, args=("tenant-job-b", 2))
    second.start()
    first.join(600)
    second.join(600)
    for name in ("tenant-job-a", "tenant-job-b"):
        assert not isinstance(results.get(name), BaseException), results.get(name)
    a, b = results["tenant-job-a"], results["tenant-job-b"]

    workers = [n for n in ray.util.list_named_actors(all_namespaces=True) if "shared-" in str(n)]
    names = {w["name"] for w in workers if w["namespace"] == NAMESPACE}
    assert len(names) == 1, names  # one worker for both jobs
    worker = names.pop()
    stats = shared_worker_stats(worker)
    assert stats["base_loads"] == 1 and stats["tenants"] == {}
    spans: dict[str, dict[str, float]] = {}
    for tenant, what, at in stats["events"]:
        spans.setdefault(tenant, {})[what] = at
    first, second = sorted(spans.values(), key=lambda span: span["joined"])
    # The second joined only after the first had left: one adapter slot, Prefect's admission.
    assert len(spans) == 2 and second["joined"] >= first["left"], spans
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(f"adapter-slots-{worker}")
    assert (limit.limit, limit.active_slots) == (1, 0)

    for result in (a, b):
        assert result.steps == 6
        model = mlflow.pyfunc.load_model(result.model_uri)
        rows = pd.DataFrame({"messages": [[{"role": "user", "content": "What is 2 + 3?"}]]})
        out = model.predict(rows, params={"max_new_tokens": 8})
        assert isinstance(out["content"][0], str)
    ray.kill(ray.get_actor(worker, namespace=NAMESPACE))
