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
RESUME_TAG = "flowrl-resume"
"""The tag of the deployments whose crashed runs are resumed (``prefect.yaml``)."""
RESUME_AUTOMATION = "flowrl: resume crashed jobs"
RESUME_DELAY_SECONDS = 10
ZOMBIE_AUTOMATION = "flowrl: crash runs without a heartbeat"
HEARTBEAT_SECONDS = 30
"""How often a flow run tells the API it is alive (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, set
by the stack for its worker's runs)."""
ZOMBIE_AFTER_SECONDS = 150
"""A running flow run whose process has sent no heartbeat for this long is marked CRASHED:
its process died without anyone to report it (its worker died too, or the stack went down
under it). Generous, so a Prefect server restarting under a live run does not mark it."""
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

    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Attempts of a job whose process died (SIGKILL, a lost node, a lost Ray "
        f"head): a run of a deployment tagged {RESUME_TAG!r} that ends CRASHED is scheduled "
        "again on the same flow run (Prefect's retry: same id and parameters, the run count "
        "goes up) and resumes from its last checkpoint, up to this many attempts in all. "
        "1: never resumed.",
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
    """The pool's base job template: flowrl's for Kubernetes; for a process pool, Prefect's
    with ``stream_output`` off by default. A flow-run process whose output streams through a
    pipe to its worker dies with the worker (a broken pipe at its next line), a SIGKILLed or
    restarted worker taking its running jobs with it; its lines are in the run's Prefect log
    either way (``prefect flow-run logs <id>``). A deployment may still turn it on."""
    if pool_type == "kubernetes":
        return json.loads(K8S_TEMPLATE.read_text())
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["stream_output"]["default"] = False
    return template


def _stock_process_template(template: dict[str, Any]) -> bool:
    """``template`` is Prefect's own process template, untouched (a pool flowrl made before
    ``stream_output`` was off): flowrl may replace it."""
    from prefect.workers.process import ProcessWorker

    return template == ProcessWorker.get_default_base_job_template()


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
            existing_pool = await client.read_work_pool(pool.name)
            update = WorkPoolUpdate(concurrency_limit=pool.concurrency_limit)
            if pool.type == "process" and _stock_process_template(existing_pool.base_job_template):
                update.base_job_template = base_job_template(pool.type)
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
        done.append(await _apply_resume_automation(client, spec.max_attempts))
        done.append(await _apply_zombie_automation(client))
    return done


async def _apply_zombie_automation(client: Any) -> str:
    """Prefect's documented detection of runs that died unreported ("zombies"): after a
    ``prefect.flow-run.heartbeat``, expect another (or the run's end) within
    ``ZOMBIE_AFTER_SECONDS``; if none comes, mark the run CRASHED, which frees its queue's
    slot and, for a ``RESUME_TAG`` run, lets the resume automation schedule it again."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    existing = await client.read_automations_by_name(ZOMBIE_AUTOMATION)
    for old in existing:
        await client.delete_automation(old.id)
    verb = "updated" if existing else "created"
    ends = ("heartbeat", "Completed", "Failed", "Cancelled", "Crashed")
    trigger = EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={f"prefect.flow-run.{end}" for end in ends},
        match={"prefect.resource.id": ["prefect.flow-run.*"]},
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=ZOMBIE_AFTER_SECONDS),
    )
    action = ChangeFlowRunState(
        state=StateType.CRASHED,
        message=f"flowrl: no heartbeat from the run's process for {ZOMBIE_AFTER_SECONDS} s",
    )
    automation = AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description="Mark runs whose process died unreported as CRASHED.",
        trigger=trigger,
        actions=[action],
    )
    await client.create_automation(automation)
    return f"automation {ZOMBIE_AUTOMATION!r}: {verb} ({ZOMBIE_AFTER_SECONDS} s)"


async def _apply_resume_automation(client: Any, max_attempts: int) -> str:
    """Prefect's documented way to rerun crashed flow runs: an automation whose trigger is a
    ``prefect.flow-run.Crashed`` event of a run tagged ``RESUME_TAG`` and whose action sets that
    run SCHEDULED again (as ``prefect flow-run retry`` does), while the event's run count (the
    attempts so far) is under ``max_attempts``. The worker picks it up, the run count goes up,
    and the job resumes from its checkpoint. Each attempt is in the run's state history in the
    UI. (Prefect's process worker may report one death twice; the second report can land on
    the next attempt: ``JobRun``'s fence makes the older of two live attempts step aside.)"""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    existing = await client.read_automations_by_name(RESUME_AUTOMATION)
    for old in existing:
        await client.delete_automation(old.id)
    verb = "updated" if existing else "created"
    if max_attempts <= 1:
        done = "removed" if existing else "none"
        return f"automation {RESUME_AUTOMATION!r}: {done} (max_attempts 1)"
    trigger = EventTrigger(
        # Fires RESUME_DELAY_SECONDS after the Crashed event (if the run has not started again
        # meanwhile): Prefect's process worker may report one death twice, seconds apart, and
        # the second report must find the run still CRASHED (refused, no second event), not
        # the next attempt running.
        after={"prefect.flow-run.Crashed"},
        expect={"prefect.flow-run.Running", "prefect.flow-run.Scheduled"},
        for_each={"prefect.resource.id"},
        # The cap, kept by Prefect: a Crashed event carries the run's count of attempts.
        match={
            "prefect.resource.id": "prefect.flow-run.*",
            "prefect.run-count": [str(n) for n in range(max_attempts)],
        },
        match_related={
            "prefect.resource.role": "tag",
            "prefect.resource.id": f"prefect.tag.{RESUME_TAG}",
        },
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=RESUME_DELAY_SECONDS),
    )
    action = ChangeFlowRunState(
        state=StateType.SCHEDULED,
        name="AwaitingRetry",
        message="flowrl: the job's process died; scheduled again to resume from its checkpoint",
        force=True,
    )
    automation = AutomationCore(
        name=RESUME_AUTOMATION,
        description=f"Resume jobs tagged {RESUME_TAG} that crash, up to {max_attempts} attempts.",
        trigger=trigger,
        actions=[action],
    )
    await client.create_automation(automation)
    return f"automation {RESUME_AUTOMATION!r}: {verb} (up to {max_attempts} attempts)"


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
