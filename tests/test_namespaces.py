"""Job namespaces and secrets: a job is identified by (namespace, name), so two owners' jobs of
the same name keep their own runs, checkpoints and registered models; and the credentials in a
job's environment leave no trace in MLflow, Prefect, storage or logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
from pydantic import ValidationError

from flowrl.infra.settings import Settings, get_settings, scoped_model_name
from flowrl.tasks.schemas import RLJobConfig
from flowrl.tasks.types import JobContext

JOB = """\
name: same-name
env: {params: {eval_size: 16}}
warmup: {enabled: false}
rollout: {prompts_per_step: 4, group_size: 2}
schedule: {steps: 2, eval_every: 2, checkpoint_every: 1}
"""


def test_a_namespace_scopes_the_prefix_cache_and_model_name(monkeypatch):
    shared = JobContext("job", "/s", "/c", "run")
    alice = JobContext("job", "/s", "/c", "run", namespace="alice")
    assert (shared.prefix, shared.cache_prefix) == ("jobs/job", "cache")
    assert (alice.prefix, alice.cache_prefix) == ("ns/alice/jobs/job", "ns/alice/cache")
    assert alice.checkpoint_prefix == "ns/alice/jobs/job/checkpoints"
    assert scoped_model_name("m", "alice") == "alice_m" and scoped_model_name("m", None) == "m"
    monkeypatch.setenv("FLOWRL_NAMESPACE", "alice")
    namespace = get_settings().namespace
    assert RLJobConfig(name="job").registered_model_name(namespace) == "alice_job"
    assert RLJobConfig(name="job", register_as="Other-1").registered_model_name(namespace) == (
        "alice_Other-1"
    )
    # A job cannot name a model of another namespace, nor choose an unfit namespace.
    with pytest.raises(ValidationError, match="register_as"):
        RLJobConfig(register_as="bob_job")
    for bad in ("Alice", "a/b", "../x", "a.b", "a_b", ""):
        with pytest.raises(ValidationError, match="namespace"):
            Settings(namespace=bad)


def _files_bytes(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_two_namespaces_run_the_same_job_name_at_once_and_no_secret_is_recorded(
    tmp_path, prefect_api, moto_s3
):
    """Two owners submit a job named ``same-name`` at the same time, storage on S3 (moto), one
    MLflow store, one Prefect API. Each gets its own MLflow run, checkpoints under its own
    prefix and its own registered model; the S3 secret key and a token in the jobs'
    environment appear nowhere in MLflow, Prefect, storage or the jobs' output."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL

    secret = f"s3cr3t-{uuid.uuid4().hex}"
    token = f"hf_{uuid.uuid4().hex}"
    (tmp_path / "job.yaml").write_text(JOB)
    home = tmp_path / "home"
    base = {
        **os.environ,
        "FLOWRL_HOME": str(home),
        "FLOWRL_STORAGE_URL": f"{moto_s3.url}/flowrl",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "FLOWRL_POOL_GPUS": "0",
        "FLOWRL_RAY_NUM_CPUS": "4",
        "AWS_SECRET_ACCESS_KEY": secret,  # moto accepts any key
        "HF_TOKEN": token,
    }
    base.pop("MLFLOW_TRACKING_URI", None)
    flowrl = str(Path(sys.executable).with_name("flowrl"))
    jobs = {
        ns: subprocess.Popen(
            [flowrl, "train", "job.yaml"],
            cwd=tmp_path,
            env={**base, "FLOWRL_NAMESPACE": ns},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ns in ("alice", "bob")
    }
    out = {ns: p.communicate(timeout=600) for ns, p in jobs.items()}
    for ns, p in jobs.items():
        assert p.returncode == 0, out[ns][1][-3000:]
        assert f"models:/{ns}_same-name/1" in out[ns][0]

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    s3 = boto3.client("s3", endpoint_url=moto_s3.endpoint_url)
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=moto_s3.bucket)
        for o in page.get("Contents", [])
    ]
    runs = {}
    for ns in ("alice", "bob"):
        job = json.loads(
            s3.get_object(Bucket=moto_s3.bucket, Key=f"flowrl/ns/{ns}/jobs/same-name/job.json")[
                "Body"
            ].read()
        )
        runs[ns] = client.get_run(job["mlflow_run_id"])
        assert runs[ns].data.tags["flowrl.namespace"] == ns
        checkpoints = [k for k in keys if k.startswith(f"flowrl/ns/{ns}/jobs/same-name/checkp")]
        assert any(k.endswith("LATEST.json") for k in checkpoints), keys
        versions = client.search_model_versions(f"name='{ns}_same-name'")
        assert [str(v.version) for v in versions] == ["1"]
        assert versions[0].run_id == runs[ns].info.run_id
        assert client.get_registered_model(f"{ns}_same-name").tags["flowrl.namespace"] == ns
    assert runs["alice"].info.run_id != runs["bob"].info.run_id
    assert not [k for k in keys if k.startswith("flowrl/jobs/")]  # nothing in the shared space
    assert not client.search_model_versions("name='same-name'")

    # No trace of either secret: S3 objects, everything under FLOWRL_HOME (MLflow's database and
    # artifacts, model cache), Prefect's database (parameters, logs, artifacts), the output.
    stores = {f"s3://{k}": s3.get_object(Bucket=moto_s3.bucket, Key=k)["Body"].read() for k in keys}
    stores |= _files_bytes(home)
    db = Path(PREFECT_API_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    stores |= {str(p): p.read_bytes() for p in db.parent.glob(db.name + "*")}
    for ns, (stdout, stderr) in out.items():
        stores[f"{ns} output"] = (stdout + stderr).encode()
    assert len(stores) > 20 and any("prefect" in k or k.endswith(".db") for k in stores)
    for needle in (secret, token):
        leaks = [where for where, data in stores.items() if needle.encode() in data]
        assert not leaks, f"secret found in {leaks}"
