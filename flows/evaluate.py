"""The evaluation job: models side by side on environments' held-out sets.

Run it as a Python call (``evaluate(EvalJobConfig(...))``), from the CLI (``flowrl eval
CONFIG.yaml``) or as the ``evaluate`` deployment (queue ``eval``). Each model's workers start
inside the job's GPU slots and stop before the next model's start. Per (model, environment):
greedy accuracy (training's own held-out evaluation), pass@k and avg@samples (unbiased), mean
reward, failed and truncated episodes. Where the results go:

- the job's MLflow run (``<model index>/<env>/<metric>``, step 0) and, per model, an MLflow run
  of its own in the job's experiment, tagged with the model (``flowrl.eval.model``) and, for a
  registered version, linked both ways (the version's tags ``flowrl.eval.<env>.<metric>`` and
  ``flowrl.eval.run_id``);
- a Prefect table artifact ``<job>-models``: one row per environment and metric, one column per
  model;
- ``result.json`` beside ``job.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow
from prefect.artifacts import create_table_artifact

from flowrl.backends.models.model_uri import check_model_source, pin_model_uri
from flowrl.backends.policy.actors import stop_policy
from flowrl.flows.lifecycle import JobRun, resumable, task_runner
from flowrl.flows.run_page import job_run_name
from flowrl.infra import tracking
from flowrl.tasks.evaluate import EvalSpec, ModelScore, score_model
from flowrl.tasks.schemas import EvalJobConfig


@dataclass(frozen=True)
class EvalResult:
    """What an evaluation job hands back: every model's scores, in the config's order."""

    job: str
    models: list[str]
    """The models as pinned (an alias resolved to its version)."""
    scores: list[list[ModelScore]]
    """``scores[m][e]``: model ``m`` on environment ``e``."""
    mlflow_run_id: str
    model_runs: list[str]
    """Each model's own MLflow run."""


def eval_spec(config: EvalJobConfig, index: int) -> EvalSpec:
    """What scoring on ``config.envs[index]`` needs."""
    return EvalSpec(
        env=config.envs[index],
        model=config.model,
        rollout=config.rollout,
        seed=config.seed,
        samples=config.samples,
        k=tuple(config.k),
        num_prompts=config.num_prompts,
    )


def resolve_models(refs: list[str]) -> list[str]:
    """Each reference pinned (``models:/name@alias`` to its version) and checked, before any
    worker starts; ``ValueError`` naming the one that does not resolve."""
    pinned = []
    for ref in refs:
        try:
            check_model_source(ref)
            pinned.append(pin_model_uri(ref))
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"models: {ref!r} does not resolve: {err}") from None
    return pinned


@flow(
    name="evaluate",
    task_runner=task_runner(),
    log_prints=True,
    flow_run_name=job_run_name(EvalJobConfig),
)
@resumable
def evaluate(config: EvalJobConfig = EvalJobConfig()) -> EvalResult:  # noqa: B008
    models = resolve_models(config.models)
    with JobRun(config) as job:
        scores: list[list[ModelScore]] = []
        for m, uri in enumerate(models):
            with job.phase(f"model {m}", uri) as phase:
                policy = job.start_policy(uri, f"{job.ctx.run_name}-m{m}")
                try:
                    row = [
                        score_model.submit(eval_spec(config, e), job.ctx, uri, policy).result()
                        for e in range(len(config.envs))
                    ]
                finally:
                    stop_policy(policy)
                scores.append(row)
                phase.result = "; ".join(_summary(s) for s in row)
        for m, row in enumerate(scores):
            job.log({k: v for s in row for k, v in s.metrics(f"{m}/{_key(s.env)}").items()}, 0)
        runs = [_model_run(config, job, uri, row) for uri, row in zip(models, scores, strict=True)]
        create_table_artifact(
            side_by_side(models, scores),
            key=f"{job.page.key}-models",
            description="models side by side: a row per environment and metric",
        )
        result = EvalResult(config.name, models, scores, job.run_id, runs)
        job.finish(result)
    return result


def side_by_side(models: list[str], scores: list[list[ModelScore]]) -> list[dict[str, object]]:
    """One row per (environment, metric), one column per model."""
    rows = []
    for e, first in enumerate(scores[0]):
        for metric in first.metrics(""):
            name = metric.lstrip("/").replace("_at_", "@")
            row: dict[str, object] = {"environment": first.env, "metric": name}
            for uri, model_scores in zip(models, scores, strict=True):
                row[uri] = round(model_scores[e].metrics("")[metric], 4)
            rows.append(row)
    return rows


def _key(env: str) -> str:
    """An environment's name as a part of an MLflow key (letters, digits, ``_-. /``)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in env)


def _summary(score: ModelScore) -> str:
    text = f"{score.env}: greedy {score.greedy_accuracy:.3f}"
    text += "".join(f", pass@{k} {v:.3f}" for k, v in sorted(score.pass_at.items()))
    if score.avg_at is not None:
        text += f", avg@{score.samples} {score.avg_at:.3f}"
    return text


def _model_run(config: EvalJobConfig, job: JobRun, uri: str, row: list[ModelScore]) -> str:
    """The model's own MLflow run in the job's experiment, and the registered version's tags
    pointing at it."""
    params = {"model": uri, "job": config.name, "samples": config.samples, "k": config.k}
    run_id = tracking.start_run(
        config.experiment, f"{job.ctx.run_name}-{uri}", params, namespace=job.ctx.namespace
    )
    metrics = {k: v for s in row for k, v in s.metrics(_key(s.env)).items()}
    tracking.log_metrics(run_id, metrics, step=0)
    tracking.set_tags(run_id, {"flowrl.eval.model": uri, "flowrl.eval.job_run": job.run_id})
    if uri.startswith("models:/"):
        name, _, version = uri.removeprefix("models:/").rpartition("/")
        client = tracking.client()
        client.set_model_version_tag(name, version, "flowrl.eval.run_id", run_id)
        for key, value in metrics.items():
            tag = f"flowrl.eval.{key.replace('/', '.')}"
            client.set_model_version_tag(name, version, tag, f"{value:.4f}")
    tracking.end_run(run_id)
    return run_id
