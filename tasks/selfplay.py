"""Self-play stages: duel rollouts between agents, head-to-head games, and each policy's
evaluation against the game's reference opponent.

Each agent keeps its own storage prefix (``jobs/<job>/agent-<A>``) for step records and
checkpoints, so the per-agent reward/update tasks of ``tasks.rl`` run unchanged on it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.agent_loop.coordinator import run_multiagent_episodes
from flowrl.agent_loop.seeding import SeededSampler, derived_seed
from flowrl.backends.policy.actors import PolicyRef, sampler, sync_weights, trainer
from flowrl.environments.games import winner
from flowrl.environments.timeouts import TimedEnv
from flowrl.infra.storage import (
    POINTER,
    CheckpointError,
    Storage,
    checkpoint_dir,
    latest_checkpoint,
    prune_checkpoints,
)
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.episodes import episode_metrics, evaluate_policy
from flowrl.tasks.records import save_trajectories
from flowrl.tasks.schemas import SelfPlayJobConfig
from flowrl.tasks.types import DuelResult, EvalResult, JobContext, RolloutBatch


def agent_context(ctx: JobContext, agent: str) -> JobContext:
    """The agent's own storage prefix and actor names inside the job."""
    return dataclasses.replace(
        ctx, name=f"{ctx.name}/agent-{agent}", run_name=f"{ctx.run_name}-{agent}"
    )


def _duel(
    cfg: SelfPlayJobConfig,
    ctx: JobContext,
    model_uri: str,
    policies: dict[str, PolicyRef],
    games: Any,
    rows: list[dict[str, Any]],
    seed: int,
    greedy: bool = False,
):
    limits = cfg.rollout.limits(greedy=greedy)
    samplers = {a: SeededSampler(sampler(p), derived_seed(seed, a)) for a, p in policies.items()}
    envs = [TimedEnv(games.make_game(), cfg.env.step_timeout_s) for _ in rows]
    chat = chat_format(model_uri, ctx.cache_dir, cfg.model)
    return envs, run_multiagent_episodes(envs, rows, samplers, chat, limits)


@task(name="duel-rollout", cache_policy=NO_CACHE)
def duel_rollout(
    cfg: SelfPlayJobConfig,
    ctx: JobContext,
    model_uri: str,
    policies: dict[str, PolicyRef],
    step: int,
) -> DuelResult:
    """``prompts_per_step`` openings × ``group_size`` games between the agents.

    Returns, per trained policy, a ``RolloutBatch`` over its trajectories (both sides' for a
    shared policy), and per-agent metrics.
    """
    started = time.perf_counter()
    n, g = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    games = cfg.games()
    rows = [dict(row) for row in games.openings(step, n) for _ in range(g)]
    seed = derived_seed(cfg.seed, "duel", step)
    _, out = _duel(cfg, ctx, model_uri, policies, games, rows, seed)
    metrics: dict[str, float] = {}
    for agent, trajectories in out.items():
        for t in trajectories:
            t.group_id //= g  # games of one opening form a GRPO group
        metrics |= episode_metrics(trajectories, f"agent-{agent}")
    storage, batches = Storage(ctx.storage_url), {}
    for owner in trained_policies(cfg):
        trajectories = [t for a in (cfg.agents if owner == "shared" else (owner,)) for t in out[a]]
        own = agent_context(ctx, owner)
        rel = f"{own.step_dir(step)}/trajectories.json"
        save_trajectories(storage, rel, trajectories)
        batches[owner] = RolloutBatch(step, rel, {}, time.perf_counter() - started)
    return DuelResult(batches, metrics)


