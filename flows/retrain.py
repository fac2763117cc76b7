"""Scheduled retraining: train a challenger from the registry's champion, promote only if better.

1. resolve ``models:/<name>@champion`` (no champion yet: train from ``job.model.source`` and
   promote the first version — recorded as ``bootstrap``);
2. train a challenger with the ``rl-train`` flow as a subflow (``model.source`` =
   ``models:/<name>@champion``, a fresh job name and seed, so new data and no resume);
3. evaluate champion and challenger with the same code on the same held-out set, each on
   workers started under the round's GPU slots (the round's ``JobRun``, entered after training
   so that it never holds slots while its subflow waits for its own);
4. move the alias to the challenger only if it beats the champion by ``min_improvement``.

Every decision is recorded on the round's MLflow run (the gate's config as params, the decision
as tags, both accuracies as metrics), in ``jobs/<job.name>-retrain/job.json`` and
``result.json``, on the challenger's model version (tags) and as a Prefect markdown artifact.
Deployed on a cron schedule (``prefect.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from flowrl.agent_loop.seeding import derived_seed
from flowrl.backends.policy.actors import stop_policy
from flowrl.flows.lifecycle import JobRun, task_runner
from flowrl.flows.rl import rl_train
from flowrl.flows.run_page import job_run_name
from flowrl.infra import tracking
from flowrl.infra.settings import get_settings
from flowrl.tasks.evaluate import EvalSpec, score_model
from flowrl.tasks.schemas import RetrainConfig, RLJobConfig


@dataclass(frozen=True)
class RetrainDecision:
    model_name: str
    champion_version: str | None
    challenger_version: str
    champion_accuracy: float | None
    challenger_accuracy: float
    decision: str
    """``promoted``, ``kept`` (champion unchanged) or ``bootstrap`` (first champion)."""
    mlflow_run_id: str


def should_promote(champion: float | None, challenger: float, min_improvement: float) -> bool:
    """The gate: strictly better than the champion by more than ``min_improvement``."""
    return champion is None or challenger > champion + min_improvement


def challenger_job(
    config: RetrainConfig, round_id: str, champion: str | None, namespace: str | None
) -> RLJobConfig:
    job = config.job
    champion_uri = f"models:/{job.registered_model_name(namespace)}@{config.alias}"
    source = champion_uri if champion else job.model.source
    return job.model_copy(
        update={
            "name": f"{job.name[:48]}-{round_id}",
            "seed": derived_seed(job.seed, round_id) % 2**31,
            "model": job.model.model_copy(update={"source": source}),
            "register_as": job.model_name,
        }
    )


@flow(
    name="retrain",
    task_runner=task_runner(),
    log_prints=True,
    flow_run_name=job_run_name(RetrainConfig),
)
def retrain(config: RetrainConfig = RetrainConfig()) -> RetrainDecision:  # noqa: B008
    settings = get_settings()
    settings.apply_to_environment()
    logger = get_run_logger()
    name = config.job.registered_model_name(settings.namespace)
    round_id = (flow_run.get_id() or "local0000")[:8]
    champion = tracking.alias_version(name, config.alias)
    challenger_cfg = challenger_job(config, round_id, champion, settings.namespace)
    origin = f"from {name}@{config.alias} (version {champion})" if champion else "(no champion)"
    logger.info("challenger: training job %s %s", challenger_cfg.name, origin)
    trained = rl_train(challenger_cfg)  # holds its own GPU slots
    challenger = trained.model_uri.rsplit("/", 1)[1]
    with JobRun(config) as job:
        champion_uri = f"models:/{name}/{champion}"
        with job.phase("evaluation", "champion and challenger on the held-out set") as phase:
            champ_acc = accuracy(job, config.job, champion_uri, "champion") if champion else None
            chall_acc = accuracy(job, config.job, trained.model_uri, "challenger")
            champ = "none" if champ_acc is None else f"{champ_acc:.3f}"
            phase.result = f"champion {champ}, challenger {chall_acc:.3f}"
        promote = should_promote(champ_acc, chall_acc, config.min_improvement)
        decision = ("promoted" if champion else "bootstrap") if promote else "kept"
        if promote:
            tracking.set_alias(name, config.alias, challenger)
        d = RetrainDecision(name, champion, challenger, champ_acc, chall_acc, decision, job.run_id)
        record_decision(config, job, d)
        kept = d.challenger_version if d.decision != "kept" else d.champion_version
        job.say(f"decision: {decision}; {name}@{config.alias} is version {kept}")
        job.finish(d, table=("retrain/champion_accuracy", "retrain/challenger_accuracy"))
    return d


def accuracy(job: JobRun, template: RLJobConfig, model_uri: str, role: str) -> float:
    """Greedy held-out accuracy of a registered model on ``template``'s environment: the
    ``evaluate`` job's scoring (``score_model``, greedy only), on workers started for it under
    the round's GPU slots and stopped before the next model's start."""
    spec = EvalSpec(template.env, template.model, template.rollout, seed=template.seed)
    policy = job.start_policy(model_uri, f"{job.ctx.run_name}-{role}")
    try:
        return score_model.submit(spec, job.ctx, model_uri, policy).result().greedy_accuracy
    finally:
        stop_policy(policy)


def record_decision(config: RetrainConfig, job: JobRun, d: RetrainDecision) -> None:
    """The round's MLflow run (decision tags, accuracies), the challenger version's tags, and
    the Prefect markdown artifact; the params are the round's config, written by ``JobRun``."""
    tags = {
        "flowrl.retrain.decision": d.decision,
        "flowrl.retrain.champion_version": str(d.champion_version),
        "flowrl.retrain.challenger_version": d.challenger_version,
        "flowrl.retrain.min_improvement": str(config.min_improvement),
    }
    tracking.set_tags(job.run_id, tags)
    metrics = {"retrain/challenger_accuracy": d.challenger_accuracy}
    if d.champion_accuracy is not None:
        metrics["retrain/champion_accuracy"] = d.champion_accuracy
    job.log(metrics, step=0)
    c = tracking.client()
    for key, value in tags.items():
        c.set_model_version_tag(d.model_name, d.challenger_version, key, value)
    champ = "none" if d.champion_accuracy is None else f"{d.champion_accuracy:.3f}"
    create_markdown_artifact(
        key="retrain-decision",
        description=f"Retraining decision for {d.model_name}",
        markdown=(
            f"## Retraining `{d.model_name}`: **{d.decision}**\n\n"
            f"| | version | held-out accuracy |\n|---|---|---|\n"
            f"| champion | {d.champion_version} | {champ} |\n"
            f"| challenger | {d.challenger_version} | {d.challenger_accuracy:.3f} |\n\n"
            f"Gate: challenger > champion + {config.min_improvement}. "
            f"Alias `{config.alias}` → version "
            f"{d.challenger_version if d.decision != 'kept' else d.champion_version}."
        ),
    )
