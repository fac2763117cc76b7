"""Several sampler actors feeding one trainer (``resources.samplers``): the rollout's groups
are split between them, every weight sync reaches them all, and on a Ray cluster of two nodes
they run on different nodes. Tested for correctness, not speed."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from flowrl.agent_loop.seeding import derived_seed
from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.models.model_folder import load_tokenizer
from flowrl.backends.policy.actors import (
    sampler,
    sampler_weights_version,
    start_policy,
    stop_policy,
    sync_weights,
    trainer,
)
from flowrl.backends.types import Datum, WorkerSpec
from flowrl.tasks.episodes import run_group_episodes
from flowrl.tasks.schemas import load_job

REPO = Path(__file__).resolve().parents[1]
_names = itertools.count()


@pytest.fixture
def start(model_dir: str, tmp_path: Path):
    """``start(samplers=n)``: in-process workers of the tiny model; stopped afterwards."""
    refs = []

    def _start(samplers: int):
        spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path / "cache"), seed=0)
        name = f"test-samplers-{next(_names)}"
        refs.append(start_policy(name, spec, local=True, samplers=samplers))
        return refs[-1]

    yield _start
    for ref in refs:
        stop_policy(ref)


def test_a_rollout_splits_its_groups_between_the_samplers_in_order(start, model_dir):
    """Share i of a two-sampler rollout is exactly what one sampler samples for those rows
    with the share's seed: share 0 with the rollout's own seed, share 1 with (seed, 1)."""
    cfg = load_job(None, ["rollout.max_new_tokens=6"])
    task = cfg.env.task(cfg.seed)
    rows = task.train_source().next_batch(5)
    chat = HFChatFormat(load_tokenizer(model_dir))
    limits = cfg.rollout.limits()
    two, one = start(samplers=2), start(samplers=1)
    assert len(two.samplers) == 2 and len(set(two.samplers)) == 2

    both = run_group_episodes(task, rows, 3, two, chat, limits, seed=7, id_prefix="s0")
    assert [t.group_id for t in both] == [g for g in range(5) for _ in range(3)]
    assert len({t.episode_id for t in both}) == 15
    first = run_group_episodes(task, rows[:3], 3, one, chat, limits, seed=7, id_prefix="s0")
    second = run_group_episodes(
        task, rows[3:], 3, one, chat, limits, seed=derived_seed(7, 1), id_prefix="s0"
    )
    assert [t.tokens for t in both[:9]] == [t.tokens for t in first]
    assert [t.tokens for t in both[9:]] == [t.tokens for t in second]
    assert [t.reward for t in both] == [t.reward for t in first + second]


def test_a_weight_sync_reaches_every_sampler(start, prompts):
    """After an update and a sync, each sampler's log-probs of what it samples equal the
    trainer's; a sampler left behind is caught before a rollout mixes two policies."""
    ref = start(samplers=2)
    trainer(ref).forward_backward(
        _data(prompts, sampler(ref, 1).sample(prompts, 8, 1.0, 0)), "ppo_clip"
    )
    trainer(ref).optim_step()
    assert sync_weights(ref) == 1 and sampler_weights_version(ref) == 1
    for index in (0, 1):
        results = sampler(ref, index).sample(prompts, 8, 1.0, seed=3)
        rows = trainer(ref).compute_logprobs(_data(prompts, results))
        for p, r, row in zip(prompts, results, rows, strict=True):
            assert row[len(p) :] == pytest.approx(r.logprobs, abs=1e-5)
    trainer(ref).forward_backward(_data(prompts, results), "ppo_clip")
    trainer(ref).optim_step()
    sampler(ref, 1).set_weights(trainer(ref).get_weights())  # one sampler ahead of the other
    with pytest.raises(RuntimeError, match="samplers hold different weights"):
        sampler_weights_version(ref)


def _data(prompts: list[list[int]], results) -> list[Datum]:
    return [
        Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens), 1.0, [0.0] * len(p) + r.logprobs)
        for p, r in zip(prompts, results, strict=True)
    ]


def test_gpu_slots_are_split_between_every_sampler_and_the_trainer():
    where = load_job(None, ["resources.samplers=3", "resources.gpus=4"]).resources.placement_for()
    assert where.samplers == 3 and where.build.resources.num_gpus == 1.0 and not where.colocate


