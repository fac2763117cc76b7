"""Batch inference with a registered model, through the training environment and agent loop.

The same environment, chat format and agent loop that produced the training episodes drive
the trained model here (no code changes between training and inference): prompts come from
the environment's held-out set or its data stream, the model runs in the same sampler actor,
and the episodes (messages, token counts, rewards) are written as JSONL under the job's storage
prefix; reward and accuracy go to MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from flowrl.flows.lifecycle import JobRun, resumable, task_runner
from flowrl.flows.run_page import job_run_name
from flowrl.infra import tracking
from flowrl.tasks.inference import infer
from flowrl.tasks.model import prepare_model
from flowrl.tasks.schemas import InferenceJobConfig


@dataclass(frozen=True)
class InferenceResult:
    job: str
    trajectories_uri: str
    """JSONL, one episode per line: messages, reward, correct, tokens, stop reason."""
    num_episodes: int
    accuracy: float
    reward_mean: float
    mlflow_run_id: str


@flow(
    name="batch-inference",
    task_runner=task_runner(),
    log_prints=True,
    flow_run_name=job_run_name(InferenceJobConfig),
)
@resumable
def batch_inference(config: InferenceJobConfig = InferenceJobConfig()) -> InferenceResult:  # noqa: B008
    with JobRun(config) as job:
        # An alias pinned (moving it mid-job changes nothing); ``tiny`` built once, as jobs do.
        model_uri = prepare_model.submit(config, job.ctx).result()
        job.say(f"model: {config.model.source} is {model_uri}")
        policy = job.start_model(model_uri)  # resources.placement: own workers, or shared
        with job.phase("inference", f"{config.num_prompts} prompts") as phase:
            out = infer.submit(config, job.ctx, model_uri, policy).result()
            phase.result = (
                f"{out.num_episodes} episodes, accuracy {out.accuracy:.3f}, "
                f"reward {out.reward_mean:.3f}; written to {out.uri}"
            )
        job.log(out.metrics, step=0)
        tracking.set_tags(job.run_id, {"flowrl.inference.trajectories": out.uri})
        result = InferenceResult(
            job=config.name,
            trajectories_uri=out.uri,
            num_episodes=out.num_episodes,
            accuracy=out.accuracy,
            reward_mean=out.reward_mean,
            mlflow_run_id=job.run_id,
        )
        job.finish(result, table=tuple(sorted(out.metrics)))
    return result
