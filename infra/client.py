"""The job client: submit, watch, cancel jobs and read their results, over Prefect and MLflow.

A thin layer on Prefect's client (``run_deployment(..., timeout=0)`` submits; flow-run states
are the job's status; cancellation is a state change the worker acts on) and MLflow's client
(metrics of the job's run). No GPU, no model: this is what a user's laptop runs.

    from flowrl.infra.client import JobClient
    jobs = JobClient()
    run_id = jobs.submit("rl-train", {"config": {"name": "my-job", "resources": {"gpus": 1}}})
    jobs.wait(run_id); print(jobs.result(run_id))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from flowrl.infra.configfile import ConfigError, merge
from flowrl.infra.scheduler import RESUME_DELAY_SECONDS, RESUME_TAG, admit, load_scheduler


@dataclass(frozen=True)
class JobStatus:
    """One job as its flow run sees it."""

    id: str
    name: str
    deployment: str | None
    queue: str | None
    state: str
    """Prefect state type: SCHEDULED, PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, …"""
    message: str | None
    start_time: datetime | None
    end_time: datetime | None
    attempts: int = 1
    """Attempts so far (Prefect's run count: a crashed job resumed by the stack runs again)."""
    resumes: bool = False
    """CRASHED, and the stack's automation schedules it again (a ``flowrl-resume`` deployment's
    run with attempts left): not over yet."""

    @property
    def final(self) -> bool:
        if self.resumes:
            return False
        return self.state in {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def requested_gpus(parameters: dict[str, Any]) -> int:
    """GPU slots a job asks for: ``config.resources.gpus`` (job configs) or ``gpus`` (probes)."""
    config = parameters.get("config")
    if isinstance(config, dict):
        return int((config.get("resources") or {}).get("gpus", 0) or 0)
    if config is not None and hasattr(config, "resources"):
        return int(config.resources.gpus)
    return int(parameters.get("gpus", 0) or 0)


def check_parameters(deployment: str, schema: dict[str, Any] | None, params: dict) -> None:
    """Check a submission against the deployment's parameter schema (the JSON schema of the
    flow's own config model, which Prefect's API enforces too) before anything is sent;
    ``ConfigError`` naming each field that does not fit, one line each."""
    if not schema:
        return
    import jsonschema
    from pydantic_core import to_jsonable_python

    params = to_jsonable_python(params, fallback=str)  # as the API gets them (tuples as lists)

    known = schema.get("properties") or {}
    lines = [
        f"  {key}: not a parameter here (expected one of {sorted(known)})"[:400]
        for key in sorted(set(params) - set(known))
    ]
    validator = jsonschema.Draft7Validator(schema)
    for error in sorted(validator.iter_errors(params), key=lambda e: list(map(str, e.path))):
        where = ".".join(str(p) for p in error.absolute_path)
        if error.validator == "additionalProperties":
            allowed = sorted(error.schema.get("properties", {}))
            extra = sorted(set(error.instance) - set(allowed))
            for key in extra:
                field = f"{where}.{key}" if where else key
                lines.append(f"  {field}: not a field here (expected one of {allowed})"[:400])
            continue
        lines.append(f"  {where or '(parameters)'}: {error.message}"[:400])
    if lines:
        raise ConfigError(
            f"the submission does not fit {deployment}'s parameters:\n" + "\n".join(lines)
        )


def _job_name(parameters: dict[str, Any]) -> str | None:
    config = parameters.get("config")
    if isinstance(config, dict):
        return config.get("name")
    return getattr(config, "name", None)


def api_restarting(err: BaseException) -> bool:
    """``err`` says the Prefect API is down or failing for now (it is being restarted, or its
    database is), not that the request was wrong."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    if isinstance(err, httpx.TransportError):
        return True
    return isinstance(err, PrefectHTTPStatusError) and err.response.status_code >= 500


class JobClient:
    """Jobs on the Prefect API of the environment (``PREFECT_API_URL``)."""

    def _client(self):
        from prefect import get_client

        return get_client(sync_client=True)

    def deployment_name(self, name: str) -> str:
        """``flow/deployment`` from a short deployment name (``rl-train``)."""
        if "/" in name:
            return name
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

        with self._client() as c:
            found = c.read_deployments(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name]))
            )
            if len(found) != 1:
                raise LookupError(f"{len(found)} deployments are named {name!r}")
            flow = c.read_flow(found[0].flow_id)
        return f"{flow.name}/{name}"

    def submit(
        self,
        deployment: str,
        parameters: dict[str, Any] | None = None,
        queue: str | None = None,
        run_name: str | None = None,
    ) -> str:
        """Submit without waiting; returns the flow-run id. Refused at once (``AdmissionError``)
        if the job asks for more GPUs than the pool has.

        The submitted parameters are merged into the deployment's own, field by field (Prefect
        replaces a whole top-level parameter): ``rl-train-lora`` with a submitted ``config``
        keeps its ``model.lora.enabled`` unless the submission sets it."""
        from prefect.deployments import run_deployment

        name = self.deployment_name(deployment)
        with self._client() as c:
            deployment = c.read_deployment_by_name(name)
        parameters = merge(deployment.parameters or {}, parameters or {})
        check_parameters(name, deployment.parameter_openapi_schema, parameters)
        gpus = requested_gpus(parameters)
        admit(gpus)
        # On Kubernetes the pod asks the node for the job's GPUs (base job template `gpus`).
        kube = load_scheduler().pool.type == "kubernetes"
        run = run_deployment(
            name,
            parameters=parameters,
            timeout=0,
            work_queue_name=queue,
            flow_run_name=run_name or _job_name(parameters),
            as_subflow=False,
            job_variables={"gpus": gpus} if kube else None,
        )
        return str(run.id)

    def status(self, run_id: str) -> JobStatus:
        with self._client() as c:
            run = c.read_flow_run(UUID(run_id))
            deployment = c.read_deployment(run.deployment_id).name if run.deployment_id else None
        state = run.state_type.value if run.state_type else "UNKNOWN"
        resumes = (
            state == "CRASHED"
            and RESUME_TAG in run.tags
            and run.run_count < load_scheduler().max_attempts
            and run.state is not None
            # The automation acts RESUME_DELAY_SECONDS after the crash; past a minute more,
            # nothing is coming (no automation on this API, or it is down).
            and (time.time() - run.state.timestamp.timestamp()) < RESUME_DELAY_SECONDS + 60
        )
        return JobStatus(
            id=str(run.id),
            name=run.name,
            deployment=deployment,
            queue=run.work_queue_name,
            state=state,
            message=run.state.message if run.state else None,
            start_time=run.start_time,
            end_time=run.end_time,
            attempts=max(1, run.run_count),
            resumes=resumes,
        )

    def list(self, limit: int = 20, states: list[str] | None = None) -> list[JobStatus]:
        """Latest flow runs that came from a deployment, newest first."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort

        flt = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(is_null_=False))
        if states:
            types = [StateType(s.upper()) for s in states]
            flt.state = FlowRunFilterState(type=FlowRunFilterStateType(any_=types))
        with self._client() as c:
            runs = c.read_flow_runs(
                flow_run_filter=flt, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=limit
            )
        return [self.status(str(r.id)) for r in runs]

    def cancel(self, run_id: str) -> JobStatus:
        """A waiting job is cancelled at once; a running one is marked CANCELLING and its worker
        stops the process."""
        from prefect.states import Cancelled, Cancelling

        current = self.status(run_id)
        if current.final:
            return current
        waiting = current.state in {"SCHEDULED", "PENDING", "PAUSED"}
        state = Cancelled(message="cancelled by the job client") if waiting else Cancelling()
        with self._client() as c:
            c.set_flow_run_state(UUID(run_id), state, force=True)
        return self.status(run_id)

    def wait(self, run_id: str, timeout: float = 3600, poll: float = 1.0) -> JobStatus:
        """Poll until the job is final (through a crash being resumed, and through the Prefect
        API restarting: a refused connection or a 5xx is asked again)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = self.status(run_id)
            except Exception as err:
                if not api_restarting(err) or time.monotonic() > deadline:
                    raise
                time.sleep(max(poll, 2.0))
                continue
            if status.final:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {run_id} still {status.state} after {timeout} s")
            time.sleep(poll)

    def parameters(self, run_id: str) -> dict[str, Any]:
        with self._client() as c:
            return dict(c.read_flow_run(UUID(run_id)).parameters)

    def metrics(self, run_id: str) -> dict[str, float]:
        """Latest value of every metric of the job's MLflow run (found by job name)."""
        from flowrl.infra.tracking import client as mlflow_client

        name = _job_name(self.parameters(run_id))
        if name is None:
            return {}
        from flowrl.infra.settings import get_settings

        namespace = get_settings().namespace or ""
        runs = mlflow_client().search_runs(
            experiment_ids=[e.experiment_id for e in mlflow_client().search_experiments()],
            filter_string=(
                f"tags.`flowrl.job` = '{name}' and tags.`flowrl.namespace` = '{namespace}'"
            ),
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return dict(runs[0].data.metrics) if runs else {}

    def result(self, run_id: str) -> dict[str, Any] | None:
        """The job's ``result.json`` in storage (model URI, MLflow run), once it finished."""
        from flowrl.infra.settings import get_settings, job_prefix
        from flowrl.infra.storage import Storage

        params = self.parameters(run_id)
        name = _job_name(params)
        if name is None:
            return None
        settings = get_settings()
        storage = Storage(settings.storage_root)
        rel = f"{job_prefix(name, settings.namespace)}/result.json"
        return storage.read_json(rel) if storage.exists(rel) else None
