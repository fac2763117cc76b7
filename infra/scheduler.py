"""The GPU scheduler as Prefect objects, declared in ``infra/scheduler.yaml``.

One work pool for GPU jobs, one work queue per workload class (priority, concurrency limit), a
pool-level limit, and a strict global concurrency limit (``gpu``) whose slots are the pool's
GPUs. Admission is Prefect's: queue/pool limits decide when a flow run starts, and a job holds
``resources.gpus`` slots of the ``gpu`` limit for its whole run (``gpu_slots``, which every
flow's ``JobRun`` enters). ``apply_scheduler`` creates or updates all of it, any number
of times.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from flowrl.infra.configfile import STRICT_MODEL_CONFIG
from flowrl.infra.settings import get_settings

DEFAULT_FILE = Path(__file__).with_name("scheduler.yaml")
K8S_TEMPLATE = Path(__file__).parent / "k8s" / "base-job-template.json"


class _Spec(BaseModel):
    model_config = STRICT_MODEL_CONFIG


class QueueSpec(_Spec):
    name: str = Field(description="Work queue name (a workload class, e.g. rl-full).")
    priority: int = Field(ge=1, description="1 is served first.")
    concurrency_limit: int | None = Field(default=None, ge=0, description="Runs at once.")
    description: str = Field(default="", description="Shown in the Prefect UI.")


class PoolSpec(_Spec):
    name: str = Field(description="Work pool name.")
    type: Literal["process", "kubernetes"] = Field(default="process", description="Worker type.")
    concurrency_limit: int | None = Field(
        default=None, ge=0, description="Runs at once, all queues."
    )
    gpus: int = Field(default=0, ge=0, description="GPUs in the pool: slots of the gpu limit.")


class SchedulerSpec(_Spec):
    """The whole declaration (``infra/scheduler.yaml``)."""

    pool: PoolSpec
    queues: list[QueueSpec]
    gpu_limit: str = Field(default="gpu", description="Global concurrency limit counting GPUs.")
    gpu_lease_seconds: float = Field(
        default=60.0,
        ge=60.0,
        description="Lease on a job's GPU slots, renewed while it runs (every 3/4 of it). A "
        "killed job's slots return to the pool when the lease runs out (plus up to the "
        "server's repossessor interval). Prefect's API accepts 60 s or more.",
    )

    @model_validator(mode="after")
    def _unique_queues(self) -> SchedulerSpec:
        names = [q.name for q in self.queues]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate queue names in {names}")
        return self

    def queue(self, name: str) -> QueueSpec:
        for q in self.queues:
            if q.name == name:
                return q
        raise KeyError(f"no work queue {name!r} in the scheduler declaration")


def load_scheduler(path: str | Path | None = None) -> SchedulerSpec:
    """Read the declaration (``FLOWRL_SCHEDULER_FILE`` or the shipped one); apply settings."""
    s = get_settings()
    file = Path(path or s.scheduler_file or DEFAULT_FILE)
    spec = SchedulerSpec.model_validate(yaml.safe_load(file.read_text()))
    if s.pool_gpus is not None:
        spec = spec.model_copy(update={"pool": spec.pool.model_copy(update={"gpus": s.pool_gpus})})
    return spec


class AdmissionError(ValueError):
    """A job that can never run on this pool (e.g. more GPUs than the pool has)."""


def check_admission(gpus: int, pool_gpus: int, limit_name: str = "gpu") -> None:
    """Refuse at once a job asking for more GPUs than exist, instead of leaving it waiting."""
    if gpus > pool_gpus:
        raise AdmissionError(
            f"job asks for resources.gpus={gpus} but the pool has {pool_gpus} GPU(s) "
            f"(global concurrency limit {limit_name!r}); it could never start"
        )


def base_job_template(pool_type: str) -> dict[str, Any]:
    if pool_type == "kubernetes":
        return json.loads(K8S_TEMPLATE.read_text())
    from prefect.workers.process import ProcessWorker

    return ProcessWorker.get_default_base_job_template()


async def apply_scheduler(spec: SchedulerSpec) -> list[str]:
    """Create or update the pool, its queues and the gpu limit; returns what was done."""
    from prefect import get_client
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
        WorkPoolCreate,
        WorkPoolUpdate,
    )
    from prefect.exceptions import ObjectNotFound

    done: list[str] = []
    async with get_client() as client:
        pool = spec.pool
        try:
            await client.read_work_pool(pool.name)
            update = WorkPoolUpdate(concurrency_limit=pool.concurrency_limit)
            await client.update_work_pool(pool.name, update)
            done.append(f"work pool {pool.name}: updated (limit {pool.concurrency_limit})")
        except ObjectNotFound:
            create = WorkPoolCreate(
                name=pool.name,
                type=pool.type,
                base_job_template=base_job_template(pool.type),
                concurrency_limit=pool.concurrency_limit,
            )
            await client.create_work_pool(create)
            done.append(f"work pool {pool.name}: created (limit {pool.concurrency_limit})")
        for q in spec.queues:
            fields = {"priority": q.priority, "concurrency_limit": q.concurrency_limit}
            try:
                existing = await client.read_work_queue_by_name(q.name, work_pool_name=pool.name)
                await client.update_work_queue(existing.id, description=q.description, **fields)
                verb = "updated"
            except ObjectNotFound:
                await client.create_work_queue(
                    q.name, description=q.description, work_pool_name=pool.name, **fields
                )
                verb = "created"
            done.append(f"work queue {q.name}: {verb} (priority {q.priority}, {fields})")
        try:
            await client.read_global_concurrency_limit_by_name(spec.gpu_limit)
            await client.update_global_concurrency_limit(
                spec.gpu_limit, GlobalConcurrencyLimitUpdate(limit=pool.gpus, active=True)
            )
            verb = "updated"
        except ObjectNotFound:
            await client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=spec.gpu_limit, limit=pool.gpus, active=True)
            )
            verb = "created"
        done.append(f"global concurrency limit {spec.gpu_limit}: {verb} ({pool.gpus} slots)")
    return done


def gpu_slots_total(limit_name: str) -> int | None:
    """Slots of the server's ``gpu`` limit, or None when it is not declared on this API."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(limit_name).limit
        except ObjectNotFound:
            return None


