"""The RL stages as Prefect tasks: rollout, reward, update, eval, checkpoint, restore.

Each task is one stage, keyed by (job, step) so a retry redoes exactly its own work; it calls
the policy's workers and passes small records, never tensors or models.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.agent_loop.seeding import derived_seed
from flowrl.backends.policy.actors import PolicyRef, sampler_weights_version, sync_weights, trainer
from flowrl.backends.types import Datum
from flowrl.infra.storage import Storage, prune_checkpoints
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.episodes import (
    episode_metrics,
    episode_source,
    episode_succeeded,
    evaluate_policy,
    run_group_episodes,
)
from flowrl.tasks.records import (
    discard,
    load_data,
    load_rows,
    load_trajectories,
    save_data,
    save_rows,
    save_trajectories,
)
from flowrl.tasks.schemas import RLJobConfig
from flowrl.tasks.types import EvalResult, JobContext, RolloutBatch, ScoredBatch, UpdateResult


@task(name="rollout", cache_policy=NO_CACHE)
def rollout(
    cfg: RLJobConfig,
    ctx: JobContext,
    model_uri: str,
    policy: PolicyRef,
    step: int,
    cursor: dict | None,
    skip: int = 0,
) -> RolloutBatch:
    """Sample ``group_size`` episodes for each of the step's data rows: the rows after
    ``cursor``, past ``skip`` steps' batches (rollouts started side by side with
    ``schedule.max_staleness`` >= 2, before the steps between are in)."""
    start = time.perf_counter()
    task_cfg = cfg.env.task(cfg.seed)
    source = task_cfg.train_source()
    if cursor:
        source.load_state(cursor)
    for _ in range(skip):
        source.next_batch(cfg.rollout.prompts_per_step)
    rows = source.next_batch(cfg.rollout.prompts_per_step)
    version = sampler_weights_version(policy)
    trajectories = run_group_episodes(
        episode_source(cfg.env, ctx.run_name),
        rows,
        cfg.rollout.group_size,
        policy,
        chat_format(model_uri, ctx.cache_dir, cfg.model),
        cfg.rollout.limits(),
        seed=derived_seed(cfg.seed, "rollout", step),
        id_prefix=f"s{step}",
    )
    # Up to one step off, a sync mid-rollout would mix two policies: a bug in the pipeline. With
    # k >= 2 it is how the run goes on (the batch's version is the one it started with; every
    # token keeps the log-prob it was sampled with, which the corrections weigh against).
    if cfg.schedule.staleness_bound <= 1 and sampler_weights_version(policy) != version:
        raise RuntimeError(f"step {step}: the sampler's weights changed during the rollout")
    rel = f"{ctx.step_dir(step)}/trajectories.json"
    save_trajectories(Storage(ctx.storage_url), rel, trajectories)
    return RolloutBatch(step, rel, source.state(), time.perf_counter() - start, version)


@task(name="reward", cache_policy=NO_CACHE)
def score(cfg: RLJobConfig, ctx: JobContext, policy: PolicyRef, batch: RolloutBatch) -> ScoredBatch:
    """Episode returns → advantages (computed by the policy's trainer) → training data (failed
    episodes are left out)."""
    start = time.perf_counter()
    storage = Storage(ctx.storage_url)
    trajectories = load_trajectories(storage, batch.trajectories)
    ok = [t for t in trajectories if not t.failed]
    metrics: dict[str, float] = {
        "rollout/failed_episodes": float(len(trajectories) - len(ok)),
        "rollout/sampled_tokens": float(sum(t.num_sampled_tokens for t in ok)),
        "rollout/tokens_per_s": sum(t.num_sampled_tokens for t in ok) / max(batch.seconds, 1e-9),
    }
    if not ok:
        metrics["reward/mean"] = 0.0
        return ScoredBatch(
            batch.step,
            None,
            metrics,
            weights_version=batch.weights_version,
            rollout_seconds=batch.seconds,
            seconds=time.perf_counter() - start,
        )
    rewards = [float(t.reward) for t in ok]
    group_ids = [t.group_id for t in ok]
    advantages = trainer(policy).advantages(rewards, group_ids, cfg.algorithm.advantage)
    data = [
        Datum(t.tokens, t.loss_mask, float(a), t.logprobs, t.images)
        for t, a in zip(ok, advantages, strict=True)
    ]
    correct = [episode_succeeded(cfg.env.success, t.reward, t.info) for t in ok]
    metrics |= episode_metrics(trajectories, "env") | {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/accuracy": sum(correct) / len(correct),
        "reward/nonzero_advantage_frac": sum(abs(a) > 1e-8 for a in advantages) / len(advantages),
    }
    samples = [{"reward": t.reward, "messages": t.messages} for t in ok[:: cfg.rollout.group_size]]
    rel = f"{ctx.step_dir(batch.step)}/data.json"
    save_data(storage, rel, data)
    if _kl_in_reward(cfg):  # the update stage re-scores with the reference model's KL
        groups = [{"reward": r, "group_id": g} for r, g in zip(rewards, group_ids, strict=True)]
        save_rows(storage, f"{ctx.step_dir(batch.step)}/rewards.json", groups)
    return ScoredBatch(
        batch.step,
        rel,
        metrics,
        samples[:4],
        batch.weights_version,
        rollout_seconds=batch.seconds,
        seconds=time.perf_counter() - start,
    )


def _kl_in_reward(cfg: RLJobConfig) -> bool:
    return cfg.algorithm.kl_coef > 0 and cfg.algorithm.kl_in == "reward"


@task(name="update", cache_policy=NO_CACHE)
def update(
    cfg: RLJobConfig, ctx: JobContext, policy: PolicyRef, scored: ScoredBatch
) -> UpdateResult:
    """One optimiser step on the scored batch, then weight sync trainer → sampler.

    With ``schedule.max_staleness: 1`` the next step's rollout is still running on the
    sampler: the flow syncs once it ends (``weight_sync``), so no rollout mixes two policies;
    with k >= 2 the flow syncs at once. A batch more than k updates behind the trainer is
    dropped there (``train/dropped_batches``), with k >= 2 only (below, a bug: it fails).
    """
    start = time.perf_counter()
    storage = Storage(ctx.storage_url)
    if scored.data is None:
        discard(storage, ctx.step_dir(scored.step))
        return UpdateResult({"train/skipped": 1.0}, time.perf_counter() - start)
    worker = trainer(policy)
    staleness = _staleness(cfg, worker, scored)
    if staleness.get("dropped_batches"):
        discard(storage, ctx.step_dir(scored.step))
        metrics = {"train/skipped": 1.0, **{f"train/{k}": v for k, v in staleness.items()}}
        return UpdateResult(metrics, time.perf_counter() - start)
    data = load_data(storage, scored.data)
    kl_metrics: dict[str, float] = {}
    if _kl_in_reward(cfg):
        groups = load_rows(storage, f"{ctx.step_dir(scored.step)}/rewards.json")
        alg = cfg.algorithm
        advantages, kl_metrics = worker.kl_penalised_advantages(
            data,
            [g["reward"] for g in groups],
            [g["group_id"] for g in groups],
            cfg.rollout.temperature,
            alg.kl_coef,
            alg.kl_estimator,
            alg.advantage,
        )
        data = [
            Datum(d.tokens, d.loss_mask, a, d.old_logprobs, d.images)
            for d, a in zip(data, advantages, strict=True)
        ]
    loss_config = cfg.algorithm.loss_config()
    computed = time.perf_counter()
    # One forward_backward, one optim_step per batch: with an algorithm.is_correction the
    # trainer's old log-probs are this pass's, detached (torch_trainer._off_policy_correction). A
    # second optimiser pass would need them computed once before the first (compute_logprobs).
    metrics = worker.forward_backward(
        data, cfg.algorithm.loss, loss_config, cfg.rollout.temperature
    )
    metrics |= worker.optim_step() | kl_metrics | staleness
    trained = time.perf_counter()
    if cfg.schedule.staleness_bound == 0:
        sync_weights(policy)
    synced = time.perf_counter()
    discard(storage, ctx.step_dir(scored.step))  # the step's records are consumed
    return UpdateResult(
        {f"train/{k}": float(v) for k, v in metrics.items()},
        seconds=time.perf_counter() - start,
        train_seconds=trained - computed,
        sync_seconds=synced - trained,
    )


def _staleness(cfg: RLJobConfig, worker: Any, scored: ScoredBatch) -> dict[str, float]:
    """Updates the trainer has taken since the weights that started sampling ``scored``.
    Outside 0..k (``schedule.max_staleness``) it is a bug in the pipeline up to k = 1, and
    fails the step; with k >= 2 the batch is dropped (``dropped_batches``: 1)."""
    if scored.weights_version is None:  # e.g. self-play's duel rollouts do not record it
        return {}
    bound = cfg.schedule.staleness_bound
    trainer_version = worker.get_weights_version()
    staleness = trainer_version - scored.weights_version
    if 0 <= staleness <= bound:
        return {"staleness": float(staleness)} | ({"dropped_batches": 0.0} if bound >= 2 else {})
    if bound >= 2 and staleness > bound:
        return {"staleness": float(staleness), "dropped_batches": 1.0}
    raise RuntimeError(
        f"step {scored.step}: sampled by weights v{scored.weights_version}, trainer at "
        f"v{trainer_version}: staleness {staleness} outside 0..{bound}"
    )


@task(name="sync", cache_policy=NO_CACHE)
def weight_sync(policy: PolicyRef) -> float:
    """Weight sync trainer → sampler once no rollout is running (off-policy pipeline); returns
    its seconds."""
    start = time.perf_counter()
    sync_weights(policy)
    return time.perf_counter() - start


@task(name="eval", cache_policy=NO_CACHE)
def evaluate(cfg: RLJobConfig, ctx: JobContext, model_uri: str, policy: PolicyRef) -> EvalResult:
    """Greedy accuracy on the environment's fixed held-out set."""
    chat = chat_format(model_uri, ctx.cache_dir, cfg.model)
    make_env = episode_source(cfg.env, ctx.run_name)
    limits = cfg.rollout.limits(greedy=True)
    return evaluate_policy(cfg.env.task(cfg.seed), policy, chat, limits, make_env, cfg.env.success)


@task(name="checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def checkpoint(
    cfg: RLJobConfig, ctx: JobContext, policy: PolicyRef, step: int, meta: dict[str, Any]
) -> str:
    """Commit a resumable checkpoint after ``step`` steps; keep the newest few."""
    uri = trainer(policy).save_state(ctx.storage_url, ctx.checkpoint_prefix, step, meta)
    prune_checkpoints(
        Storage(ctx.storage_url), ctx.checkpoint_prefix, cfg.schedule.keep_checkpoints
    )
    return uri


@task(name="restore", cache_policy=NO_CACHE)
def restore(ctx: JobContext, policy: PolicyRef) -> dict[str, Any] | None:
    """Resume from the job's latest complete checkpoint, if any (weights synced to sampler)."""
    meta = trainer(policy).load_state(ctx.storage_url, ctx.checkpoint_prefix)
    if meta is not None:
        sync_weights(policy)
    return meta
