"""The run lifecycle every flow uses: admission and GPU slots, the job's storage context, its
MLflow run, its policy workers, progress, finish and fail (what the run shows in the Prefect UI
is ``run_page.RunPage``'s). And the stage runner."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
from prefect.logging import get_run_logger
from prefect.runtime import deployment, flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from flowrl.backends.models.lora_export import lora_export
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.policy import live
from flowrl.backends.policy.actors import PolicyRef, sampler, stop_policy, worker_nodes
from flowrl.backends.policy.placement import Placement
from flowrl.backends.policy.workers import admission_limit
from flowrl.backends.types import LoraSettings, WorkerSpec
from flowrl.environments.remote import stop_env_pool
from flowrl.environments.timeouts import (
    CallsAbandoned,
    abandon_calls,
    abandoning_calls,
    calls_abandoned,
)
from flowrl.flows.auto import auto_resources, shared_worker_settings
from flowrl.flows.engines import InfrastructureError, connect_ray, infrastructure_fault
from flowrl.flows.run_page import Column, Phase, RunPage
from flowrl.flows.run_records import RunRecords
from flowrl.infra import heap, tracking
from flowrl.infra.redact import redact, redact_text
from flowrl.infra.scheduler import gpu_slots, load_scheduler
from flowrl.infra.settings import get_settings
from flowrl.infra.storage import Storage
from flowrl.tasks.schemas import JobConfig
from flowrl.tasks.types import JobContext

OUTBOX_WAIT_ON_FAILURE_S = 30.0
TRACKING_WAIT_S = 600.0
"""How long a job starting while its tracking server does not answer waits for it (before it
holds any GPU slot) before it ends CRASHED, to be resumed."""
"""How long a failing job waits for MLflow to take its last records (the rest stay on disk for
the job's next attempt)."""


class RayStageRunner(ThreadPoolTaskRunner):
    """Prefect's thread-pool runner on a Ray driver: each stage is a Prefect task run in the
    flow process, and its work runs on Ray, as calls to the job's long-lived actors (the
    sampler and trainer, the environment actors). No stage pays a Ray task's start-up and a
    Prefect client of its own per run (~150 ms each), and no idle Ray task workers are kept.

    Entering it connects this process to Ray: the one already initialised (a notebook's, a
    test session's), else the cluster at ``FLOWRL_RAY_ADDRESS``, else a local Ray started with
    only what a job needs (``connect_ray``); it stops only a Ray it started."""

    def __init__(self, max_workers: int = 12):  # up to 8 rollouts ahead (max_staleness), + 4
        super().__init__(max_workers=max_workers)
        self._owns_ray = False
        self._stopping = False
        self.unreachable: InfrastructureError | None = None
        """Why Ray could not be reached, raised by the flow (``JobRun``), where its run
        logger says it in one line and the run ends CRASHED (``resumable``)."""

    def __enter__(self) -> RayStageRunner:
        super().__enter__()
        try:
            self._owns_ray = connect_ray()
        except InfrastructureError as err:
            self.unreachable = err
        _quiet_when_stopping()
        return self

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        if self.unreachable is not None:
            raise self.unreachable
        return super().submit(*args, **kwargs)

    def __exit__(self, *exc_info: Any) -> None:
        """Shut down a Ray it started, then wait for the stage threads. A run that is stopping
        (an exception: SIGTERM, a cancel, a failed stage) does not wait out a stage's hung
        environment calls: they are abandoned, and each stage thread ends at its next Ray or
        environment call."""
        stopping = exc_info[0] is not None or self._stopping
        try:
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()
        finally:
            with abandoning_calls() if stopping else contextlib.nullcontext():
                super().__exit__(*exc_info)
            self._stopping = False

    def stop_stages(self) -> None:
        """The job is stopping (``JobRun`` leaves on an exception, before it stops its
        workers): from now until the runner exits, the stages still running (a rollout ahead,
        the update the flow was waiting for) abandon their environment calls, and one that
        fails on a worker the job stopped logs one line, no traceback."""
        self._stopping = True
        abandon_calls()


class _StoppedStage(logging.Filter):
    """On Prefect's task-run logger: while the job is stopping, a stage's failure on a Ray call
    (its worker was stopped under it) is one line, ``... (its job is stopping)``; the job's own
    reason is what its log says last. Any other failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if calls_abandoned() and _worker_gone(exc):
            record.msg, record.args = f"{record.getMessage()} (its job is stopping)", ()
            record.exc_info = record.exc_text = None
        return True


def _worker_gone(exc: BaseException | None) -> bool:
    """A stage's failure because the job stopped a worker under it: a Ray error, an abandoned
    call, or the lookup of a named worker already stopped (Ray's ``ValueError``)."""
    lookup = isinstance(exc, ValueError) and str(exc).startswith("Failed to look up actor")
    return lookup or isinstance(exc, ray.exceptions.RayError | CallsAbandoned)


def _quiet_when_stopping() -> None:
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _StoppedStage) for f in logger.filters):
        logger.addFilter(_StoppedStage())


