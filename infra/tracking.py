"""MLflow tracking and registry helpers (client API only: no global active-run state)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import (
    Dataset,
    DatasetInput,
    InputTag,
    LoggedModelOutput,
    Metric,
    Param,
    RunTag,
)

from flowrl.infra.plot import Series, curve_svg
from flowrl.infra.redact import redact, redact_text
from flowrl.infra.settings import get_settings

NAMESPACE_TAG = "flowrl.namespace"
"""Tag of a run and a registered model: the namespace of the job that created it."""

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag the MLflow UI's kind selector writes (``custom_model_development`` for
model training, ``genai_development`` for GenAI); flowrl's experiments are model training."""
TRAINING_KIND = "custom_model_development"
TRAINING_VIEW = "workflowType=machine_learning"
"""The MLflow UI's query parameter for its "Model training" view. MLflow 3.17's UI picks the
view from this parameter (else the browser's last choice, GenAI by default), not from the
experiment's kind tag: flowrl's links to the UI carry it."""


def client() -> MlflowClient:
    uri = get_settings().tracking_uri
    _create_embedded_store(uri)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri)


_READY_STORES: set[str] = set()


def _create_embedded_store(uri: str) -> None:
    """Open an embedded SQLite store once per process, under an exclusive file lock: MLflow
    creates and migrates the database when a store is first opened, and two jobs starting at
    once on a fresh ``FLOWRL_HOME`` would otherwise run the migrations side by side (one fails
    halfway, e.g. ``AttributeError: dimension_attributes``). Servers migrate for themselves."""
    if uri in _READY_STORES or not uri.startswith("sqlite:///"):
        return
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _READY_STORES.add(uri)


def artifact_root() -> str | None:
    """Where a new experiment keeps its artifacts: ``<home>/mlartifacts`` for an embedded
    (file or database) store, never the working directory of whichever process logs first; a
    tracking server decides for itself (its ``--artifacts-destination``)."""
    settings = get_settings()
    if _is_server(settings.tracking_uri) or settings.tracking_uri.startswith("databricks"):
        return None
    return (settings.resolved_home / "mlartifacts").as_uri()


