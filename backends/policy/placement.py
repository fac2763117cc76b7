"""Where a policy's weights live: one ``Placement`` hierarchy for jobs and the Tinker API.

A placement is a small frozen value, chosen once from configuration
(``tasks.schemas.ResourcesSection.placement_for`` for every job kind;
``backends.services.tinker.server.placement_for`` for the Tinker API's ``--placement``), then asked
to start what it holds:

- ``start_policy(name, spec) -> PolicyRef``: a job's policy, its samplers and trainer
  (``backends.policy.actors``); ``adopt(ref, spec)`` builds running workers again in their processes
  (warm-up's, handed to the job);
- ``start_model(spec) -> ModelHandle``: a Tinker API training model (``backends.services.tinker``).

The kinds, each with what it starts for a job and for the Tinker API:

- ``InProcess``: ``LocalPolicy``; a ``TinkerModel`` on this process's ``SharedBase``;
- ``OwnWorkers``: ``SplitPolicy`` or ``ColocatedPolicy``; a ``tinker-session`` run's actor;
- ``SharedTenant``: ``SharedPolicy``; an adapter on the base model's shared worker;
- ``VLLMEngines``: no job policy; a Tinker sampling model on a vLLM engine's actor
  (``--sampler-engine vllm``).

How the workers are built (backends, threads, precision, what each asks the cluster for) is a
``WorkerBuild`` the placement holds. Callers never branch on the kind: what differs (the GPU
slots a run holds itself, admission to a shared worker, how a registered version is served) is
asked of the placement.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from flowrl.backends.policy.resources import (
    SAMPLER_BACKENDS,
    TINKER_VLLM_BACKEND,
    TRAINER_BACKENDS,
    ActorResources,
    SharedWorkerSettings,
    pick_backend,
    pick_threads,
    role_specs,
    shared_worker_name,
)
from flowrl.backends.types import ModelTenancy, Precision, WorkerSpec
from flowrl.infra import ray_auth
from flowrl.infra.settings import RAY_NAMESPACE, get_settings

if TYPE_CHECKING:
    from flowrl.backends.policy.actors import PolicyRef
    from flowrl.backends.policy.tinker_handles import ModelHandle

SESSION_START_TIMEOUT_S = 900.0
"""How long a Tinker model on ``OwnWorkers`` waits for its session run's actor."""


@dataclass(frozen=True)
class WorkerBuild:
    """How a policy's workers are built, wherever they live: the backends (by name,
    ``backends.policy.actors.SAMPLER_BACKENDS`` / ``TRAINER_BACKENDS``), what each worker asks the
    cluster for, torch's threads and the precision. ``torch_threads`` and ``dtype`` left None
    keep the spec's own; the trainer runs ``trainer_threads`` (None: the samplers')."""

    resources: ActorResources = ActorResources()
    sampler_backend: str = "hf"
    trainer_backend: str = "torch"
    torch_threads: int | None = None
    dtype: Precision | None = None
    trainer_threads: int | None = None
    threads_why: str = ""  # what resources.torch_threads auto went by, when it decided

    def threads(self) -> str:
        """The workers' torch threads, in words (the job's log)."""
        trainer = self.trainer_threads or self.torch_threads
        return f"sampler {self.torch_threads}, trainer {trainer}"

    def specs(self, spec: WorkerSpec) -> dict[str, WorkerSpec]:
        """The sampler's and the trainer's spec: ``spec`` with this build's threads and
        precision."""
        updates = {"torch_threads": self.torch_threads, "dtype": self.dtype}
        spec = spec.model_copy(update={k: v for k, v in updates.items() if v is not None})
        return role_specs(spec, self.trainer_threads)

    def paths(self) -> dict[str, str]:
        """The ``module:Class`` of each role's backend (an unknown name raises)."""
        return {
            "sampler": pick_backend(SAMPLER_BACKENDS, self.sampler_backend, "sampler"),
            "trainer": pick_backend(TRAINER_BACKENDS, self.trainer_backend, "trainer"),
        }


