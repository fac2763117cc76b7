"""The same rl-train flow, unchanged, with storage on an S3 endpoint (moto_server on loopback):
the model, checkpoints and results land there, and a resubmitted job resumes from there."""

from __future__ import annotations

import pytest

from infra.config import load_config

pytestmark = pytest.mark.e2e


def _job(steps: int):
    return load_config(
        None,
        [
            "name=s3-job",
            "warmup.enabled=false",
            f"schedule.steps={steps}",
            "schedule.checkpoint_every=2",
            "schedule.eval_every=100",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
        ],
    )


def test_checkpoints_land_on_s3_and_the_job_resumes_from_there(
    prefect_api, flowrl_home, moto_s3, monkeypatch
):
    import s3fs

    from flows.rl import rl_train
    from infra.tracking import client

    monkeypatch.setenv("FLOWRL_STORAGE_URL", f"{moto_s3.url}/flowrl")
    first = rl_train(_job(steps=3))
    assert first.resumed_from is None and first.steps == 3

    s3 = s3fs.S3FileSystem(skip_instance_cache=True)
    keys = {k.split("/flowrl/", 1)[1] for k in s3.find(f"{moto_s3.bucket}/flowrl")}
    assert "jobs/s3-job/checkpoints/LATEST.json" in keys
    assert "jobs/s3-job/checkpoints/step-00000003/manifest.json" in keys
    assert "jobs/s3-job/checkpoints/step-00000003/weights.safetensors" in keys
    assert "jobs/s3-job/result.json" in keys
    assert any(k.startswith("models/tiny-") and k.endswith("config.json") for k in keys)
    assert not (flowrl_home / "storage" / "jobs" / "s3-job").exists()  # nothing written locally

    second = rl_train(_job(steps=5))
    assert second.resumed_from == 3  # restored from the S3 checkpoint, steps 1-3 not redone
    assert second.steps == 5
    assert second.mlflow_run_id == first.mlflow_run_id  # the same MLflow run continues
    history = client().get_metric_history(second.mlflow_run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert s3.exists(f"{moto_s3.bucket}/flowrl/jobs/s3-job/checkpoints/step-00000005/manifest.json")
