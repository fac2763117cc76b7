"""Scheduled retraining: the champion alias moves only when the challenger is better on the
same held-out set, and every decision is recorded in MLflow and as a Prefect artifact."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest

from flowrl.flows.retrain import should_promote
from flowrl.tasks.schemas import load_job

pytestmark = pytest.mark.e2e
MODEL = "retrain-model"


def test_the_gate():
    assert should_promote(None, 0.0, 0.0)  # no champion yet
    assert should_promote(0.2, 0.3, 0.05)
    assert not should_promote(0.3, 0.3, 0.0)  # equal is not better
    assert not should_promote(0.3, 0.32, 0.05)


def _round(overrides: list[str], min_improvement: float = 0.0):
    from flowrl.flows.retrain import retrain
    from flowrl.tasks.schemas import RetrainConfig

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


def _count_mlflow_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """Every param and tag this process writes to an MLflow run, as (run id, kind, key)."""
    from mlflow.tracking import MlflowClient

    writes: list[tuple[str, str, str]] = []
    batch, set_tag, log_param = MlflowClient.log_batch, MlflowClient.set_tag, MlflowClient.log_param

    def log_batch_spy(self, *args, **kwargs):
        given = inspect.signature(batch).bind(self, *args, **kwargs).arguments
        writes.extend((given["run_id"], "param", p.key) for p in given.get("params") or ())
        writes.extend((given["run_id"], "tag", t.key) for t in given.get("tags") or ())
        return batch(self, *args, **kwargs)

    def set_tag_spy(self, run_id, key, *args, **kwargs):
        writes.append((run_id, "tag", key))
        return set_tag(self, run_id, key, *args, **kwargs)

    def log_param_spy(self, run_id, key, *args, **kwargs):
        writes.append((run_id, "param", key))
        return log_param(self, run_id, key, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch_spy)
    monkeypatch.setattr(MlflowClient, "set_tag", set_tag_spy)
    monkeypatch.setattr(MlflowClient, "log_param", log_param_spy)
    return writes


def test_better_challenger_is_promoted_worse_one_is_not(prefect_api, flowrl_home, monkeypatch):
    from prefect import get_client

    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage
    from flowrl.infra.tracking import client

    writes = _count_mlflow_writes(monkeypatch)

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
    # The round's run: its config as params, the decision as tags, each written once.
    assert run.data.params["alias"] == "champion" and run.data.params["min_improvement"] == "0.0"
    assert run.data.params["job.name"] == MODEL
    assert not any(k.startswith("flowrl.retrain.") for k in run.data.params)
    written = Counter((kind, key) for r, kind, key in writes if r == worse.mlflow_run_id)
    assert written[("tag", "flowrl.retrain.decision")] == written[("param", "alias")] == 1
    assert all(n == 1 for n in written.values()), written
    # Like every job: job.json and result.json beside the job's files.
    storage = Storage(get_settings().storage_root)
    job = storage.read_json(f"jobs/{MODEL}-retrain/job.json")
    assert job["mlflow_run_id"] == worse.mlflow_run_id and job["config"]["alias"] == "champion"
    result = storage.read_json(f"jobs/{MODEL}-retrain/result.json")
    assert result["decision"] == "kept" and result["challenger_version"] == worse.challenger_version
    assert run.info.status == "FINISHED"

    async def artifact():
        async with get_client() as pc:
            return await pc.read_latest_artifacts()

    import asyncio

    latest = [a for a in asyncio.run(artifact()) if a.key == "retrain-decision"]
    assert latest and "**kept**" in latest[0].data