@task(name="head-to-head", cache_policy=NO_CACHE)
def head_to_head(
    cfg: SelfPlayJobConfig, ctx: JobContext, model_uri: str, policies: dict[str, PolicyRef]
) -> dict[str, float]:
    """Greedy games between the agents on the game's head-to-head rows (Gomoku: each side
    opens once): wins per agent (the one best final reward), draws, and failed games."""
    games = cfg.games()
    rows = games.head_to_head_rows()
    envs, out = _duel(cfg, ctx, model_uri, policies, games, rows, seed=0, greedy=True)
    failed = {t.group_id for ts in out.values() for t in ts if t.failed}
    winners = [None if i in failed else winner(env.final_rewards()) for i, env in enumerate(envs)]
    metrics = {f"h2h/{a.lower()}_wins": float(winners.count(a)) for a in cfg.agents}
    draws = winners.count(None) - len(failed)
    return metrics | {"h2h/draws": float(draws), "h2h/failed": float(len(failed))}


@task(name="versus-opponent", cache_policy=NO_CACHE)
def versus_opponent(
    cfg: SelfPlayJobConfig,
    ctx: JobContext,
    model_uri: str,
    policy: PolicyRef,
    sides: tuple[str, ...],
) -> EvalResult:
    """Greedy games of ``policy`` playing ``sides`` against the game's reference opponent
    (Gomoku: the heuristic) on the held-out rows; accuracy is the share of successes."""
    task_cfg = cfg.games().versus(sides)
    chat = chat_format(model_uri, ctx.cache_dir, cfg.model)
    limits = cfg.rollout.limits(greedy=True)
    return evaluate_policy(task_cfg, policy, chat, limits, success=cfg.env.success)


@task(name="checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def checkpoint_policies(
    cfg: SelfPlayJobConfig,
    ctxs: dict[str, JobContext],
    policies: dict[str, PolicyRef],
    step: int,
) -> dict[str, str]:
    """Commit every trained policy's resumable checkpoint after ``step`` steps, each under its
    own prefix; only once all are committed are older ones pruned, so a kill between two
    commits still leaves a step that every policy has (``restore_policies`` goes back to it)."""
    uris = {
        o: trainer(p).save_state(ctxs[o].storage_url, ctxs[o].checkpoint_prefix, step, {})
        for o, p in policies.items()
    }
    for o in policies:
        storage = Storage(ctxs[o].storage_url)
        prune_checkpoints(storage, ctxs[o].checkpoint_prefix, cfg.schedule.keep_checkpoints)
    return uris


@task(name="restore", cache_policy=NO_CACHE)
def restore_policies(ctxs: dict[str, JobContext], policies: dict[str, PolicyRef]) -> int:
    """Resume every policy from the last step they all checkpointed (weights synced to their
    samplers); the number of steps done, 0 for a fresh start.

    A policy whose checkpoint is newer than another's (the job was killed between their
    commits) is pointed back at the common step; the newer one is committed again later."""
    prefixes = {o: (Storage(c.storage_url), c.checkpoint_prefix) for o, c in ctxs.items()}
    latest = {o: latest_checkpoint(storage, prefix) for o, (storage, prefix) in prefixes.items()}
    if any(step is None for step in latest.values()):
        return 0  # some policy never checkpointed: all start afresh
    common = min(step for step in latest.values() if step is not None)
    for o, (storage, prefix) in prefixes.items():
        if latest[o] != common:
            path = checkpoint_dir(prefix, common).rsplit("/", 1)[-1]
            storage.write_json(f"{prefix.strip('/')}/{POINTER}", {"step": common, "path": path})
    for o, policy in policies.items():
        meta = trainer(policy).load_state(ctxs[o].storage_url, ctxs[o].checkpoint_prefix)
        if meta is None or meta["step"] != common:
            found = None if meta is None else meta["step"]
            raise CheckpointError(f"policy {o}: checkpoint of step {common} expected, got {found}")
        sync_weights(policy)
    return common


def trained_policies(cfg: SelfPlayJobConfig) -> tuple[str, ...]:
    """The policies that learn: one shared, or one per agent."""
    return ("shared",) if cfg.shared_policy else cfg.agents
