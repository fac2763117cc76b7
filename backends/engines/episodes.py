"""Episodes played in the policy's own process: a batch of in-process environments' episodes
(``env.mode: local``) run by the agent loop next to the sampler that answers them, so that the
job's process only hands over the rows and takes the trajectories back (``PolicyRef.
play_episodes``; ``tasks.episodes.run_group_episodes`` decides where episodes are played).

The episodes are the ones the job's process would play: the same environments (built from the
same name and params, each call under the same ``env.step_timeout_s``), the same chat format
(``ChatSource``), the same seeds (call k of the batch samples with ``(seed, k)``), so a job
samples the same tokens wherever they are played. What an environment shares between episodes
lives in the worker's process for the worker's life, not in the job's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.seeding import SeededSampler
from flowrl.agent_loop.types import Trajectory
from flowrl.backends.models.chat import ChatSource, chat_format_of
from flowrl.environments.remote import EnvFactory


@dataclass(frozen=True)
class EpisodeBatch:
    """One batch of episodes, as small data: the environment (registered name or
    ``pkg.mod:Class``, its params and each call's timeout), one row, group and id per
    episode, the chat format, the loop's limits and the batch's base seed."""

    env: str
    params: dict[str, Any]
    step_timeout_s: float
    rows: list[dict[str, Any]]
    group_ids: list[int]
    episode_ids: list[str]
    chat: ChatSource
    limits: LoopLimits
    seed: int


def play(batch: EpisodeBatch, sampler: Any) -> list[Trajectory]:
    """Play ``batch`` with ``sampler`` (a backend's ``sample``, seeded per call here); the
    trajectories in the batch's order."""
    make_env = _envs(json.dumps([batch.env, batch.params], sort_keys=True), batch.step_timeout_s)
    envs = [make_env(episode_id) for episode_id in batch.episode_ids]
    return run_episodes(
        envs,
        batch.rows,
        batch.group_ids,
        SeededSampler(sampler, batch.seed),
        chat_format_of(batch.chat),
        batch.limits,
        batch.episode_ids,
    )


@lru_cache(maxsize=4)
def _envs(spec: str, step_timeout_s: float) -> EnvFactory:
    """The environments' factory, its class loaded and params validated once per process."""
    name, params = json.loads(spec)
    return EnvFactory(name, params, mode="local", step_timeout_s=step_timeout_s)