def resumable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A job flow whose platform fails under it (``infrastructure_fault``: the Ray head does
    not answer, Ray lost its workers) logs one line saying so and ends CRASHED, not FAILED: the
    stack's automation schedules a crashed run of a ``flowrl-resume`` deployment again, and it
    resumes from its last checkpoint (``infra/scheduler.py``). A failure of the job itself (a
    bad config, an error in its environment) still ends FAILED."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from prefect.states import Crashed

        try:
            return fn(*args, **kwargs)
        except Exception as err:
            reason = infrastructure_fault(err)
            if reason is None:
                raise
            get_run_logger().error("crashed: %s", reason)
            return Crashed(message=f"flowrl: {reason}")

    # Prefect builds the flow's parameter model from the signature: give it the annotations
    # resolved in the flow's own module (they are strings there, names unknown here).
    run.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return run


def _attempt() -> tuple[int, int]:
    """This run's attempt (1, then 2, ... after each crash the automation resumed: Prefect's
    run count) and the scheduler's ``max_attempts``."""
    return max(1, int(flow_run.get_run_count() or 1)), load_scheduler().max_attempts


FENCE_SECONDS = 5.0
"""How often an attempt of a deployment run checks that no newer attempt has started."""


class AttemptFence:
    """The older of two live attempts of one flow run steps aside.

    Prefect's process worker may report one death of a run's process twice; the second report
    can land on the next attempt while it runs, and the resume automation then starts another
    beside it. So every attempt of a deployment run watches the run's attempt count in the
    API (a thread, every ``FENCE_SECONDS``): once a newer attempt has started, this one exits
    at once with status 0, which nothing reports as a crash, touching neither the run's state
    nor its storage. An attempt after the first waits out two watch periods before it starts
    anything, so an older attempt that is still alive has gone by then."""

    def __init__(self, run_id: str, attempt: int):
        self.run_id, self.attempt = run_id, attempt
        self._stop = threading.Event()
        self._logger = get_run_logger()
        threading.Thread(target=self._watch, name="attempt-fence", daemon=True).start()

    def _current(self) -> int | None:
        from uuid import UUID

        from prefect import get_client

        try:
            with get_client(sync_client=True) as client:
                return client.read_flow_run(UUID(self.run_id)).run_count
        except Exception:  # noqa: BLE001 - the API down: carry on, look again later
            return None

    def _watch(self) -> None:
        while not self._stop.wait(FENCE_SECONDS):
            current = self._current()
            if current is not None and current > self.attempt:
                line = f"attempt {current} of this run has started: attempt {self.attempt} stops"
                with contextlib.suppress(Exception):
                    self._logger.warning(line)
                print(f"flowrl: {line}", file=sys.stderr, flush=True)
                os._exit(0)

    def settle(self) -> None:
        """Wait two watch periods (see the class)."""
        time.sleep(2 * FENCE_SECONDS)

    def stop(self) -> None:
        self._stop.set()