class SessionRuns(Protocol):
    """How ``OwnWorkers`` starts a Tinker model's session run and follows it. The flow layer's
    (``flows.tinker_session.DeploymentRuns``): a backend never names a deployment."""

    def submit(self, config: dict[str, Any]) -> str:
        """Submit a run of the session flow with this ``TinkerSessionConfig``; its id."""
        ...

    def state(self, run_id: str) -> tuple[str, str]:
        """The run's state name (``RUNNING``, ``FAILED``, …) and message."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where a policy's or a Tinker model's weights live (see the module docstring). A kind
    that cannot hold one of them raises ``ValueError`` naming itself."""

    build: WorkerBuild = WorkerBuild()

    kind: ClassVar[str] = "placement"
    """The placement's name in messages."""
    adapters_on_base: ClassVar[bool] = False
    """A registered LoRA version is served as its adapter on its base model's worker (True),
    not as a model of its own (``flows.lifecycle.JobRun.start_model``)."""

    def start_policy(self, name: str, spec: WorkerSpec) -> PolicyRef:
        """Start a policy's samplers and trainer, named after ``name``, built from ``spec``
        (``build.specs``), and wait until all hold their weights."""
        raise ValueError(f"a {self.kind} placement cannot hold a job's policy")

    def adopt(self, ref: PolicyRef, spec: WorkerSpec) -> bool:
        """Build the running workers of ``ref`` (started by this placement, e.g. for warm-up)
        again from ``spec``, in their processes, as ``start_policy`` would build new ones. False
        (nothing changed) when a backend cannot restart (``restartable``)."""
        return ref.restart(self.build.specs(spec))

    def start_model(self, spec: dict[str, Any]) -> ModelHandle:
        """A new Tinker training model from ``spec`` (model_id, namespace, base_model,
        base_uri, lora: its ``LoraSettings``, seed: the model's or None, generation: how
        many times the service has made it again)."""
        raise ValueError(f"a {self.kind} placement cannot hold a Tinker model")

    def find_model(self, model_id: str, generation: int = 0) -> ModelHandle | None:
        """The running Tinker model ``model_id`` (of ``generation``) that this placement
        started for a service that has since restarted; None where models die with the
        service (its process)."""
        return None

    @property
    def run_gpu_slots(self) -> int:
        """GPU slots of the scheduler's ``gpu`` limit the run that holds this placement takes
        itself, for its whole run."""
        return 0

    def shared_worker(self, spec: WorkerSpec) -> str | None:
        """The shared worker a policy of ``spec`` joins (its adapter slots admit it:
        ``admission``); None when its workers are its own."""
        return None

    def admission(self, spec: WorkerSpec) -> contextlib.AbstractContextManager:
        """Admission of a policy of ``spec``, held while the context is: one adapter slot of its
        shared worker (``backends.policy.workers.admission``); nothing to wait for with workers of
        its own."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class InProcess(Placement):
    """The weights in this process, without Ray: a job's sampler and trainer as objects
    (``LocalPolicy``: notebooks, benchmarks, tests); Tinker models as LoRA tenants of one
    ``SharedBase`` per base model (development, tests, the service's own samplers): the base
    weights loaded once, each model holding only its adapter, AdamW state and RNG; with
    ``resident_adapters`` at most that many adapters resident, the least recently used parked
    and restored exactly. ``cache_dir``: where base models are resolved (None: the
    settings')."""

    samplers: int = 1
    cache_dir: str | None = None
    resident_adapters: int | None = None
    bases: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)
    """The loaded ``SharedBase`` of each base model's folder."""
    lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, compare=False, repr=False
    )

    kind: ClassVar[str] = "in-process"

    def start_policy(self, name: str, spec: WorkerSpec) -> PolicyRef:
        from flowrl.backends.policy.actors import LocalPolicy

        return LocalPolicy.start(name, self.build.paths(), self.build.specs(spec), self.samplers)

    def start_model(self, spec: dict[str, Any]) -> ModelHandle:
        from flowrl.backends.engines.tinker.model import TinkerModel
        from flowrl.backends.policy.tinker_handles import LocalHandle

        base = self.base(spec["base_uri"])
        return LocalHandle(TinkerModel(base, spec["lora"], spec["seed"], name=spec["model_id"]))

    def base(self, uri: str) -> Any:
        """The shared base of a catalogue URI (loaded on first use)."""
        from flowrl.backends.engines.tinker.model import SharedBase
        from flowrl.backends.models.tinker_checkpoints import resolve_base_model

        path = resolve_base_model(uri, self.cache_dir or get_settings().model_cache_dir)
        with self.lock:
            if path not in self.bases:
                self.bases[path] = SharedBase(path, resident=self.resident_adapters)
            return self.bases[path]


