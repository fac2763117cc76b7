"""The batch-inference stage: a registered model plays the environment's episodes, written as
JSONL under the job's storage prefix."""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.agent_loop.types import Trajectory
from flowrl.backends.policy.actors import PolicyRef
from flowrl.infra.storage import Storage
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.episodes import (
    episode_accuracy,
    episode_metrics,
    episode_source,
    episode_succeeded,
    run_group_episodes,
)
from flowrl.tasks.schemas import InferenceJobConfig
from flowrl.tasks.types import InferenceOutput, JobContext


def _episode_line(t: Trajectory, success: str) -> str:
    return json.dumps(
        {
            "episode_id": t.episode_id,
            "group_id": t.group_id,
            "messages": t.messages,
            "reward": t.reward,
            "correct": episode_succeeded(success, t.reward, t.info),
            "failed": t.failed,
            "sampled_tokens": t.num_sampled_tokens,
            "stop_reason": t.stop_reason.value if t.stop_reason else None,
        }
    )


@task(name="infer", cache_policy=NO_CACHE)
def infer(
    config: InferenceJobConfig, ctx: JobContext, model_uri: str, policy: PolicyRef
) -> InferenceOutput:
    """Run the episodes where ``env.mode`` says (in this process, on the job's environment
    actors, or on the environment service), as rollouts do; write them as JSONL (one episode
    per line: messages, reward, correct, tokens, stop reason); returns where the file is and
    the metrics."""
    task_cfg = config.env.task(config.seed)
    if config.data == "eval":
        rows = task_cfg.eval_set()[: config.num_prompts]
    else:
        rows = task_cfg.train_source().next_batch(config.num_prompts)
    chat = chat_format(model_uri, ctx.cache_dir, config.model)
    limits = config.rollout.limits(greedy=config.greedy)
    trajectories = run_group_episodes(
        episode_source(config.env, ctx.run_name),
        rows,
        config.samples_per_prompt,
        policy,
        chat,
        limits,
        config.seed,
        "inf",
    )
    rel = f"{ctx.prefix}/inference/trajectories.jsonl"
    storage = Storage(ctx.storage_url)
    lines = "".join(_episode_line(t, config.env.success) + "\n" for t in trajectories)
    storage.write_bytes(rel, lines.encode())
    ok = [t for t in trajectories if not t.failed]
    accuracy = episode_accuracy(ok, config.env.success) * len(ok) / max(len(trajectories), 1)
    reward_mean = sum(t.reward for t in ok) / max(len(ok), 1)
    metrics = {
        "inference/accuracy": accuracy,
        "inference/reward_mean": reward_mean,
        "inference/episodes": float(len(trajectories)),
        "inference/failed": float(len(trajectories) - len(ok)),
        **episode_metrics(trajectories, "inference/env"),
    }
    return InferenceOutput(storage.uri(rel), accuracy, reward_mean, len(trajectories), metrics)