def attempt_check() -> int:
    """This run's attempt; a run past the scheduler's ``max_attempts`` stops here, FAILED."""
    attempt, cap = _attempt()
    if attempt > cap:
        raise RuntimeError(
            f"attempt {attempt}: this job crashed {attempt - 1} times and is not resumed again "
            f"(max_attempts {cap} in the scheduler declaration)"
        )
    return attempt


def task_runner() -> RayStageRunner:
    """The stage runner every flow uses (``RayStageRunner``)."""
    return RayStageRunner()


def _wait_for_tracking(say: Callable[[str], None], wait_s: float = TRACKING_WAIT_S) -> None:
    """Wait until the tracking server answers, saying so at once and then each minute; raise
    ``InfrastructureError`` after ``wait_s`` (MLflow's client would retry each call for
    minutes, saying nothing)."""
    if tracking.reachable():
        return
    uri = get_settings().tracking_uri
    began = said = time.monotonic()
    say(f"waiting for the tracking server at {uri}: it does not answer")
    while not tracking.reachable():
        now = time.monotonic()
        if now - began > wait_s:
            raise InfrastructureError(
                f"the tracking server at {uri} does not answer (waited {now - began:.0f} s)"
            )
        if now - said >= 60:
            said = now
            say(f"waiting for the tracking server at {uri}: {now - began:.0f} s so far")
        time.sleep(2.0)
    say(f"the tracking server answers after {time.monotonic() - began:.0f} s")


