"""Batch inference with a registered model, through the training environment and agent loop.

The same environment, chat format and agent loop that produced the training episodes drive
the trained model here (no code changes between training and inference): prompts come from
the environment's held-out set or its data stream, the model runs in the same sampler actor,
and the episodes (messages, token counts, rewards) are written as JSONL under the job's storage
prefix; reward and accuracy go to MLflow.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from backends.actors import ActorResources, PolicyRef, start_policy, stop_policy
from backends.types import WorkerSpec
from flows.common import task_runner
from infra import tracking
from infra.config import EnvSection, ResourcesSection, RolloutSection
from infra.scheduler import gpu_slots
from infra.settings import get_settings
from infra.storage import Storage
from tasks.common import chat_format, episode_accuracy, episode_metrics, run_group_episodes
from tasks.rl import loop_limits
from tasks.types import JobContext


class InferenceJobConfig(BaseModel):
    """A batch-inference job: a registered model + an environment → scored episodes (JSONL)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        default="inference-demo",
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Job name: storage prefix (jobs/<name>/inference/) and MLflow run name.",
    )
    model: str = Field(
        default="models:/arithmetic-demo@champion",
        description="Model URI: models:/name@alias, models:/name/version, s3://… or a folder.",
    )
    env: EnvSection = Field(default_factory=EnvSection, description="Environment.")
    data: Literal["eval", "stream"] = Field(
        default="eval", description="Prompts: the held-out set, or the environment's data stream."
    )
    num_prompts: int = Field(default=64, ge=1, description="Prompts to run (at most the set).")
    samples_per_prompt: int = Field(default=1, ge=1, description="Episodes per prompt.")
    rollout: RolloutSection = Field(
        default_factory=lambda: RolloutSection(temperature=1.0),
        description="Sampling limits (temperature, tokens, turns) as in training.",
    )
    greedy: bool = Field(default=True, description="Greedy decoding (ignores temperature).")
    seed: int = Field(default=0, description="Seed of sampling and of the data stream order.")
    resources: ResourcesSection = Field(default_factory=ResourcesSection, description="Workers.")
    experiment: str = Field(default="flowrl-inference", min_length=1, description="MLflow exp.")


@dataclass(frozen=True)
class InferenceResult:
    job: str
    trajectories_uri: str
    """JSONL, one episode per line: messages, reward, correct, tokens, stop reason."""
    num_episodes: int
    accuracy: float
    reward_mean: float
    mlflow_run_id: str


@task(name="infer", cache_policy=NO_CACHE)
def infer(config: InferenceJobConfig, ctx: JobContext, policy: PolicyRef) -> dict:
    """Run the episodes, write them as JSONL; returns the metrics and where the file is."""
    task_cfg = config.env.task()
    if config.data == "eval":
        rows = task_cfg.eval_set()[: config.num_prompts]
    else:
        rows = task_cfg.train_source().next_batch(config.num_prompts)
    limits = loop_limits(config)  # reads only the rollout section
    if config.greedy:
        limits = type(limits)(**{**asdict(limits), "temperature": 0.0})
    chat = chat_format(config.model, ctx.cache_dir)
    trajectories = run_group_episodes(
        task_cfg, rows, config.samples_per_prompt, policy, chat, limits, config.seed, "inf"
    )
    lines = [
        json.dumps(
            {
                "episode_id": t.episode_id,
                "group_id": t.group_id,
                "messages": t.messages,
                "reward": t.reward,
                "correct": bool(t.info.get("correct", t.reward > 0)),
                "failed": t.failed,
                "sampled_tokens": t.num_sampled_tokens,
                "stop_reason": t.stop_reason.value if t.stop_reason else None,
            }
        )
        for t in trajectories
    ]
    rel = f"{ctx.prefix}/inference/trajectories.jsonl"
    storage = Storage(ctx.storage_url)
    storage.write_bytes(rel, ("\n".join(lines) + "\n").encode())
    ok = [t for t in trajectories if not t.failed]
    metrics = {
        "inference/accuracy": episode_accuracy(ok) * len(ok) / max(len(trajectories), 1),
        "inference/reward_mean": sum(t.reward for t in ok) / max(len(ok), 1),
        "inference/episodes": float(len(trajectories)),
        "inference/failed": float(len(trajectories) - len(ok)),
        **episode_metrics(trajectories, "inference/env"),
    }
    return {"uri": storage.uri(rel), "metrics": metrics}


@flow(name="batch-inference", task_runner=task_runner(), log_prints=True)
def batch_inference(config: InferenceJobConfig = InferenceJobConfig()) -> InferenceResult:  # noqa: B008
    settings = get_settings()
    settings.apply_to_environment()
    ctx = JobContext(
        name=config.name,
        storage_url=settings.storage_root,
        cache_dir=settings.model_cache_dir,
        run_name=f"{config.name}-{(flow_run.get_id() or 'local')[:8]}",
    )
    with gpu_slots(config.resources.gpus):
        run_id = tracking.start_run(config.experiment, config.name, config.model_dump())
        spec = WorkerSpec(model_uri=config.model, cache_dir=ctx.cache_dir, seed=config.seed)
        gpus = config.resources.gpus_per_worker or config.resources.gpus / 2
        policy = start_policy(ctx.run_name, spec, ActorResources(num_cpus=1, num_gpus=gpus))
        try:
            out = infer.submit(config, ctx, policy).result()
        except BaseException:
            tracking.end_run(run_id, status="FAILED")
            raise
        finally:
            stop_policy(policy)
    tracking.log_metrics(run_id, out["metrics"], step=0)
    tracking.client().set_tag(run_id, "flowrl.inference.trajectories", out["uri"])
    tracking.end_run(run_id)
    m = out["metrics"]
    result = InferenceResult(
        job=config.name,
        trajectories_uri=out["uri"],
        num_episodes=int(m["inference/episodes"]),
        accuracy=m["inference/accuracy"],
        reward_mean=m["inference/reward_mean"],
        mlflow_run_id=run_id,
    )
    Storage(ctx.storage_url).write_json(f"{ctx.prefix}/result.json", asdict(result))
    return result
