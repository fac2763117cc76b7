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
import json
import threading
import time

import pandas as pd
import pytest
import ray
import torch

from flowrl.backends.policy.actors import sampler, start_policy, stop_policy, trainer
from flowrl.backends.policy.resources import SharedWorkerSettings, shared_worker_name
from flowrl.backends.policy.workers import shared_worker_stats
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec
from flowrl.infra.settings import RAY_NAMESPACE as NAMESPACE

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
    tenant = start_policy("tenant-parity", spec, shared=SharedWorkerSettings(idle_timeout_s=2))
    try:
        assert (_train(tenant), _samples(tenant)) == expected
        assert tenant.weights_version() == 3
    finally:
        stop_policy(tenant)


def test_tenants_share_one_base_and_are_isolated_bit_for_bit(ray_local, spec: WorkerSpec) -> None:
    settings = SharedWorkerSettings(idle_timeout_s=2)
    a = start_policy("tenant-a", spec, shared=settings)
    began = time.monotonic()
    b = start_policy("tenant-b", spec.model_copy(update={"seed": 2}), shared=settings)
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
    settings = SharedWorkerSettings(idle_timeout_s=2)
    a = start_policy("failing-a", spec, shared=settings)
    b = start_policy("healthy-b", spec.model_copy(update={"seed": 2}), shared=settings)
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


def _sample_at_once(host, calls: list[tuple[str, list[list[int]], float]]) -> list:
    """The calls (tenant, prompts, temperature) sent at once while the worker is busy with a
    long first call, so that they wait together; each call's (tokens, log-probs) or error."""
    long = [Datum(tokens=list(range(5, 100)), loss_mask=[1] * 95, advantage=1.0)] * 256
    busy = host.call_as.remote(calls[0][0], "trainer", "compute_logprobs", long)
    time.sleep(0.5)  # the long call holds the worker; the others queue behind it
    refs = [host.call_as.remote(t, "sampler", "sample", p, 6, temp, 3) for t, p, temp in calls]
    ray.get(busy)
    out = []
    for ref in refs:
        try:
            out.append([(r.tokens, r.logprobs) for r in ray.get(ref)])
        except ray.exceptions.RayTaskError as exc:
            out.append(exc)
    return out


def test_tenants_sampling_at_once_share_forward_passes(ray_local, spec: WorkerSpec) -> None:
    """Sampling calls of several tenants that arrive together run as one batch, each row with
    its tenant's adapter: greedy rows equal each tenant's own, a tenant's sampled draws do not
    depend on whose rows share the batch, and a bad call fails only its tenant."""
    settings = SharedWorkerSettings(idle_timeout_s=2)
    policies = [
        start_policy(f"mix-{i}", spec.model_copy(update={"seed": i + 1}), shared=settings)
        for i in range(3)
    ]
    try:
        for policy in policies[1:]:
            _train(policy, steps=len(policy.tenant))  # adapters that differ
        host = ray.get_actor(policies[0].trainer, namespace=NAMESPACE)
        names = [p.tenant for p in policies]

        def alone(tenant: str, temperature: float) -> list:
            rows = ray.get(
                host.call_as.remote(tenant, "sampler", "sample", PROMPTS, 6, temperature, 3)
            )
            return [(r.tokens, r.logprobs) for r in rows]

        greedy_alone = [alone(t, 0.0) for t in names]
        greedy_together = _sample_at_once(host, [(t, PROMPTS, 0.0) for t in names])
        for mine, together in zip(greedy_alone, greedy_together, strict=True):
            assert [tokens for tokens, _ in together] == [tokens for tokens, _ in mine]
            for (_, lp), (_, lp_alone) in zip(together, mine, strict=True):
                assert lp == pytest.approx(lp_alone, abs=1e-5)
        assert len({str(g) for g in greedy_alone}) == 3  # three different adapters answered
        assert max(shared_worker_stats(host_name := policies[0].trainer)["together"]) >= 3

        # A's draws with B and C beside it, and with C only: the same tokens.
        with_b_c = _sample_at_once(host, [(t, PROMPTS, 1.0) for t in names])
        with_c = _sample_at_once(host, [(names[0], PROMPTS, 1.0), (names[2], PROMPTS, 1.0)])
        assert [tok for tok, _ in with_b_c[0]] == [tok for tok, _ in with_c[0]]
        assert with_b_c[0] != greedy_alone[0]  # sampled, not greedy

        # A bad call (a token id the model does not have) fails alone; B's call is answered.
        bad = [[5, 10**6, 7]]
        answers = _sample_at_once(host, [(names[0], bad, 1.0), (names[1], PROMPTS, 0.0)])
        assert isinstance(answers[0], ray.exceptions.RayTaskError)
        assert [tok for tok, _ in answers[1]] == [tok for tok, _ in greedy_alone[1]]
        assert set(shared_worker_stats(host_name)["tenants"]) == set(names)
    finally:
        for policy in policies:
            stop_policy(policy)