class JobRun:
    """One run of a job of any kind, from admission to finish or failure.

    Entering it, in this order: settings reach the environment; the job's ``resources.gpus``
    slots of the scheduler's ``gpu`` limit are held (a job that could never start is refused
    here); its storage context; its MLflow run, with ``job.json`` beside the job's files
    (``resume=True``: the run of an earlier submission of the same job name is continued).
    Leaving it: every worker it started is stopped, an exception marks the MLflow run FAILED,
    and only then are the GPU slots given back, so no actor outlives its slots.
    """

    def __init__(self, config: JobConfig, resume: bool = False, columns: tuple[Column, ...] = ()):
        self.config = config
        self.resume = resume
        settings = get_settings()
        owner = f"{settings.namespace}-" if settings.namespace else ""
        self.ctx = JobContext(
            name=config.name,
            storage_url=settings.storage_root,
            cache_dir=settings.model_cache_dir,
            run_name=f"{owner}{config.name}-{(flow_run.get_id() or 'local')[:8]}",
            namespace=settings.namespace,
        )
        self.storage = Storage(self.ctx.storage_url)
        self.run_id = ""
        self.done_steps = 0
        self._policies: list[PolicyRef] = []
        self._published = False
        self._admitted: set[str] = set()  # shared workers whose adapter slot the run holds
        self._exits = contextlib.ExitStack()
        self.page = RunPage(config.name, f"{settings.namespace or ''}-{config.name}", columns)
        """What the run shows in the Prefect UI: its log lines, progress and artifacts; its
        ``columns`` make the job's results table, step lines and curve (none: a table of
        ``finish(table=)`` metrics, no step lines)."""
        self.records = RunRecords(self.page, self.say)  # to MLflow, through a durable outbox

    def __enter__(self) -> JobRun:
        get_settings().apply_to_environment()
        runner = _current_runner()
        if runner is not None and runner.unreachable is not None:
            raise runner.unreachable  # before any slot is held: no GPU waits on a dead head
        attempt = attempt_check()
        with contextlib.ExitStack() as entering:
            run_id = flow_run.get_id()
            if run_id is not None and deployment.get_id() is not None:
                fence = AttemptFence(run_id, attempt)
                entering.callback(fence.stop)
                if attempt > 1:
                    cap = load_scheduler().max_attempts
                    self.say(f"attempt {attempt} of {cap}: resuming after a crash")
                    fence.settle()
            _wait_for_tracking(self.say)  # before any slot is held
            # A shared worker's tenant holds an adapter slot (``_admit``); the worker, its GPUs.
            entering.enter_context(gpu_slots(self.placement().run_gpu_slots))
            entering.callback(self._stop_workers)  # runs first on exit: workers, then slots
            self.run_id = self._start_tracking()
            self._exits = entering.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        runner = _current_runner()
        if exc_type is not None and runner is not None:
            runner.stop_stages()  # before any worker stops under a stage still running
        try:
            if exc_type is None:
                self.flush_metrics()
            else:  # a failing job waits a little for MLflow; what is left waits on disk
                with contextlib.suppress(Exception):
                    self.flush_metrics(timeout=OUTBOX_WAIT_ON_FAILURE_S)
                with contextlib.suppress(Exception):
                    tracking.end_run(self.run_id, status="FAILED")
        finally:
            self.records.close()
            self._exits.__exit__(exc_type, exc, tb)

    def _start_tracking(self) -> str:
        job_file = f"{self.ctx.prefix}/job.json"
        previous = None
        if self.resume and self.storage.exists(job_file):
            previous = self.storage.read_json(job_file).get("mlflow_run_id")
        params = redact(self.config.model_dump(mode="json"))
        run_id = tracking.start_run(
            self.config.experiment, self.config.name, params, previous, self.ctx.namespace
        )
        self.records.open(run_id, continued=run_id == previous, warn=_thread_safe_say())
        self.storage.write_json(job_file, {"mlflow_run_id": run_id, "config": params})
        return run_id

    def _stop_workers(self) -> None:
        self._stop_policies()
        env = getattr(self.config, "env", None)
        if env is not None and env.mode == "ray":  # the job's detached environment actors
            stop_env_pool(f"{self.ctx.run_name}-envs", env.ray_actors)
        self.page.close()

    # ------------------------------------------------------------------------- workers

    def _admit(self, placement: Placement, base_uri: str) -> None:
        """Where the placement puts the job's policy on a shared worker (``resources.placement``
        shared), hold one adapter slot of the shared worker of ``base_uri`` (the model the
        job's adapter trains on; ``Placement.admission``) for the rest of the run, waiting
        while all are taken; the job's workers leave the shared worker before the slot is given
        back. Once per worker; nothing for a job with workers of its own. ``start_policy``
        admits the job before it joins."""
        spec = self._spec(base_uri)
        worker = placement.shared_worker(spec)
        if worker is None or worker in self._admitted:
            return
        self._admitted.add(worker)
        limit = admission_limit(worker)
        self.say(f"waiting for an adapter slot of shared worker {worker} (limit {limit})")
        began = time.monotonic()
        self._exits.enter_context(placement.admission(spec))
        self._exits.callback(self._stop_policies)  # leave the worker, then free the slot
        self.say(f"adapter slot of {worker} held after {time.monotonic() - began:.1f} s")

    def _stop_policies(self) -> None:
        """Stop every policy the run started (idempotent; a shared tenant leaves its worker),
        the job's record of its running policy withdrawn first (``backends.policy.live``)."""
        if self._published:
            self._published = False
            with contextlib.suppress(OSError):  # the workers stop whatever the storage says
                live.withdraw(self.storage, self.ctx.prefix)
        for policy in self._policies:
            stop_policy(policy)

    def _spec(self, model_uri: str, lora: LoraSettings | None = None) -> WorkerSpec:
        settings = self.config.worker_settings() | ({"lora": lora} if lora else {})
        return WorkerSpec(
            model_uri=model_uri,
            cache_dir=self.ctx.cache_dir,
            seed=self.config.seed,
            dtype=self.config.resources.dtype,
            **settings,
        )

    def placement(self) -> Placement:
        """Where the job's policies live (``config.placement_for``), a shared worker found or
        started with this run's ``shared_worker_settings``."""
        return self.config.placement_for(shared_worker_settings())

    def pick_sampler(self, model_uri: str) -> JobConfig:
        """The job's config with its ``resources``' autos decided for the model ``model_uri``
        (``auto_resources``), each said in the job's log and as MLflow tags; the config as it
        is where nothing is auto. The job's placements use the picks from then on
        (``start_policy`` picks for its model if the flow has not): call it before a stage
        places workers of its own (warm-up)."""
        self.config, said = auto_resources(self.config, model_uri, self.ctx.cache_dir)
        for line, tags in said:
            self.say(line)
            self.set_tags(tags)
        return self.config

    def start_model(self, model_uri: str) -> PolicyRef:
        """The policy that serves the model ``model_uri`` as the job's placement says: workers
        of its own, or (``Placement.adapters_on_base``: a shared worker's tenant) the
        version's LoRA adapter on the shared worker of its base (``start_lora_version``)."""
        if self.placement().adapters_on_base:
            return self.start_lora_version(model_uri)
        return self.start_policy(model_uri)

    def start_lora_version(self, model_uri: str) -> PolicyRef:
        """A tenant of the shared worker of the base a LoRA version was trained on, sampling
        with the version's own adapter (batch inference with ``resources.placement``
        shared); the adapter slot is held for the rest of the run (``_admit``)."""
        meta = lora_export(resolve_model_uri(model_uri, self.ctx.cache_dir))
        if meta is None:
            raise ValueError(
                f"{model_uri} keeps no LoRA adapter (a full-parameter version, or one "
                "registered before versions kept their adapter), so it cannot run on a shared "
                "worker of its base: use resources.placement own"
            )
        base = meta["base_model"]
        self.say(f"model: a LoRA adapter on {base}")
        policy = self.start_policy(base, lora=LoraSettings(**meta["lora"]))
        sampler(policy).load_lora_export(model_uri)
        return policy

    def start_policy(
        self,
        model_uri: str,
        name: str | None = None,
        adopt: PolicyRef | None = None,
        lora: LoraSettings | None = None,
    ) -> PolicyRef:
        """Start a policy's workers with the job's resources, backends and optimiser settings
        (named ``name``, default the run name); they are stopped when the run ends. With
        ``adopt`` (warm-up's running workers, ``WarmupResult.workers``) those workers are
        restarted from ``model_uri`` instead, in their processes, as new ones would start;
        where a backend cannot restart they are stopped and new ones start. The Ray node of
        each is a tag of the MLflow run (``node/sampler-0``, ``node/trainer``). ``lora``: the
        policy's LoRA settings, if not the job's (``start_lora_version``)."""
        self.pick_sampler(model_uri)
        spec = self._spec(model_uri, lora)
        placement = self.placement()
        self._admit(placement, model_uri)  # a shared worker's tenant: its slot, before it joins
        policy = None
        if adopt is not None:
            self._policies.append(adopt)  # stopped with the run, whatever happens next
            if placement.adopt(adopt, spec):
                policy = adopt
                get_run_logger().info("policy workers: warm-up's, restarted from %s", model_uri)
            else:
                stop_policy(adopt)
        if policy is None:
            policy = placement.start_policy(name or self.ctx.run_name, spec)
            self._policies.append(policy)
        described = policy.describe()
        if described is not None:
            get_run_logger().info("policy: %s", described)
        prefix = f"{name}/" if name else ""
        nodes = worker_nodes(policy)
        tags = {f"node/{prefix}trainer": nodes[policy.trainer]}
        tags |= {f"node/{prefix}sampler-{i}": nodes[s] for i, s in enumerate(policy.samplers)}
        self.set_tags(tags)  # where each worker runs, on the MLflow run
        if name is None:  # the job's policy: served as `job:<name>` while it runs
            live.publish(self.storage, self.ctx.prefix, policy, model_uri)
            self._published = True
        return policy

    # ------------------------------------------------------------------------ progress

    def say(self, line: str) -> None:
        """One line of the run's log (``RunPage.say``)."""
        self.page.say(line)

    def phase(self, name: str, start: str = "started") -> contextlib.AbstractContextManager[Phase]:
        """Log a phase of the job as it begins and ends (``RunPage.phase``)."""
        return self.page.phase(name, start)

    def steps(self, start: int, total: int, stride: int = 1) -> Iterator[int]:
        """The first step of each chunk of ``stride`` steps from ``start`` to ``total``, with a
        progress bar and a Prefect progress artifact (``advance`` moves both)."""
        self.page.start_steps(start, total)
        self.done_steps = start
        with heap.frozen_heap():  # no long pauses of the garbage collector in the steps
            yield from range(start, total, stride)

    def advance(self, done_steps: int, **postfix: float) -> None:
        """``done_steps`` steps are done (call it after the step's evaluation, if any): the
        progress, and the step's log line and the curve when due (``RunPage.advance``)."""
        before, self.done_steps = self.done_steps, done_steps
        self.page.advance(before, done_steps, postfix)

    # ------------------------------------------------------------------------- records

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` to the MLflow run, asynchronously and in order: written
        every ``METRIC_WRITE_STEPS`` calls or ``METRIC_WRITE_SECONDS``, whichever comes first,
        and all of them before a checkpoint (``flush_metrics``) and before the run finishes or
        fails. A continued run skips what it logged before at that step (or later)."""
        self.records.log(metrics, step)

    def log_json(self, payload: Any, artifact_file: str) -> None:
        """Write ``payload`` as a JSON artifact of the MLflow run, in the background like
        ``log``."""
        self.records.put({"kind": "json", "payload": payload, "file": artifact_file})

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tags of the MLflow run, in the background like ``log``."""
        self.records.put({"kind": "tags", "tags": tags})

    def flush_metrics(self, wait: bool = True, timeout: float | None = None) -> None:
        """Put every metric logged so far into the outbox (on disk: a job killed after this
        and resumed on this machine loses none of them); with ``wait``, also wait until MLflow
        has them all, for as long as the server takes to come back (or ``timeout`` seconds),
        raising an error MLflow answered. Before a checkpoint: no wait; before the job
        registers its version or ends: wait."""
        self.records.flush(wait, timeout)

    def finish(
        self,
        result: Any,
        plot: str = "reward_curve.svg",
        table: tuple[str, ...] = (),
    ) -> None:
        """The job succeeded: draw its plotted columns into the MLflow run's ``plot`` artifact
        and the last ``<job>-curve``, write the result (a dataclass) as ``result.json`` beside
        ``job.json``, give the Prefect run its artifacts (``RunPage.publish``: a results table
        of the job's columns by step, or for a job without columns its ``table`` metrics), end
        the MLflow run."""
        self.flush_metrics()
        page = self.page
        if any(c.plot for c in page.columns):
            tracking.log_curve(self.run_id, page.curves(), plot)
            page.draw_curve(f"final: {self.done_steps} steps", wait=True)
        record = redact(dataclasses.asdict(result))
        self.storage.write_json(f"{self.ctx.prefix}/result.json", record)
        rows = page.results_table() if page.columns else tracking.metric_table(self.run_id, table)
        page.publish(record, rows, self.run_id, tracking.run_url(self.run_id))
        tracking.end_run(self.run_id)


def _thread_safe_say() -> Callable[[str], None]:
    """A warning line of this run's log that any thread may write (the run logger is looked
    up here, where the run's context is; outside a run, flowrl's own logger)."""
    import logging

    from prefect.exceptions import MissingContextError

    try:
        logger: Any = get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("flowrl")
    return lambda line: logger.warning(redact_text(line))


def _current_runner() -> RayStageRunner | None:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    runner = getattr(context, "task_runner", None)
    return runner if isinstance(runner, RayStageRunner) else None


def due(step: int, total: int, every: int, at_end: bool = False) -> bool:
    """Whether a periodic stage runs after ``step``; ``at_end`` adds the last step."""
    last = step + 1 == total
    return (at_end and last) or ((step + 1) % every == 0 and not last)


@dataclasses.dataclass
class StepClock:
    """Wall time between consecutive steps, to report what orchestration costs beyond the
    stages' own work (``time/overhead_s``)."""

    last: float = dataclasses.field(default_factory=time.perf_counter)

    def lap(self) -> float:
        now = time.perf_counter()
        wall, self.last = now - self.last, now
        return wall