def _is_server(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` → ``{"a.b": "1"}``, redacted (``infra.redact``): every field is
    there, a secret-named field's value and a URL's user-info read ``***``."""
    out: dict[str, str] = {}
    for key, value in redact(data).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


def experiment_id(name: str) -> str:
    """The id of experiment ``name``, created if missing; two jobs starting at once on a fresh
    store both get the one experiment (the loser of the create race reads the winner's)."""
    c = client()
    found = c.get_experiment_by_name(name)
    if found is None:
        kind = {EXPERIMENT_KIND_TAG: TRAINING_KIND}
        try:
            return c.create_experiment(name, artifact_root(), tags=kind)
        except mlflow.exceptions.MlflowException:
            found = c.get_experiment_by_name(name)
            if found is None:
                raise
    if EXPERIMENT_KIND_TAG not in found.tags:  # made before flowrl tagged its experiments
        c.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return found.experiment_id


def start_run(
    experiment: str,
    run_name: str,
    params: dict[str, Any],
    run_id: str | None = None,
    namespace: str | None = None,
) -> str:
    """Resume ``run_id`` if given and present, else create a run and log ``params``; the run is
    tagged with the job (``flowrl.job``) and its owner (``flowrl.namespace``)."""
    c = client()
    if run_id is not None:
        try:
            c.get_run(run_id)
            c.update_run(run_id, status="RUNNING")
            return run_id
        except mlflow.exceptions.MlflowException:
            pass  # the tracking store was reset: start afresh
    exp_id = experiment_id(experiment)
    tags = {"flowrl.job": run_name, NAMESPACE_TAG: namespace or ""}
    run = c.create_run(exp_id, run_name=run_name, tags=tags)
    flat = flatten(params)
    c.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in flat.items()])
    return run.info.run_id


MAX_METRICS_PER_BATCH = 1000
"""MLflow's limit on the metrics of one ``log_batch`` call."""


def log_metrics(run_id: str, metrics: dict[str, float], step: int) -> None:
    log_metric_rows(run_id, [(metrics, step)])


def log_metric_rows(
    run_id: str, rows: list[tuple[dict[str, float], int]], timestamp_ms: int | None = None
) -> None:
    """Several steps' metrics, ``[(metrics, step), …]``, in as few writes as MLflow allows."""
    now = timestamp_ms or int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for metrics, step in rows for k, v in metrics.items()]
    for i in range(0, len(batch), MAX_METRICS_PER_BATCH):
        client().log_batch(run_id, metrics=batch[i : i + MAX_METRICS_PER_BATCH])


def reachable(timeout: float = 3.0) -> bool:
    """The tracking server answers its health URL (an embedded store always does)."""
    uri = get_settings().tracking_uri
    if not _is_server(uri):
        return True
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(uri.rstrip("/") + "/health", timeout=timeout):
            return True
    except urllib.error.HTTPError as err:
        return err.code < 500
    except OSError:
        return False


def is_outage(err: BaseException) -> bool:
    """``err`` says the tracking server could not be reached or is failing (connection
    refused, a timeout, a 5xx), not that the request was wrong."""
    import requests

    if isinstance(err, requests.exceptions.ConnectionError | requests.exceptions.Timeout):
        return True
    import re

    text = str(err)
    signs = ("Max retries exceeded", "Connection refused", "Failed to establish", "Read timed out")
    server_error = re.search(r"(error|status) code:? 5\d\d|\b5\d\d Server Error", text)
    return any(sign in text for sign in signs) or server_error is not None


class MlflowDelivery:
    """Delivers an ``Outbox``'s records to the MLflow run ``run_id``: ``metrics`` (rows of
    ``[metrics, step]``, put at ``at`` ms), ``json`` (an artifact file) and ``tags``. A metric
    point at a step MLflow already has for that key is skipped (a record delivered again after
    a crash); an unreachable server raises ``outbox.Retryable``."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._through: dict[str, int] | None = None

    def __call__(self, records: list[dict[str, Any]]) -> None:
        from flowrl.infra.outbox import Retryable

        if not reachable():
            raise Retryable(f"no answer from {get_settings().tracking_uri}")
        try:
            if self._through is None:
                self._through = logged_through(self.run_id)
            for record in records:
                self._one(record)
        except Exception as err:
            if is_outage(err):
                raise Retryable(str(err).splitlines()[0][:200]) from err
            raise

    def _one(self, record: dict[str, Any]) -> None:
        assert self._through is not None
        kind = record["kind"]
        if kind == "metrics":
            rows = []
            for metrics, step in record["rows"]:
                fresh = {k: v for k, v in metrics.items() if step > self._through.get(k, -1)}
                if fresh:
                    rows.append((fresh, step))
            if rows:
                log_metric_rows(self.run_id, rows, record.get("at"))
                for metrics, step in rows:
                    for key in metrics:
                        self._through[key] = max(step, self._through.get(key, -1))
        elif kind == "json":
            log_json(self.run_id, record["payload"], record["file"])
        elif kind == "tags":
            set_tags(self.run_id, record["tags"])
        else:
            raise ValueError(f"unknown outbox record kind {kind!r}")


def log_series(run_id: str, name: str, values: list[float], first_step: int) -> None:
    """One metric's values at consecutive steps from ``first_step`` (e.g. per-step losses)."""
    now = int(time.time() * 1000)
    batch = [Metric(name, float(v), now, first_step + i) for i, v in enumerate(values)]
    client().log_batch(run_id, metrics=batch)


def logged_through(run_id: str) -> dict[str, int]:
    """The last step logged of each metric of the run (a continued run logs no step twice)."""
    c = client()
    return {
        key: max(point.step for point in c.get_metric_history(run_id, key))
        for key in c.get_run(run_id).data.metrics
    }


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


def run_url(run_id: str) -> str:
    """Where to look at a run: its MLflow UI page on a tracking server, else ``runs:/<id>``
    (which every MLflow client resolves against the embedded store)."""
    c = client()
    return run_link(c.get_run(run_id).info.experiment_id, run_id) or f"runs:/{run_id}"


def metric_table(run_id: str, names: list[str], limit: int = 500) -> list[dict[str, float]]:
    """One row per step at which any of ``names`` was logged: ``{"step": s, name: value}``
    (the last ``limit`` steps)."""
    c = client()
    by_step: dict[int, dict[str, float]] = {}
    for name in names:
        for m in c.get_metric_history(run_id, name):
            by_step.setdefault(m.step, {"step": m.step})[name] = m.value
    return [by_step[s] for s in sorted(by_step)][-limit:]


def log_json(run_id: str, obj: Any, artifact_file: str) -> None:
    client().log_dict(run_id, obj, artifact_file)


def log_curve(run_id: str, series: Series, artifact_file: str, xlabel: str = "step") -> None:
    """``series`` drawn into an SVG artifact of the run (``plot.curve_svg``)."""
    client().log_text(run_id, curve_svg(series, xlabel), artifact_file)


def end_run(run_id: str, status: str = "FINISHED") -> None:
    client().set_terminated(run_id, status=status)


@dataclass(frozen=True)
class DataFile:
    """A data file a model was trained or evaluated on, for the version's lineage."""

    uri: str
    sha256: str
    context: str  # "train" or "eval"


@dataclass
class Lineage:
    """Where a registered version comes from: shown in its description, tags and run inputs."""

    job: str
    kind: str  # rl-train, sft-train, self-play
    base_model: str  # the pinned URI the job trained from (models:/name/3, s3://..., a path)
    environment: str = ""  # registered environment name ("" for SFT on data files)
    environment_code: str = ""  # sha256 of the environment's source module
    data: list[DataFile] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    def tags(self) -> dict[str, str]:
        tags = {
            "flowrl.job": self.job,
            "flowrl.kind": self.kind,
            "flowrl.base_model": self.base_model,
        }
        if self.environment:
            tags["flowrl.environment"] = self.environment
            tags["flowrl.environment_code_sha256"] = self.environment_code
        for i, item in enumerate(self.data):
            tags[f"flowrl.data.{i}"] = f"{item.context} {item.uri} sha256:{item.sha256}"
        return {k: redact_text(v) for k, v in tags.items()}


def register_policy(
    run_id: str,
    hf_dir: str,
    model_dir: str,
    name: str,
    metrics: dict[str, float],
    lineage: Lineage,
) -> str:
    """Register a trained policy as a new version of ``name``; returns ``models:/name/N``.

    - the HF folder ``hf_dir`` is logged as the run's ``policy`` artifact (downloadable as is);
    - the MLflow Model in ``model_dir`` (``backends.models.mlflow_model``) becomes a logged model of
      the run, with ``metrics`` as its metrics, the job's config as its params;
    - data files are logged as the run's dataset inputs (name, sha256 digest, source URI);
    - the version's source is that logged model; it carries a description, lineage tags, the
      metrics as tags and (on a tracking server) a link to the run.
    """
    c = client()
    run = c.get_run(run_id)
    c.log_artifacts(run_id, hf_dir, "policy")
    params = {k: v[:6000] for k, v in flatten(lineage.config).items()}
    logged = c.create_logged_model(
        run.info.experiment_id,
        name=name,
        source_run_id=run_id,
        params=params,
        tags=lineage.tags(),
        model_type="flowrl-chat-policy",
    )
    try:
        c.log_model_artifacts(logged.model_id, model_dir)
    except Exception:
        c.finalize_logged_model(logged.model_id, "FAILED")
        raise
    c.finalize_logged_model(logged.model_id, "READY")
    linked = _linked_metrics(run_id, metrics, logged.model_id)
    c.log_batch(run_id, metrics=linked)
    # The run's output, so that its page lists the model ("Logged models"), at the step of the
    # metrics it was registered with.
    step = max((m.step for m in linked), default=0)
    c.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step)])
    if lineage.data:
        inputs = [
            DatasetInput(
                Dataset(
                    name=item.uri.rsplit("/", 1)[-1],
                    digest=item.sha256[:16],
                    source_type="path",
                    source=json.dumps({"uri": item.uri, "sha256": item.sha256}),
                ),
                tags=[InputTag("mlflow.data.context", item.context)],
            )
            for item in lineage.data
        ]
        c.log_inputs(run_id, datasets=inputs)
    namespace = get_settings().namespace or ""
    try:
        owner = c.get_registered_model(name).tags.get(NAMESPACE_TAG, "")
    except mlflow.exceptions.MlflowException:
        c.create_registered_model(
            name,
            tags={NAMESPACE_TAG: namespace},
            description="flowrl chat policy (MLflow pyfunc model holding an HF folder)",
        )
        owner = namespace
    if owner != namespace:
        raise PermissionError(
            f"registered model {name!r} belongs to namespace {owner or '(shared)'!r}, "
            f"not to this job's {namespace or '(shared)'!r}"
        )
    description = _describe(lineage, metrics, run_id)
    tags = lineage.tags() | {k.replace("/", "."): f"{v:.4f}" for k, v in metrics.items()}
    version = c.create_model_version(
        name,
        source=logged.model_uri,
        run_id=run_id,
        tags=tags,
        run_link=run_link(run.info.experiment_id, run_id),
        description=description,
        model_id=logged.model_id,
    )
    return f"models:/{name}/{version.version}"


def _linked_metrics(run_id: str, metrics: dict[str, float], model_id: str) -> list[Metric]:
    """``metrics`` as the logged model's metrics. A value the run already logged is linked by
    re-logging that very point (same step and timestamp: the store keeps one point, the run's
    history is unchanged); any other value is logged at step 0."""
    c = client()
    now = int(time.time() * 1000)
    out = []
    for key, value in metrics.items():
        same = [m for m in c.get_metric_history(run_id, key) if m.value == float(value)]
        step, stamp = (same[-1].step, same[-1].timestamp) if same else (0, now)
        out.append(Metric(key, float(value), stamp, step, model_id=model_id))
    return out


def run_link(experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI page of a run, in the UI's model-training view, when the tracking store is
    a server; None otherwise."""
    uri = get_settings().tracking_uri
    if not _is_server(uri):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def _describe(lineage: Lineage, metrics: dict[str, float], run_id: str) -> str:
    lines = [f"{lineage.kind} job `{lineage.job}` (MLflow run {run_id})"]
    lineage = dataclasses.replace(lineage, base_model=redact_text(lineage.base_model))
    lines.append(f"base model `{lineage.base_model}`")
    if lineage.environment:
        lines.append(
            f"environment `{lineage.environment}` (code sha256 {lineage.environment_code[:12]})"
        )
    for item in lineage.data:
        lines.append(f"{item.context} data `{item.uri}` (sha256 {item.sha256[:12]})")
    if metrics:
        lines.append(", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())))
    return "\n".join(lines)


def download_model(uri: str) -> str:
    """Download a ``models:/`` URI into a fresh temp folder; returns the folder."""
    client()  # MLflow's process-wide URIs (the registry's too) from this process's settings
    dst = tempfile.mkdtemp(prefix="flowrl-model-")
    return mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=os.path.join(dst, "m"))