def test_a_parked_tenant_is_restored_exactly(ray_local, spec: WorkerSpec) -> None:
    """One tenant in memory at a time (resident 1): A and B take turns, each parking the other
    to disk (adapters, gradients accumulated before A's optim_step, AdamW state); A's losses,
    weights and samples equal A's on a worker it has to itself, bit for bit."""

    def steps(policy, other=None) -> list[float]:
        losses = []
        for _ in range(3):
            losses.append(trainer(policy).forward_backward(DATA, "cross_entropy")["loss"])
            if other is not None:  # B's whole step between A's gradients and A's update
                trainer(other).forward_backward(DATA[:1], "cross_entropy")
                trainer(other).optim_step()
            trainer(policy).optim_step()
        policy.sync()
        return losses

    alone = start_policy("parked-alone", spec, shared=SharedWorkerSettings(idle_timeout_s=2))
    try:
        expected = (steps(alone), trainer(alone).get_weights(), _samples(alone))
    finally:
        stop_policy(alone)
        ray.kill(ray.get_actor(alone.trainer, namespace=NAMESPACE))
        assert _gone(alone.trainer, within_s=15)

    settings = SharedWorkerSettings(idle_timeout_s=2, resident=1)
    a = start_policy("parked-a", spec, shared=settings)
    b = start_policy("parked-b", spec.model_copy(update={"seed": 2}), shared=settings)
    try:
        losses = steps(a, other=b)
        stats = shared_worker_stats(a.trainer)
        assert stats["parks"] >= 6 and stats["parked"] == ["parked-b"], stats["parks"]
        weights, version = trainer(a).get_weights()
        assert losses == expected[0] and version == expected[1][1]
        assert weights.keys() == expected[1][0].keys()
        assert all(torch.equal(weights[k], expected[1][0][k]) for k in weights)
        assert _samples(a) == expected[2]
        assert shared_worker_stats(a.trainer)["parked"] == ["parked-b"]
        assert all(loss == loss for loss in _train(b))  # B, restored in turn, trains on
    finally:
        stop_policy(a)
        stop_policy(b)


