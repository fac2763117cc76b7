"""A training process killed with SIGKILL mid-run, resubmitted with the same job name, resumes
from its last complete checkpoint on S3 (moto): earlier steps are not redone, and the job ends
with a registered model version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
STEPS = 12
ARGS = [
    "name=kill-job",
    "warmup.enabled=false",
    f"schedule.steps={STEPS}",
    "schedule.checkpoint_every=2",
    "schedule.eval_every=100",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "env.params.eval_size=20",
]


def _train(env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flowrl", "train"]
    for a in ARGS:
        cmd += ["--set", a]
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_sigkilled_job_resumes_from_its_last_checkpoint(
    prefect_api, flowrl_home, moto_s3, monkeypatch, tmp_path
):
    import s3fs
    from prefect.settings import PREFECT_API_URL

    from flowrl.infra.tracking import client

    storage = f"{moto_s3.url}/flowrl"
    monkeypatch.setenv("FLOWRL_STORAGE_URL", storage)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    latest = f"{moto_s3.bucket}/flowrl/jobs/kill-job/checkpoints/LATEST.json"
    s3 = s3fs.S3FileSystem(skip_instance_cache=True)

    first = _train(env, tmp_path / "first.log")
    deadline = time.monotonic() + 300
    killed_after = None
    while time.monotonic() < deadline and first.poll() is None:
        s3.invalidate_cache()
        if s3.exists(latest):
            killed_after = json.loads(s3.cat(latest))["step"]
            if killed_after >= 2:
                os.killpg(first.pid, signal.SIGKILL)  # no cleanup, no final checkpoint
                break
        time.sleep(0.2)
    first.wait(30)
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    assert killed_after is not None and killed_after < STEPS

    second = _train(env, tmp_path / "second.log")
    assert second.wait(600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    output = (tmp_path / "second.log").read_text()
    assert "registered model                     : models:/kill-job/" in output

    result = json.loads(s3.cat(f"{moto_s3.bucket}/flowrl/jobs/kill-job/result.json"))
    c = client()
    steps = [m.step for m in c.get_metric_history(result["mlflow_run_id"], "reward/mean")]
    assert set(steps) == set(range(1, STEPS + 1))
    # Steps up to the checkpoint ran once; only those after it (lost in the kill) may repeat.
    assert all(steps.count(s) == 1 for s in range(1, killed_after + 1)), (killed_after, steps)
    name, version = result["model_uri"].removeprefix("models:/").split("/")
    assert c.get_model_version(name, version).run_id == result["mlflow_run_id"]
    print(f"\nkilled after checkpoint {killed_after}; resumed; registered {result['model_uri']}")