def test_an_on_policy_job_colocates_its_sampler_and_trainer_unless_told_otherwise():
    """Unset, ``resources.colocate`` follows the job: on-policy with one sampler and the hf
    and torch backends, one actor holds both roles and all the job's GPU slots; a shared
    worker's tenant keeps its own sampler and trainer adapters at any staleness."""
    from flowrl.backends.policy.placement import SharedTenant
    from flowrl.backends.policy.resources import SharedWorkerSettings

    on_policy = load_job(None, ["resources.gpus=2"]).placement_for()
    assert on_policy.colocate and on_policy.build.resources.num_gpus == 2.0
    ahead = load_job(None, ["resources.gpus=2", "schedule.off_policy_steps=1"]).placement_for()
    assert not ahead.colocate and ahead.build.resources.num_gpus == 1.0
    apart = load_job(None, ["resources.gpus=2", "resources.colocate=false"]).placement_for()
    assert not apart.colocate and apart.build.resources.num_gpus == 1.0
    assert not load_job(None, ["resources.trainer_backend=deepspeed"]).placement_for().colocate
    with pytest.raises(ValueError, match="cannot sample while it trains"):
        load_job(None, ["resources.colocate=true", "schedule.off_policy_steps=1"])
    with pytest.raises(ValueError, match="cannot sample while it trains"):
        load_job(None, ["resources.colocate=true", "schedule.max_staleness=4"])
    assert not load_job(None, ["schedule.max_staleness=4"]).placement_for().colocate
    shared = ["model.lora.enabled=true", "resources.placement=shared", "schedule.max_staleness=2"]
    settings = SharedWorkerSettings()
    assert isinstance(load_job(None, shared).placement_for(settings), SharedTenant)
    with pytest.raises(ValueError, match="needs one sampler"):
        load_job(None, ["resources.colocate=true", "resources.samplers=2"])


def test_two_samplers_on_two_nodes_of_a_ray_cluster_feed_one_trainer(tmp_path, prefect_api):
    """``flowrl train`` with ``resources.samplers: 2`` against a Ray cluster of two nodes on
    this machine (a head and a second ``ray start --address``): the samplers run on different
    nodes (the MLflow run's ``node/*`` tags), every step trains on batches at most one update
    old, and the job registers its policy."""
    from prefect.settings import PREFECT_API_URL
    from services import ray_head, ray_node, run_flowrl

    env = dict(os.environ)
    env["FLOWRL_HOME"] = str(tmp_path / "home")
    env.pop("MLFLOW_TRACKING_URI", None)
    env["RAY_AUTH_MODE"] = "token"  # the cluster's token (~/.ray) lets the second node join
    overrides = [
        "name=two-samplers",
        "resources.samplers=2",
        "warmup.enabled=false",
        "schedule.steps=3",
        "schedule.eval_every=3",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "env.params.eval_size=16",
    ]
    with ray_head(env, num_cpus=2) as address, ray_node(address, env, num_cpus=2):
        env |= {"FLOWRL_RAY_ADDRESS": address, "PREFECT_API_URL": PREFECT_API_URL.value()}
        done = run_flowrl("train", REPO / "configs" / "arithmetic.yaml", overrides, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "models:/two-samplers/1" in done.stdout
    from mlflow import MlflowClient

    result = json.loads(
        (tmp_path / "home" / "storage" / "jobs" / "two-samplers" / "result.json").read_text()
    )
    run_id = result["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    tags = client.get_run(run_id).data.tags
    nodes = {k: v for k, v in tags.items() if k.startswith("node/")}
    assert set(nodes) == {"node/sampler-0", "node/sampler-1", "node/trainer"}
    assert nodes["node/sampler-0"] != nodes["node/sampler-1"]  # one sampler on each node
    staleness = client.get_metric_history(run_id, "train/staleness")
    rewards = client.get_metric_history(run_id, "reward/mean")
    failed = client.get_metric_history(run_id, "rollout/failed_episodes")
    assert sorted(m.step for m in rewards) == [1, 2, 3]
    assert all(0 <= m.value <= 1 for m in staleness) and len(staleness) == 3
    assert all(m.value == 0 for m in failed)
