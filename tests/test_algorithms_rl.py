"""Every registered advantage estimator and policy loss trains by a config change alone.

Each case runs two RL steps of the real stages (``rollout.fn`` → ``score.fn`` → ``update.fn``)
with in-process workers, from a tiny model SFT-warmed on a tiny arithmetic space so that groups
have mixed rewards. The behaviour asserted: the update moves the policy toward the episodes with
positive advantage (their advantage-weighted log-likelihood rises), the sampler is synced, and
the KL to the reference is measured when a KL coefficient is set.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from flowrl.backends.engines.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from flowrl.backends.policy.actors import sampler, start_policy, stop_policy, sync_weights, trainer
from flowrl.backends.types import WorkerSpec
from flowrl.infra.storage import Storage
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.model import prepare_model
from flowrl.tasks.records import load_data
from flowrl.tasks.rl import rollout, score, update
from flowrl.tasks.schemas import RLJobConfig
from flowrl.tasks.sft import sft_datum
from flowrl.tasks.types import JobContext

torch.set_num_threads(1)
_names = itertools.count()
TINY = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "intermediate_size": 128}
ENV = {"max_operand": 3, "max_operand2": 3, "eval_size": 4}  # answers 0..6

CASES: list[dict[str, Any]] = [
    *({"algorithm": {"advantage": name}} for name in sorted(ADVANTAGE_ESTIMATORS)),
    *({"algorithm": {"loss": name}} for name in sorted(POLICY_LOSSES) if name != "ppo_clip"),
    {"algorithm": {"clip_eps_high": 0.28, "loss_agg": "seq-mean-token-sum"}},  # DAPO / Dr. GRPO
    {"algorithm": {"kl_coef": 0.1, "kl_estimator": "k3"}, "model": {"lora": {"enabled": True}}},
    {"algorithm": {"kl_coef": 0.1, "kl_estimator": "k2"}},  # full: a frozen reference copy
    {"algorithm": {"kl_coef": 0.1, "kl_estimator": "k1", "kl_in": "reward"}},
    {"algorithm": {"tis_cap": 2.0}},  # truncated importance sampling (Yao et al. 2025)
]


def _config(overrides: dict[str, Any], model_uri: str) -> RLJobConfig:
    base: dict[str, Any] = {
        "name": f"algo-rl-{next(_names)}",
        "env": {"name": "arithmetic", "params": ENV},
        "model": {"source": model_uri, "tiny": TINY},
        "warmup": {"enabled": False},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 3},
        "algorithm": {"learning_rate": 1e-3},
    }
    for section, fields in overrides.items():
        base[section] = {**base.get(section, {}), **fields}
    return RLJobConfig.model_validate(base)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> JobContext:
    root = tmp_path_factory.mktemp("algo-rl")
    return JobContext("algo-rl", str(root / "store"), str(root / "cache"), "algo-rl")


@pytest.fixture(scope="module")
def warm_model(ctx: JobContext) -> str:
    """A tiny model SFT-trained for a few dozen steps: partly right, so rewards vary."""
    cfg = _config({}, "tiny")
    base_uri = prepare_model.fn(cfg, ctx)
    spec = WorkerSpec(model_uri=base_uri, cache_dir=ctx.cache_dir, learning_rate=3e-3)
    policy = start_policy("algo-rl-warm", spec, local=True)
    task_cfg, chat = cfg.env.task(), chat_format(base_uri, ctx.cache_dir, cfg.model)
    source = task_cfg.train_source()
    for _ in range(60):
        data = [sft_datum(chat, task_cfg.sft_example(r)) for r in source.next_batch(16)]
        trainer(policy).forward_backward(data, "cross_entropy")
        trainer(policy).optim_step()
    uri = trainer(policy).export_pretrained(ctx.storage_url, "models/warm")
    stop_policy(policy)
    return uri


def _weighted_loglik(worker: Any, data: list, temperature: float) -> float:
    """``sum_i A_i * sum_t m_it * logp_it``: what every policy loss pushes up at ratio 1."""
    logprobs = worker.compute_logprobs(data, temperature)
    return sum(
        d.advantage * sum(lp * m for lp, m in zip(row, d.loss_mask, strict=True))
        for d, row in zip(data, logprobs, strict=True)
    )


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: str(o["algorithm"]))
def test_each_algorithm_trains_by_config_change(overrides, warm_model, ctx):
    cfg = _config(overrides, warm_model)
    spec = WorkerSpec(
        model_uri=warm_model,
        cache_dir=ctx.cache_dir,
        lora=cfg.model.lora,
        learning_rate=cfg.algorithm.learning_rate,
        seed=cfg.seed,
    )
    job = JobContext(cfg.name, ctx.storage_url, ctx.cache_dir, cfg.name)
    policy = start_policy(cfg.name, spec, local=True)
    try:
        cursor, rises = None, []
        for step in range(2):
            batch = rollout.fn(cfg, job, warm_model, policy, step, cursor)
            scored = score.fn(cfg, job, policy, batch)
            cursor = batch.cursor
            assert scored.data is not None
            data = load_data(Storage(job.storage_url), scored.data)
            before = _weighted_loglik(trainer(policy), data, cfg.rollout.temperature)
            stats = update.fn(cfg, job, policy, scored).metrics
            after = _weighted_loglik(trainer(policy), data, cfg.rollout.temperature)
            if scored.metrics["reward/nonzero_advantage_frac"] > 0:
                rises.append(after > before)
            assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()), stats
        assert rises and all(rises), "the update did not favour positive-advantage episodes"
        assert stats["train/weights_version"] == 2
        assert sampler(policy).get_weights_version() == 2  # synced after each update
        if cfg.algorithm.kl_coef > 0:
            assert stats["train/kl_ref"] >= 0.0 or cfg.algorithm.kl_estimator == "k1"
            assert "train/kl_ref" in stats
        if cfg.algorithm.tis_cap is not None:  # float32 sampler and trainer: w about 1
            assert stats["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
            assert stats["train/tis_clip_frac"] == 0.0
        else:
            assert "train/tis_weight_mean" not in stats
        # Every record a step wrote (kl_in: reward's rewards too) is gone after its update.
        storage, steps = Storage(job.storage_url), f"{job.prefix}/steps"
        left = storage.sizes(steps) if storage.exists(steps) else {}
        assert left == {}, left
    finally:
        stop_policy(policy)


def test_reference_is_the_starting_policy(warm_model, ctx):
    """Before any update the KL to the reference is 0, with LoRA (adapter off) and without
    (frozen copy); after updates it is positive, and a sync leaves the reference alone."""
    for lora in (False, True):
        cfg = _config({"model": {"lora": {"enabled": lora}}}, warm_model)
        spec = WorkerSpec(
            model_uri=warm_model, cache_dir=ctx.cache_dir, lora=cfg.model.lora, learning_rate=1e-2
        )
        policy = start_policy(f"algo-ref-{next(_names)}", spec, local=True)
        try:
            worker = trainer(policy)
            job = JobContext(cfg.name, ctx.storage_url, ctx.cache_dir, cfg.name)
            scored = score.fn(cfg, job, policy, rollout.fn(cfg, job, warm_model, policy, 0, None))
            data = load_data(Storage(ctx.storage_url), scored.data)
            ref, current = worker.compute_ref_logprobs(data), worker.compute_logprobs(data)
            assert torch.allclose(
                torch.tensor(sum(ref, [])), torch.tensor(sum(current, [])), atol=1e-6
            )
            for d in data:
                d.advantage = 1.0
            for _ in range(3):
                worker.forward_backward(data, "ppo_clip")
                worker.optim_step()
            sync_weights(policy)
            moved = sum(
                abs(a - b)
                for r, c in zip(
                    worker.compute_ref_logprobs(data), worker.compute_logprobs(data), strict=True
                )
                for a, b in zip(r, c, strict=True)
            )
            assert moved > 1e-3
        finally:
            stop_policy(policy)


def test_unknown_names_fail_in_the_config():
    from flowrl.infra.configfile import ConfigError
    from flowrl.tasks.schemas import load_job

    for key in ("advantage", "loss", "loss_agg", "kl_estimator"):
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            load_job(None, [f"algorithm.{key}=nonsense"])