def admit(gpus: int, spec: SchedulerSpec | None = None) -> None:
    """Check a job against the API's ``gpu`` limit before it is submitted or starts."""
    if gpus <= 0:
        return
    name = (spec or load_scheduler()).gpu_limit
    total = gpu_slots_total(name)
    if total is None:
        raise AdmissionError(
            f"job asks for resources.gpus={gpus} but this Prefect API has no global concurrency "
            f"limit {name!r}; run `flowrl infra up` first"
        )
    check_admission(gpus, total, name)


def gpu_slots(gpus: int) -> contextlib.AbstractContextManager:
    """Hold ``gpus`` slots of the scheduler's strict ``gpu`` limit for the whole block.

    A CPU job (0) holds nothing. A job asking for more GPUs than the pool has fails at once
    (``AdmissionError``) instead of waiting forever.
    """
    if gpus <= 0:
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    spec = load_scheduler()
    admit(gpus, spec)
    # A transient API error while renewing must not kill a training job: it logs and goes on.
    return concurrency(
        spec.gpu_limit,
        occupy=gpus,
        strict=True,
        lease_duration=spec.gpu_lease_seconds,
        raise_on_lease_renewal_failure=False,
    )


_CREATING = threading.Lock()
"""Tenants starting at once in one process create their limit one after the other (a
concurrent create collides in the API's database, and the client backs off for seconds)."""


def adapter_slots(name: str, slots: int) -> contextlib.AbstractContextManager:
    """Hold one slot of the global concurrency limit ``name`` for the whole block: a shared
    base-model worker's adapter slots, which its tenants hold (waiting while all are taken).
    The limit is created with ``slots`` slots; one that exists keeps its own (an operator may
    change it in the Prefect UI). Like ``gpu_slots``, a killed holder's slot comes back when
    its lease runs out."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with _CREATING, get_client(sync_client=True) as client:  # one create at a time here
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            create = GlobalConcurrencyLimitCreate(name=name, limit=slots, active=True)
            with contextlib.suppress(ObjectAlreadyExists):  # another tenant created it first
                client.create_global_concurrency_limit(create)
    return concurrency(
        name,
        occupy=1,
        strict=True,
        lease_duration=load_scheduler().gpu_lease_seconds,
        raise_on_lease_renewal_failure=False,
    )
