"""MLflow tracking and registry helpers (client API only: no global active-run state)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag

from flowrl.infra.settings import get_settings

# Names whose values must never reach MLflow params, even if a config grows such a field.
_SECRET_HINTS = ("secret", "password", "token", "key_id", "access_key", "credential")


def client() -> MlflowClient:
    uri = get_settings().tracking_uri
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri)


def artifact_root() -> str | None:
    """Where a new experiment keeps its artifacts: ``<home>/mlartifacts`` for an embedded
    (file or database) store, never the working directory of whichever process logs first; a
    tracking server decides for itself (its ``--artifacts-destination``)."""
    settings = get_settings()
    if settings.tracking_uri.startswith(("http://", "https://", "databricks")):
        return None
    return (settings.resolved_home / "mlartifacts").as_uri()


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` → ``{"a.b": "1"}``; secret-looking keys are dropped."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if any(h in key.lower() for h in _SECRET_HINTS):
            continue
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


def start_run(
    experiment: str, run_name: str, params: dict[str, Any], run_id: str | None = None
) -> str:
    """Resume ``run_id`` if given and present, else create a run and log ``params``."""
    c = client()
    if run_id is not None:
        try:
            c.get_run(run_id)
            c.update_run(run_id, status="RUNNING")
            return run_id
        except mlflow.exceptions.MlflowException:
            pass  # the tracking store was reset: start afresh
    exp = c.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment, artifact_root())
    run = c.create_run(exp_id, run_name=run_name, tags={"flowrl.job": run_name})
    flat = flatten(params)
    c.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in flat.items()])
    return run.info.run_id


def log_metrics(run_id: str, metrics: dict[str, float], step: int) -> None:
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    client().log_batch(run_id, metrics=batch)


def log_series(run_id: str, name: str, values: list[float], first_step: int) -> None:
    """One metric's values at consecutive steps from ``first_step`` (e.g. per-step losses)."""
    now = int(time.time() * 1000)
    batch = [Metric(name, float(v), now, first_step + i) for i, v in enumerate(values)]
    client().log_batch(run_id, metrics=batch)


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    client().log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def alias_version(name: str, alias: str) -> str | None:
    """The version of registered model ``name`` that ``alias`` names now, or None."""
    try:
        return str(client().get_model_version_by_alias(name, alias).version)
    except mlflow.exceptions.MlflowException:
        return None


def set_alias(name: str, alias: str, version: str) -> None:
    client().set_registered_model_alias(name, alias, version)


def log_json(run_id: str, obj: Any, artifact_file: str) -> None:
    client().log_dict(run_id, obj, artifact_file)


def log_reward_curve(run_id: str, metric_names: list[str], artifact_file: str) -> None:
    """Plot the logged history of ``metric_names`` against step into a PNG artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = client()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in metric_names:
        history = sorted(c.get_metric_history(run_id, name), key=lambda m: m.step)
        if history:
            ax.plot([m.step for m in history], [m.value for m in history], label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("value")
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    c.log_figure(run_id, fig, artifact_file)
    plt.close(fig)


def end_run(run_id: str, status: str = "FINISHED") -> None:
    client().set_terminated(run_id, status=status)


def register_policy(run_id: str, local_dir: str, name: str, metrics: dict[str, float]) -> str:
    """Log an HF folder as the run's ``policy`` artifact and register it; returns its URI."""
    c = client()
    c.log_artifacts(run_id, local_dir, "policy")
    try:
        c.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        c.create_registered_model(name, description="flowrl policy (HF model folder)")
    source = f"{c.get_run(run_id).info.artifact_uri}/policy"
    tags = {k.replace("/", "."): f"{v:.4f}" for k, v in metrics.items()}
    version = c.create_model_version(name, source=source, run_id=run_id, tags=tags)
    return f"models:/{name}/{version.version}"


def download_model(uri: str) -> str:
    """Download a ``models:/`` URI into a fresh temp folder; returns the folder."""
    dst = tempfile.mkdtemp(prefix="flowrl-model-")
    return mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=os.path.join(dst, "m"))