@dataclass(frozen=True)
class OwnWorkers(Placement):
    """The weights in Ray actors of the policy's own, holding ``gpus`` slots of the scheduler's
    ``gpu`` limit for the run. A job's policy: ``samplers`` sampler actors and a trainer actor
    (``SplitPolicy``), or with ``colocate`` and one sampler both roles in one actor
    (``ColocatedPolicy``). A Tinker model: a run of the ``tinker-session`` flow, submitted
    through ``runs`` (the flow layer's), whose Ray actor holds it
    (``backends.engines.tinker.actor``)."""

    samplers: int = 1
    colocate: bool = False
    gpus: int = 0
    runs: SessionRuns | None = field(default=None, compare=False, repr=False)

    kind: ClassVar[str] = "own-workers"

    @property
    def run_gpu_slots(self) -> int:
        return self.gpus

    def start_policy(self, name: str, spec: WorkerSpec) -> PolicyRef:
        from flowrl.backends.policy.actors import ColocatedPolicy, SplitPolicy

        paths, specs = self.build.paths(), self.build.specs(spec)
        options = {
            "namespace": RAY_NAMESPACE,
            "num_cpus": self.build.resources.num_cpus,
            "num_gpus": self.build.resources.num_gpus,
            "max_concurrency": 1,
        }
        if self.colocate and self.samplers == 1:
            return ColocatedPolicy.start(name, paths, specs, options)
        return SplitPolicy.start(name, paths, specs, options, self.samplers)

    def start_model(self, spec: dict[str, Any]) -> ModelHandle:
        """Submit the model's session run (``resources.gpus``: ``gpus``) and wait until its
        actor answers."""
        import ray

        from flowrl.backends.engines.tinker.actor import actor_name
        from flowrl.backends.policy.tinker_handles import RayHandle, connect_service_ray

        if self.runs is None:
            raise ValueError(
                f"a {self.kind} placement holds a Tinker model in a session run: it needs the "
                "flow layer's runs (flows.tinker_session.DeploymentRuns)"
            )
        connect_service_ray()
        model_id, generation = spec["model_id"], spec.get("generation", 0)
        run_id = self.runs.submit(self._session_config(spec))
        deadline = time.monotonic() + SESSION_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor(actor_name(model_id, generation), namespace=RAY_NAMESPACE)
                return RayHandle(actor, run_id, ray.get(actor.info.remote(), timeout=60))
            except ValueError:  # not started yet
                pass
            state, message = self.runs.state(run_id)
            if state in ("FAILED", "CRASHED", "CANCELLED", "COMPLETED"):
                raise RuntimeError(
                    f"session run {run_id} ended {state} before its model was ready: {message}"
                )
            time.sleep(0.5)
        raise TimeoutError(
            f"session run {run_id} did not start its model in {SESSION_START_TIMEOUT_S} s"
        )

    def find_model(self, model_id: str, generation: int = 0) -> ModelHandle | None:
        """The session run's actor of ``model_id`` (of ``generation``), if it still runs (it
        outlives the service's process)."""
        import ray

        from flowrl.backends.engines.tinker.actor import actor_name
        from flowrl.backends.policy.tinker_handles import RayHandle, connect_service_ray

        connect_service_ray()
        try:
            actor = ray.get_actor(actor_name(model_id, generation), namespace=RAY_NAMESPACE)
            return RayHandle(actor, None, ray.get(actor.info.remote(), timeout=60))
        except (ValueError, ray.exceptions.RayError):
            return None

    def _session_config(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The ``TinkerSessionConfig`` of a model's session run."""
        model_id = spec["model_id"]
        return {
            "name": f"tinker-{model_id.split(':')[0]}-{model_id.rsplit(':', 1)[-1]}",
            "experiment": "tinker",
            "model_id": model_id,
            "base_model": spec["base_model"],
            "base_uri": spec["base_uri"],
            "lora": spec["lora"].model_dump(mode="json"),
            # The model's seed; a Tinker client that sets none gets a random one, drawn here.
            "seed": secrets.randbits(62) if spec["seed"] is None else spec["seed"],
            "owner": spec["namespace"],
            "generation": spec.get("generation", 0),
            "resources": {"gpus": self.gpus},
        }


@dataclass(frozen=True)
class SharedTenant(Placement):
    """The weights on the shared base-model worker of the base model
    (``backends.engines.shared_worker``, a Ray actor): the base held once for every tenant, each
    tenant holding its LoRA adapters,
    optimiser state and RNG there. A job's policy is a ``SharedPolicy`` (its sampler and
    trainer two adapters), a Tinker model one adapter; both are admitted the same way, by one
    adapter slot of the worker's Prefect limit ``adapter-slots-<worker>`` (``admission``: a job's
    run holds it for the run, a Tinker model while it is loaded). The worker holds its own GPU
    slots, once, so the run holds none. ``worker``: how the worker is found or started (None:
    the settings', ``FLOWRL_SHARED_*``, read when a tenant joins); ``cache_dir``: where a Tinker
    model's base is resolved (None: the settings')."""

    worker: SharedWorkerSettings | None = None
    cache_dir: str | None = None

    kind: ClassVar[str] = "shared-tenant"
    adapters_on_base: ClassVar[bool] = True

    def start_policy(self, name: str, spec: WorkerSpec) -> PolicyRef:
        """Join the worker of ``spec``'s base model, starting it if none runs (admission is
        the caller's: ``admission``)."""
        from flowrl.backends.policy.actors import SharedPolicy

        return SharedPolicy.start(
            name, self.build.specs(spec), self._worker(), self.build.resources
        )

    def start_model(self, spec: dict[str, Any]) -> ModelHandle:
        """Wait for an adapter slot, then join the model to its base's worker; the handle gives
        the slot back when it closes."""
        import ray

        from flowrl.backends.models.tinker_checkpoints import resolve_base_model
        from flowrl.backends.policy.tinker_handles import SharedModelHandle, connect_service_ray
        from flowrl.backends.policy.workers import join_shared_worker

        connect_service_ray()
        cache_dir = self.cache_dir or get_settings().model_cache_dir
        base = WorkerSpec(
            model_uri=resolve_base_model(spec["base_uri"], cache_dir), cache_dir=cache_dir
        )
        slot = contextlib.ExitStack()
        slot.enter_context(self.admission(base))
        try:
            tenancy = ModelTenancy(spec["lora"], spec["seed"])
            worker, info = join_shared_worker(
                base, self._worker(), self.build.resources, spec["model_id"], tenancy
            )
        except BaseException:
            slot.close()
            raise
        actor = ray.get_actor(worker, namespace=RAY_NAMESPACE)
        return SharedModelHandle(actor, worker, spec["model_id"], info, slot)

    def shared_worker(self, spec: WorkerSpec) -> str | None:
        return shared_worker_name(self.build.specs(spec)["trainer"])

    def admission(self, spec: WorkerSpec) -> contextlib.AbstractContextManager:
        from flowrl.backends.policy.workers import admission

        base = self.build.specs(spec)["trainer"]
        return admission(base, get_settings().shared_adapter_slots)

    def _worker(self) -> SharedWorkerSettings:
        return self.worker or SharedWorkerSettings.from_settings()


@dataclass(frozen=True)
class VLLMEngines(Placement):
    """The Tinker API's sampling models on vLLM (``flowrl serve tinker --sampler-engine
    vllm``): each (base model, adapter shape) one vLLM engine in a Ray actor on vLLM's venv
    (``backends.engines.tinker.vllm_sampling``), which samples saved adapters by key. It holds
    sampling models only: a training model's placement is another. ``cache_dir``: where base
    models are resolved (None: the settings'). Ray: the settings' cluster, else a private
    local one started here."""

    cache_dir: str | None = None

    kind: ClassVar[str] = "vllm-engines"

    def start_model(self, spec: dict[str, Any]) -> ModelHandle:
        import ray

        from flowrl.backends.models.tinker_checkpoints import resolve_base_model
        from flowrl.backends.policy.tinker_handles import EngineHandle, connect_service_ray
        from flowrl.backends.policy.workers import start_sampler_actor

        if not ray.is_initialized():
            if get_settings().ray_address is not None:
                connect_service_ray()
            else:
                ray_auth.ensure_token()
                ray.init(
                    address="local",
                    include_dashboard=False,
                    namespace=RAY_NAMESPACE,
                    log_to_driver=False,
                )
        cache_dir = self.cache_dir or get_settings().model_cache_dir
        worker = WorkerSpec(
            model_uri=resolve_base_model(spec["base_uri"], cache_dir),
            cache_dir=cache_dir,
            lora=spec["lora"],
            seed=spec["seed"] or 0,
        )
        worker = self.build.specs(worker)["sampler"]
        name = f"tinker-vllm-{spec['model_id']}-{secrets.token_hex(3)}"
        actor = start_sampler_actor(name, TINKER_VLLM_BACKEND, worker, self.build.resources)
        return EngineHandle(actor)


PLACEMENTS = ("own", "shared", "local", "sessions", "vllm-engines")
"""The placements ``place`` makes: a job's ``resources.placement`` (own, shared), the Tinker
API's ``--placement`` (local, sessions, shared) and ``--sampler-engine vllm`` (vllm-engines)."""


def place(
    kind: str,
    *,
    gpus: int | None = None,
    gpus_per_worker: float = 0.0,
    samplers: int = 1,
    colocate: bool | None = None,
    on_policy: bool = True,
    sampler_backend: str = "hf",
    trainer_backend: str = "torch",
    torch_threads: int | Literal["auto"] | None = None,
    dtype: Precision | None = None,
    trainer_threads: int | None = None,
    resources: ActorResources | None = None,
    shared_worker: SharedWorkerSettings | None = None,
    session_runs: SessionRuns | None = None,
    resident_adapters: int | None = None,
) -> Placement:
    """The one place that turns resources into a ``Placement``; a job's config
    (``ResourcesSection.placement_for``), the Tinker API's flags and ``actors.start_policy``
    all ask it.

    - ``own``: ``OwnWorkers``. ``colocate`` None decides by itself: one actor for both roles
      when the policy is ``on_policy`` with one sampler on the hf and torch backends. The
      run's ``gpus`` slots are split evenly between its workers (a colocated policy's one
      actor holds them all) unless ``gpus_per_worker`` is set.
    - ``shared``: ``SharedTenant`` of the worker ``shared_worker`` finds or starts (the
      settings' when None); ``gpus``, if given, are the worker's slots, held once for all its
      tenants.
    - ``local``: ``InProcess`` (``resident_adapters``: Tinker adapters kept resident).
    - ``sessions``: ``OwnWorkers`` whose Tinker models are runs of the session flow, submitted
      through ``session_runs``, each holding ``gpus`` slots.
    - ``vllm-engines``: ``VLLMEngines``, the Tinker API's sampling on vLLM.

    ``resources`` sets what each worker asks Ray for directly (notebooks, tests), instead of
    the share of ``gpus``. ``torch_threads`` auto: ``resources.pick_threads`` decides."""
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown placement {kind!r}; known: {', '.join(PLACEMENTS)}")
    if sampler_backend == "auto":  # a job picks before it places (JobRun.pick_sampler)
        sampler_backend = "hf"
    if kind == "own" and colocate is None:
        backends = (sampler_backend, trainer_backend)
        colocate = on_policy and samplers == 1 and backends == ("hf", "torch")
    workers = 1 if kind == "shared" or colocate else samplers + 1
    share = gpus_per_worker or (gpus or 0) / workers
    threads_why = ""
    if torch_threads == "auto":
        picked = pick_threads(
            cores=get_settings().job_cores,
            gpus=share if resources is None else resources.num_gpus,
            kind=kind,
            colocate=bool(colocate),
            on_policy=on_policy,
            samplers=samplers,
        )
        torch_threads, threads_why = picked.sampler, picked.why
        trainer_threads = trainer_threads or picked.trainer
    build = WorkerBuild(
        resources=resources or ActorResources(num_cpus=1, num_gpus=share),
        sampler_backend=sampler_backend,
        trainer_backend=trainer_backend,
        torch_threads=torch_threads,
        dtype=dtype,
        trainer_threads=trainer_threads,
        threads_why=threads_why,
    )
    if kind == "own":
        return OwnWorkers(build, samplers=samplers, colocate=bool(colocate), gpus=gpus or 0)
    if kind == "shared":
        if shared_worker is not None and gpus is not None:
            shared_worker = replace(shared_worker, gpus=gpus)
        return SharedTenant(build, worker=shared_worker)
    if kind == "local":
        return InProcess(build, samplers=samplers, resident_adapters=resident_adapters)
    if kind == "sessions":
        return OwnWorkers(runs=session_runs, gpus=gpus or 0)
    return VLLMEngines(build)