def test_a_tinker_model_is_a_tenant_of_the_worker_jobs_use(
    prefect_api, ray_local, spec: WorkerSpec, tmp_path
) -> None:
    """The Tinker API with `--placement shared`, driven by the official SDK: its training model
    is an adapter on the same worker process as an rl-train tenant of the same base (the base
    loaded once); it trains and samples; the job's tenant sees nothing of it, bit for bit; the
    model holds an adapter slot while it is loaded, and leaves the worker when its session ends."""
    import tinker
    from prefect import get_client
    from services import TinkerServer
    from tinker import types

    from flowrl.backends.models.model_folder import load_tokenizer
    from flowrl.backends.models.tinker_checkpoints import resolve_base_model
    from flowrl.backends.policy.placement import SharedTenant
    from flowrl.backends.services.tinker.service import TinkerService

    key = "tml-shared-" + "s" * 24
    cache = str(tmp_path / "model-cache")
    path = resolve_base_model("tiny", cache)  # the catalogue's flowrl/tiny
    job = start_policy(
        "job-beside-tinker",
        spec.model_copy(update={"model_uri": path, "cache_dir": cache}),
        shared=SharedWorkerSettings(idle_timeout_s=2),
    )
    server = TinkerServer(TinkerService(SharedTenant(cache_dir=cache), keys={key: "alice"}))
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    try:
        job_before = _samples(job)
        model = client.create_lora_training_client("flowrl/tiny", rank=8, seed=1).result()
        stats = shared_worker_stats(job.trainer)
        assert len(stats["tinker_models"]) == 1 and set(stats["tenants"]) == {"job-beside-tinker"}
        assert stats["base_loads"] == 1
        with get_client(sync_client=True) as prefect:
            limit = prefect.read_global_concurrency_limit_by_name(f"adapter-slots-{job.trainer}")
        assert limit.active_slots == 1  # the Tinker model's (the bare policy holds none)

        ids = load_tokenizer(path).encode("12+7=19 3+4=7 5+5=10")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        losses = []
        for _ in range(5):
            out = model.forward_backward([datum], "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            model.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert losses[-1] < losses[0] * 0.8, losses  # it learns
        sampler = model.save_weights_and_get_sampling_client("after-5").result()
        prompt = types.ModelInput.from_ints(ids[:4])
        params = types.SamplingParams(max_tokens=5, temperature=1.0)
        sampled = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        assert len(sampled.sequences) == 2 and all(q.tokens for q in sampled.sequences)

        assert _samples(job) == job_before  # the job's tenant, bit for bit
        assert all(loss == loss for loss in _train(job))
        client.close("success").result()
        deadline = time.monotonic() + 15
        while shared_worker_stats(job.trainer)["tinker_models"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert shared_worker_stats(job.trainer)["tinker_models"] == {}
        # The slot is given back after the model has left the worker (its lease released
        # through the API): under load that comes a moment after the stats say it left.
        deadline = time.monotonic() + 30
        name = f"adapter-slots-{job.trainer}"
        with get_client(sync_client=True) as prefect:
            while True:
                limit = prefect.read_global_concurrency_limit_by_name(name)
                if limit.active_slots == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert limit.active_slots == 0
    finally:
        server.stop()
        stop_policy(job)


def test_an_idle_worker_ends_and_the_next_tenant_starts_a_new_one(
    ray_local, spec: WorkerSpec
) -> None:
    settings = SharedWorkerSettings(idle_timeout_s=1.5)
    a = start_policy("idle-a", spec, shared=settings)
    pid = _pid(a.trainer)
    stop_policy(a)
    assert _gone(a.trainer, within_s=15), "a worker without tenants outlived its idle timeout"
    b = start_policy("idle-b", spec, shared=settings)
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
    settings = SharedWorkerSettings(
        gpus=1, idle_timeout_s=1.5, prefect_api_url=PREFECT_API_URL.value()
    )
    on_cpu = spec.model_copy(update={"device": "cpu"})
    a = start_policy("gpu-a", on_cpu, shared=settings)
    b = start_policy("gpu-b", on_cpu.model_copy(update={"seed": 2}), shared=settings)
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
    from flowrl.tasks.schemas import load_job

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


def test_rl_jobs_are_tenants_admitted_by_adapter_slots(
    prefect_api, flowrl_home, monkeypatch, model_dir
):
    """One adapter slot, two rl-train jobs submitted together: one waits in Prefect until
    the other has left, then joins the same running worker (no restart, the base
    loaded once); both register versions that load with mlflow.pyfunc; batch inference of a
    version runs as a tenant too."""
    import mlflow.pyfunc
    from prefect import get_client

    from flowrl.flows.rl import rl_train

    monkeypatch.setenv("FLOWRL_SHARED_ADAPTER_SLOTS", "1")
    monkeypatch.setenv("FLOWRL_SHARED_IDLE_S", "60")
    # An existing limit keeps its slots (an operator's setting wins): drop those that earlier
    # tests of the session left for this base's worker, so the job creates it with one slot.
    with get_client(sync_client=True) as client:
        for limit in client.read_global_concurrency_limits(limit=200):
            if limit.name.startswith("adapter-slots-"):
                client.delete_global_concurrency_limit_by_name(limit.name)
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
    pid = stats["pid"]
    spans: dict[str, dict[str, float]] = {}
    for tenant, what, at in stats["events"]:
        if tenant.startswith("tenant-job-"):  # not an earlier test's tenant of this worker
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

    # Batch inference of A's version as a tenant: its adapter on the same running worker
    # (no new base load), answering as the version does on workers of its own.
    from flowrl.flows.inference import batch_inference
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage
    from flowrl.tasks.schemas import InferenceJobConfig

    episodes = {}
    for placement in ("shared", "own"):
        config = InferenceJobConfig(
            name=f"tenant-infer-{placement}",
            model=a.model_uri,
            num_prompts=16,
            resources={"placement": placement},
        )
        out = batch_inference(config)
        rel = f"jobs/tenant-infer-{placement}/inference/trajectories.jsonl"
        lines = Storage(get_settings().storage_root).read_bytes(rel).splitlines()
        episodes[placement] = [json.loads(line)["messages"][-1]["content"] for line in lines]
        if placement == "shared":
            stats = shared_worker_stats(worker)
            assert stats["pid"] == pid and stats["base_loads"] == 1  # the same process
            assert any(t.startswith("tenant-infer-shared") for t, _, _ in stats["events"])
    same = sum(x == y for x, y in zip(episodes["shared"], episodes["own"], strict=True))
    assert same >= 0.9 * len(episodes["own"]), (same, episodes)
    with pytest.raises(ValueError, match="keeps no LoRA adapter"):
        batch_inference(InferenceJobConfig(model=model_dir, resources={"placement": "shared"}))
    ray.kill(ray.get_actor(worker, namespace=NAMESPACE))
