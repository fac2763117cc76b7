"""Episode batches and what is measured on them: groups of episodes per row run through the
samplers (``run_group_episodes``), their metrics and success rule, and a policy's evaluation on
the held-out set."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.seeding import SeededSampler, derived_seed
from flowrl.agent_loop.types import Trajectory
from flowrl.backends.engines.episodes import EpisodeBatch
from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.policy.actors import PolicyRef, sampler
from flowrl.environments.agent import AgentTask
from flowrl.environments.registry import AGENT_PREFIX
from flowrl.environments.remote import EnvFactory, env_factory_for
from flowrl.environments.types import Environment
from flowrl.tasks.agent_episodes import run_agent_episodes
from flowrl.tasks.types import EvalResult


def episode_source(env_section: Any, job: str) -> Any:
    """What plays a job's episodes (``run_group_episodes``' ``envs_from``): the agent's task
    for an ``agent:`` environment (``environments.agent``), else an ``EnvFactory`` of the
    section's mode."""
    if env_section.name.startswith(AGENT_PREFIX):
        return env_section.task()
    return env_factory_for(env_section, job)


def run_group_episodes(
    envs_from: Any,
    rows: list[dict[str, Any]],
    group_size: int,
    policy: PolicyRef,
    chat: HFChatFormat,
    limits: LoopLimits,
    seed: int,
    id_prefix: str,
) -> list[Trajectory]:
    """Run ``group_size`` episodes per row (one group per row), batched through the sampler.
    With several samplers (``resources.samplers``) the groups are split into contiguous shares,
    one per sampler, run side by side; share i samples with seed ``(seed, i)`` (share 0 with
    ``seed``, so one sampler samples exactly as before), and the episodes come back in order.

    ``envs_from`` is a task config (in-process environments from its ``make_env()``), a
    factory ``make_env(episode_id)`` such as ``environments.remote.EnvFactory``, or an agent's
    task (``episode_source``), whose episodes the agent plays through rollout sessions
    (``tasks.agent_episodes``).
    """
    agent = envs_from if isinstance(envs_from, AgentTask) else None
    in_worker = plays_in_worker(envs_from, policy, chat)
    make_env = envs_from if callable(envs_from) else (lambda _id: envs_from.make_env())
    shares = _split(list(range(len(rows))), len(policy.samplers))

    def run_share(index: int) -> list[Trajectory]:
        groups = shares[index]
        group_ids = [g for g in groups for _ in range(group_size)]
        ids = [f"{id_prefix}-{g}-{k % group_size}" for k, g in enumerate(group_ids)]
        share_seed = seed if index == 0 else derived_seed(seed, index)
        episode_rows = [rows[g] for g in group_ids]
        if in_worker:
            batch = EpisodeBatch(
                envs_from.spec["name"],
                envs_from.spec["params"],
                envs_from.step_timeout_s,
                episode_rows,
                group_ids,
                ids,
                chat.source,
                limits,
                share_seed,
            )
            return policy.play_episodes(batch)
        episode_sampler = SeededSampler(sampler(policy, index), share_seed)
        if agent is not None:
            return run_agent_episodes(
                agent, episode_rows, group_ids, episode_sampler, chat, limits, ids
            )
        envs = [make_env(episode_id) for episode_id in ids]
        return run_episodes(envs, episode_rows, group_ids, episode_sampler, chat, limits, ids)

    try:
        if len(shares) == 1 or policy.local:  # in-process samplers share torch's global RNG
            return [t for index in range(len(shares)) for t in run_share(index)]
        with ThreadPoolExecutor(len(shares), thread_name_prefix="sampler-share") as pool:
            return [t for share in pool.map(run_share, range(len(shares))) for t in share]
    finally:
        close = getattr(make_env, "close", None)
        if close is not None:
            close()


def plays_in_worker(envs_from: Any, policy: PolicyRef, chat: HFChatFormat) -> bool:
    """Whether ``run_group_episodes`` hands the episodes to the policy's own process
    (``backends.engines.episodes``): in-process environments (``env.mode: local``) of a policy whose
    sampler's process plays them (``PolicyRef.play_episodes``: a colocated policy), with a
    chat format that process can build. Elsewhere this process plays them: remote
    environments, agents' sessions, samplers of their own or on a shared worker."""
    return (
        policy.colocated
        and isinstance(envs_from, EnvFactory)
        and envs_from.mode == "local"
        and chat.source is not None
    )


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in at most ``parts`` contiguous, non-empty shares of near-equal size."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def episode_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Means of the numeric ``info`` fields environments report (e.g. ``invalid_moves``,
    ``tool_calls``, ``win``) as ``<prefix>/<field>``, and each stop reason's share."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajectories:
        for key, value in t.info.items():
            if isinstance(value, bool | int | float):
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
        reason = f"stop_{t.stop_reason.value if t.stop_reason else 'none'}"
        sums[reason] = sums.get(reason, 0.0) + 1.0
    n = max(len(trajectories), 1)
    return {f"{prefix}/{k}": v / (counts.get(k) or n) for k, v in sorted(sums.items())}


def episode_succeeded(rule: str, reward: float, info: dict[str, Any]) -> bool:
    """Whether an episode with return ``reward`` and final ``info`` is a success under ``rule``
    (``env.success``): ``auto`` (``info["correct"]`` when reported, else ``reward > 0``),
    ``info.<key>`` (truthy), ``reward>=X`` or ``reward>X``."""
    rule = rule.replace(" ", "")
    if rule == "auto":
        return bool(info.get("correct", reward > 0))
    if rule.startswith("info."):
        return bool(info.get(rule[len("info.") :], False))
    if rule.startswith("reward>="):
        return reward >= float(rule[len("reward>=") :])
    if rule.startswith("reward>"):
        return reward > float(rule[len("reward>") :])
    raise ValueError(f"unknown success rule {rule!r}")


def episode_accuracy(trajectories: list[Trajectory], success: str = "auto") -> float:
    """Fraction of episodes that succeeded under the ``success`` rule (``episode_succeeded``)."""
    if not trajectories:
        return 0.0
    ok = [episode_succeeded(success, t.reward, t.info) for t in trajectories]
    return sum(ok) / len(ok)


def evaluate_policy(
    task_cfg: Any,
    policy: PolicyRef,
    chat: HFChatFormat,
    limits: LoopLimits,
    make_env: Callable[[str], Environment] | None = None,
    success: str = "auto",
    rows: list[dict[str, Any]] | None = None,
) -> EvalResult:
    """Episodes over the environment's fixed held-out set, or ``rows`` of it (in-process envs
    by default); ``limits`` are greedy ones for an evaluation (``rollout.limits(greedy=True)``)."""
    start = time.perf_counter()
    rows = task_cfg.eval_set() if rows is None else rows
    trajectories = run_group_episodes(
        make_env or task_cfg, rows, 1, policy, chat, limits, seed=0, id_prefix="eval"
    )
    ok = [t for t in trajectories if not t.failed]
    return EvalResult(
        accuracy=episode_accuracy(ok, success) * len(ok) / max(len(trajectories), 1),
        reward_mean=sum(t.reward for t in ok) / max(len(ok), 1),
        num_episodes=len(trajectories),
        num_failed=len(trajectories) - len(ok),
        seconds=time.perf_counter() - start,
        env_metrics=episode_metrics(trajectories, "env"),
    )
