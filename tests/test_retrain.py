"""Scheduled retraining: the champion alias moves only when the challenger is better on the
same held-out set, and every decision is recorded in MLflow and as a Prefect artifact."""

from __future__ import annotations

import pytest

from flowrl.flows.retrain import should_promote
from flowrl.tasks.jobs import load_job

pytestmark = pytest.mark.e2e
MODEL = "retrain-model"


def test_the_gate():
    assert should_promote(None, 0.0, 0.0)  # no champion yet
    assert should_promote(0.2, 0.3, 0.05)
    assert not should_promote(0.3, 0.3, 0.0)  # equal is not better
    assert not should_promote(0.3, 0.32, 0.05)


def _round(overrides: list[str], min_improvement: float = 0.0):
    from flowrl.flows.retrain import retrain
    from flowrl.tasks.jobs import RetrainConfig

    job = load_job(
        None,
        [
            f"name={MODEL}",
            "schedule.steps=1",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            "env.params.eval_size=40",
            *overrides,
        ],
    )
    return retrain(RetrainConfig(job=job, min_improvement=min_improvement))


def _alias() -> str:
    from flowrl.infra.tracking import client

    return str(client().get_model_version_by_alias(MODEL, "champion").version)


def test_better_challenger_is_promoted_worse_one_is_not(prefect_api, flowrl_home):
    from prefect import get_client

    from flowrl.infra.tracking import client

    # Round 0: no champion: an untrained tiny model becomes the first champion.
    first = _round(["warmup.enabled=false"])
    assert first.decision == "bootstrap" and _alias() == first.challenger_version

    # Round 1: the challenger is warmed up (SFT) from the champion: better -> promoted.
    better = _round(["warmup.target_accuracy=0.15", "warmup.eval_every=20"])
    assert better.champion_version == first.challenger_version
    assert better.challenger_accuracy > better.champion_accuracy
    assert better.decision == "promoted" and _alias() == better.challenger_version

    # Round 2: a destructive update (lr 1.0) from the champion: worse -> champion unchanged.
    worse = _round(["warmup.enabled=false", "algorithm.learning_rate=1.0"])
    assert worse.champion_version == better.challenger_version
    assert worse.challenger_accuracy <= worse.champion_accuracy
    assert worse.decision == "kept" and _alias() == better.challenger_version

    # Recorded: MLflow run tags/metrics, model version tags, Prefect markdown artifact.
    c = client()
    run = c.get_run(worse.mlflow_run_id)
    assert run.data.tags["flowrl.retrain.decision"] == "kept"
    assert run.data.metrics["retrain/champion_accuracy"] == pytest.approx(worse.champion_accuracy)
    version = c.get_model_version(MODEL, worse.challenger_version)
    assert version.tags["flowrl.retrain.decision"] == "kept"

    async def artifact():
        async with get_client() as pc:
            return await pc.read_latest_artifacts()

    import asyncio

    latest = [a for a in asyncio.run(artifact()) if a.key == "retrain-decision"]
    assert latest and "**kept**" in latest[0].data
