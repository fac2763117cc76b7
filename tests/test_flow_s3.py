"""The same rl-train flow, unchanged, with storage on an S3 endpoint (moto_server on loopback):
the model, checkpoints and results land there, an endpoint outage of 20 s in the middle of a
checkpoint commit is ridden out, and a resubmitted job resumes from there."""

from __future__ import annotations

import pytest
from faults import OutageProxy

from flowrl.tasks.schemas import load_job

OUTAGE_S = 20.0

pytestmark = pytest.mark.e2e


def _job(steps: int):
    return load_job(
        None,
        [
            "name=s3-job",
            "warmup.enabled=false",
            f"schedule.steps={steps}",
            "schedule.checkpoint_every=1",
            "schedule.keep_checkpoints=5",
            "schedule.eval_every=100",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
        ],
    )


def test_s3_outage_mid_checkpoint_is_ridden_out_and_the_job_resumes_from_s3(
    prefect_api, flowrl_home, moto_s3, monkeypatch
):
    """The endpoint goes down for 20 s just as checkpoint 2 is being committed: its weights are
    written, its manifest is not. Writes retry, the run completes, the partial checkpoint is
    never taken, and a resubmission resumes from the last complete one."""
    import s3fs

    from flowrl.flows.rl import rl_train
    from flowrl.infra.storage import Storage, latest_checkpoint, load_checkpoint
    from flowrl.infra.tracking import client

    direct = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=moto_s3.endpoint_url)
    ckpt = f"{moto_s3.bucket}/flowrl/jobs/s3-job/checkpoints"
    seen_during_outage: dict = {}

    def look_while_down() -> None:  # straight at moto, behind the proxy's back
        seen_during_outage["files"] = sorted(
            p.rsplit("/", 1)[1] for p in direct.find(f"{ckpt}/step-00000002")
        )
        seen_during_outage["latest"] = latest_checkpoint(
            Storage(f"{moto_s3.url}/flowrl", {"endpoint_url": moto_s3.endpoint_url}),
            "jobs/s3-job/checkpoints",
        )

    upstream = (moto_s3.server.host, moto_s3.server.port)
    trigger = "checkpoints/step-00000002/manifest.json"
    with OutageProxy(upstream, trigger, OUTAGE_S, on_down=look_while_down) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
        monkeypatch.setenv("FLOWRL_STORAGE_URL", f"{moto_s3.url}/flowrl")
        first = rl_train(_job(steps=3))
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)

    assert first.resumed_from is None and first.steps == 3
    # The outage happened mid-commit and lasted its 20 s ...
    assert proxy.outage is not None and proxy.outage[1] - proxy.outage[0] >= OUTAGE_S
    assert "weights.safetensors" in seen_during_outage["files"]
    assert "manifest.json" not in seen_during_outage["files"], seen_during_outage
    assert seen_during_outage["latest"] == 1  # the half-written step 2 is not taken
    # ... and the manifest write was retried after it, then the rest of the job went on.
    manifest_puts = [t for t, m, p in proxy.requests if m == "PUT" and p.endswith(trigger)]
    assert len(manifest_puts) >= 2 and manifest_puts[-1] >= proxy.outage[1]

    s3 = s3fs.S3FileSystem(skip_instance_cache=True)
    keys = {k.split("/flowrl/", 1)[1] for k in s3.find(f"{moto_s3.bucket}/flowrl")}
    assert "jobs/s3-job/checkpoints/LATEST.json" in keys
    assert "jobs/s3-job/checkpoints/step-00000003/manifest.json" in keys
    assert "jobs/s3-job/checkpoints/step-00000003/weights.safetensors" in keys
    assert "jobs/s3-job/result.json" in keys
    assert any(k.startswith("models/tiny-") and k.endswith("config.json") for k in keys)
    assert not (flowrl_home / "storage" / "jobs" / "s3-job").exists()  # nothing written locally
    storage = Storage(f"{moto_s3.url}/flowrl")
    for step in (1, 2, 3):  # every checkpoint left behind is complete: sizes and sha256 match
        load_checkpoint(storage, "jobs/s3-job/checkpoints", step)

    second = rl_train(_job(steps=5))
    assert second.resumed_from == 3  # restored from the S3 checkpoint, steps 1-3 not redone
    assert second.steps == 5
    assert second.mlflow_run_id == first.mlflow_run_id  # the same MLflow run continues
    history = client().get_metric_history(second.mlflow_run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert s3.exists(f"{moto_s3.bucket}/flowrl/jobs/s3-job/checkpoints/step-00000005/manifest.json")
