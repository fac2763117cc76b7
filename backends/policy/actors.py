"""Long-lived workers that hold a policy's weights, as named Ray actors (or in-process).

Prefect tasks never load weights: they receive a small ``PolicyRef`` (where the workers are:
actor names) and call the workers' verbs through ``sampler(ref)`` / ``trainer(ref)``. A
``PolicyRef`` is one object with one interface (the workers, ``sync``, ``restart``, ``stop``,
``nodes``), implemented by ``SplitPolicy``, ``ColocatedPolicy``, ``SharedPolicy`` (a tenant's
LoRA adapters on a shared base-model worker, ``backends.engines.shared_worker``) and ``LocalPolicy``
(the same verbs in-process, without Ray: benchmarks, notebooks). Which one a policy gets is its
placement's (``backends.policy.placement``), which starts it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from flowrl.backends.policy.resources import (
    SHARED_CONCURRENCY,
    SHARED_WORKER,
    VLLM_VENV_BACKENDS,
    ActorResources,
    SharedWorkerSettings,
    role_specs,
    shared_worker_name,
)
from flowrl.backends.types import JobTenancy, Tenancy, WorkerSpec
from flowrl.infra.settings import RAY_NAMESPACE, get_settings, worker_environment

if TYPE_CHECKING:  # annotations only: the job's process need not import the agent loop here
    from flowrl.agent_loop.types import Trajectory
    from flowrl.backends.engines.episodes import EpisodeBatch

# Workers started with local=True live here, keyed by their would-be actor name.
_LOCAL_WORKERS: dict[str, Any] = {}
# Ray garbage-collects a (non-detached) actor once its creator drops every handle, named or
# not: the creating process keeps one here until stop_policy.
_OWNED_ACTORS: dict[str, Any] = {}


def start_sampler_actor(name: str, path: str, spec: WorkerSpec, resources: ActorResources) -> Any:
    """One ``SamplerWorker`` actor of the backend ``path`` (on vLLM's venv for a vLLM one),
    named ``name`` in flowrl's namespace and owned by this process until ``ray.kill``; returns
    its handle once it is built."""
    handle = (
        ray.remote(SamplerWorker)
        .options(
            name=name,
            namespace=RAY_NAMESPACE,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            max_concurrency=1,
            runtime_env={
                "env_vars": _worker_env(spec.torch_threads),
                **backend_runtime_env(path),
            },
        )
        .remote(path, spec)
    )
    ray.get(handle.__ray_ready__.remote())
    return handle


def backend_runtime_env(path: str) -> dict[str, Any]:
    """What a backend's actor adds to its ``runtime_env``: the interpreter of vLLM's own venv
    (``Settings.vllm_python``) for the vLLM sampler, whose pins cannot share flowrl's venv;
    nothing for the others. Raises ``ValueError`` saying how to install it when a local Ray
    would not find that interpreter (a cluster's nodes are checked by Ray)."""
    if path not in VLLM_VENV_BACKENDS:
        return {}
    settings = get_settings()
    python = settings.resolved_vllm_python
    if settings.ray_address is None and not python.exists():
        raise ValueError(
            f"resources.sampler_backend vllm: no vLLM venv at {python.parent.parent} (run "
            "`make setup-vllm`, or set FLOWRL_VLLM_PYTHON to a venv's python that has vLLM, "
            "ray and flowrl)"
        )
    return {"py_executable": str(python)}


def backend_class(path: str) -> type:
    """The worker class a ``module:Class`` path names (imported now)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class _Worker:
    """A Ray actor holding one backend worker, built in the actor's own process; its verbs are
    called through ``call`` (``_Proxy`` hides that)."""

    def __init__(self, backend: str, spec: WorkerSpec):
        self._backend = backend
        self._impl = backend_class(backend)(spec)

    def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._impl, verb)(*args, **kwargs)

    def call_as(self, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``call``: this worker has one role (``ColocatedWorker`` has two)."""
        return self.call(verb, *args, **kwargs)

    def restart(self, spec: WorkerSpec) -> bool:
        """Build the backend again from ``spec`` in this process, as a new worker would (its
        imports stay: a policy's next job needs no new process). False, leaving the worker as
        it is, for a backend that cannot be built twice in one process (``restartable``)."""
        return _rebuild(vars(self), "_impl", backend_class(self._backend), spec)

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this worker."""
        return _here()


def _here() -> tuple[str, int]:
    return ray.get_runtime_context().get_node_id(), os.getpid()


class SamplerWorker(_Worker):
    """A policy's sampler actor (``SAMPLER_BACKENDS``)."""


class TrainerWorker(_Worker):
    """A policy's trainer actor (``TRAINER_BACKENDS``)."""


class ColocatedWorker:
    """A policy's sampler and trainer in one actor process (``resources.colocate``), as a
    hybrid engine: an on-policy job never samples while it trains, so one process (one set of
    imports, one CUDA context) serves both, and a weight sync is a copy inside it. Each role
    runs its own number of torch threads."""

    def __init__(self, backends: dict[str, str], specs: dict[str, WorkerSpec]):
        self._backends = backends
        self._specs = specs
        self._impls = {role: backend_class(backends[role])(specs[role]) for role in ROLES}

    def call_as(self, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        self._threads(role)
        return getattr(self._impls[role], verb)(*args, **kwargs)

    def sync(self) -> int:
        """The trainer's weights into the sampler; the synced weights version."""
        weights = self.call_as("trainer", "get_weights")
        return self.call_as("sampler", "set_weights", weights)

    def play_episodes(self, batch: EpisodeBatch) -> list[Trajectory]:
        """Play ``batch``'s in-process episodes here, on this process's sampler
        (``backends.engines.episodes``)."""
        from flowrl.backends.engines.episodes import play

        return play(batch, _Role(self, "sampler"))

    def restart(self, specs: dict[str, WorkerSpec]) -> bool:
        """Both roles built again from ``specs`` (``_Worker.restart``)."""
        classes = {role: backend_class(self._backends[role]) for role in ROLES}
        if not all(getattr(c, "restartable", False) for c in classes.values()):
            return False
        self._specs = specs
        for role in ROLES:
            _rebuild(self._impls, role, classes[role], specs[role])
        return True

    def where(self) -> tuple[str, int]:
        return _here()

    def _threads(self, role: str) -> None:
        import torch  # loaded by the backends already

        torch.set_num_threads(self._specs[role].torch_threads)


ROLES = ("sampler", "trainer")


class _Role:
    """One role of a ``ColocatedWorker``, called in its process: its verbs as methods."""

    def __init__(self, worker: ColocatedWorker, role: str):
        self._worker, self._role = worker, role

    def __getattr__(self, verb: str) -> Callable[..., Any]:
        return functools.partial(self._worker.call_as, self._role, verb)


class _Proxy:
    """Calls a worker's verbs synchronously, whether it is a Ray actor or a local object; a
    Ray actor's ``call_as`` gets ``route`` first (the role; a shared worker's tenant and
    role)."""

    def __init__(self, target: Any, remote: bool, *route: str):
        self._target = target
        self._remote = remote
        self._route = route

    def __getattr__(self, verb: str) -> Callable[..., Any]:
        if not self._remote:
            return getattr(self._target, verb)
        call, route = self._target.call_as, self._route
        return lambda *args, **kwargs: ray.get(call.remote(*route, verb, *args, **kwargs))


def sampler(ref: PolicyRef, index: int = 0) -> _Proxy:
    """Sampler ``index`` of the policy (``len(ref.samplers)`` of them)."""
    return ref.sampler_worker(index)


def trainer(ref: PolicyRef) -> _Proxy:
    return ref.trainer_worker()


def sampler_weights_version(ref: PolicyRef) -> int:
    return ref.weights_version()


def worker_nodes(ref: PolicyRef) -> dict[str, str]:
    return ref.nodes()


def sync_weights(ref: PolicyRef) -> int:
    """Copy the trainer's weights into every sampler; returns the synced weights version."""
    return ref.sync()


def stop_policy(ref: PolicyRef, timeout_s: float = 30.0) -> None:
    ref.stop(timeout_s)


def start_policy(
    name: str,
    spec: WorkerSpec,
    resources: ActorResources = ActorResources(),
    sampler_backend: str = "hf",
    trainer_backend: str = "torch",
    local: bool = False,
    samplers: int = 1,
    trainer_threads: int | None = None,
    colocate: bool = False,
    shared: SharedWorkerSettings | None = None,
) -> PolicyRef:
    """Start ``samplers`` samplers and a trainer for one policy from ``spec`` as it is, and wait
    until all hold their weights, in the placement (``backends.policy.placement``) these arguments
    name: ``InProcess`` with ``local``; else ``SharedTenant`` of the worker ``shared`` finds
    (no admission: the caller's); else ``OwnWorkers`` (``colocate``: one actor, with one
    sampler). A shorthand for notebooks, benchmarks and tests; a job's placement comes from
    its config (``ResourcesSection.placement_for``). The trainer runs ``trainer_threads``
    torch threads (default: ``spec.torch_threads``, as the samplers); Ray still counts it as
    ``resources.num_cpus``."""
    from flowrl.backends.policy.placement import place  # built on this module

    kind = "local" if local else "shared" if shared is not None else "own"
    chosen = place(
        kind,
        resources=resources,
        samplers=samplers,
        colocate=colocate,
        sampler_backend=sampler_backend,
        trainer_backend=trainer_backend,
        trainer_threads=trainer_threads,
        shared_worker=shared,
    )
    return chosen.start_policy(name, spec)


def restart_policy(ref: PolicyRef, spec: WorkerSpec, trainer_threads: int | None = None) -> bool:
    """Build every worker of the running policy ``ref`` again from ``spec``, in the processes
    it has (``start_policy``'s specs); the workers hold the new weights when it returns. False
    when a backend cannot restart (``restartable``): then the caller stops the policy and
    starts a new one (a worker that did restart holds the new spec, unused)."""
    return ref.restart(role_specs(spec, trainer_threads))


def _rebuild(holder: dict[str, Any], key: str, cls: type, spec: WorkerSpec) -> bool:
    """Replace the backend ``holder[key]`` by ``cls(spec)``, the old one's memory freed first;
    False, changing nothing, when ``cls`` cannot be built twice in a process (``restartable``)."""
    if not getattr(cls, "restartable", False):
        return False
    holder[key] = None
    gc.collect()
    holder[key] = cls(spec)
    return True


def _worker_env(threads: int) -> dict[str, str]:
    """A worker's environment: the job's settings (``worker_environment``) and its threads."""
    return worker_environment() | _threads_environment(threads)


def _threads_environment(threads: int) -> dict[str, str]:
    """torch's threads for a worker. Idle OpenMP threads sleep at once (``PASSIVE``) rather
    than spin: a trainer with more threads than the cores its sampler leaves free would
    otherwise burn the sampler's core waiting (one-step-off on 2 cores, the benchmark's large
    size, ``trainer_threads: 2``: 1.37 s a step spinning, 1.14 s sleeping)."""
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}


def _wait_exited(places: list[tuple[str, int]], timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the processes at ``places`` (node id, pid) that run
    on this machine's node have exited."""
    if not places:
        return
    here = ray.get_runtime_context().get_node_id()
    pids = [pid for node, pid in places if node == here]
    deadline = time.monotonic() + timeout_s
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the raylet) holds no memory.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass(frozen=True)
class PolicyRef:
    """Where one policy's workers are, and what can be done with them: a handle, small and
    picklable (actor names), passed to tasks. Every sampler holds the same weights: a weight
    sync reaches them all.

    Each kind owns its workers: ``SplitPolicy`` (samplers and a trainer, each a Ray actor),
    ``ColocatedPolicy`` (one actor is the only sampler and the trainer; a sync is a copy inside
    its process), ``SharedPolicy`` (adapters on a shared worker) and ``LocalPolicy`` (in this
    process, without Ray). A placement (``backends.policy.placement``) starts one; nothing else
    branches on where the workers are."""

    samplers: tuple[str, ...]
    trainer: str

    local = False
    """The workers run in this process (its samplers share torch's global RNG)."""
    colocated = False
    """One process is the sampler and the trainer; it plays batches of in-process episodes
    itself (``play_episodes``)."""

    @property
    def actors(self) -> tuple[str, ...]:
        """Each worker's name once."""
        return tuple(dict.fromkeys((*self.samplers, self.trainer)))

    @property
    def sampler(self) -> str:
        """The first sampler's name (the only one unless ``resources.samplers`` > 1)."""
        return self.samplers[0]

    def sampler_worker(self, index: int = 0) -> _Proxy:
        """Sampler ``index`` (``len(self.samplers)`` of them)."""
        return _Proxy(ray.get_actor(self.samplers[index], namespace=RAY_NAMESPACE), True, "sampler")

    def trainer_worker(self) -> _Proxy:
        return _Proxy(ray.get_actor(self.trainer, namespace=RAY_NAMESPACE), True, "trainer")

    def weights_version(self) -> int:
        """The weights version every sampler holds (they are synced together; a disagreement
        is a bug in the pipeline and raises)."""
        versions = {
            i: self.sampler_worker(i).get_weights_version() for i in range(len(self.samplers))
        }
        if len(set(versions.values())) > 1:
            named = {self.samplers[i]: v for i, v in versions.items()}
            raise RuntimeError(f"the policy's samplers hold different weights: {named}")
        return next(iter(versions.values()))

    def nodes(self) -> dict[str, str]:
        """The Ray node each worker runs on, by actor name."""
        handles = [ray.get_actor(name, namespace=RAY_NAMESPACE) for name in self.actors]
        places = ray.get([h.where.remote() for h in handles])
        return {name: node for name, (node, _) in zip(self.actors, places, strict=True)}

    def sync(self) -> int:
        """Copy the trainer's weights into every sampler; the synced weights version."""
        raise NotImplementedError

    def describe(self) -> str | None:
        """Where the workers are, in words, when a log line should say (a shared worker's
        tenant); None otherwise."""
        return None

    def play_episodes(self, batch: EpisodeBatch) -> list[Trajectory]:
        """Play ``batch`` in the sampler's own process (a colocated policy's): the
        trajectories the job's process would have played (``backends.engines.episodes``)."""
        raise NotImplementedError(f"{type(self).__name__} plays no episodes in its workers")

    def restart(self, specs: dict[str, WorkerSpec]) -> bool:
        """Build every worker again from ``specs`` (by role) in the processes it has; False
        when a backend cannot restart (``restartable``)."""
        raise NotImplementedError

    def stop(self, timeout_s: float = 30.0) -> None:
        """Release the workers (idempotent). Workers on this machine are waited for until
        their processes have exited, so a policy started next (the job's, after its warm-up's)
        never shares the machine's memory with them."""
        handles = []
        for name in self.actors:
            handle = _OWNED_ACTORS.pop(name, None)  # dropping the last handle lets Ray end it
            try:
                handles.append(handle or ray.get_actor(name, namespace=RAY_NAMESPACE))
            except ValueError:
                pass  # already gone
        if not handles:  # gone already (no Ray call: it would start a Ray)
            return
        try:
            places = ray.get([h.where.remote() for h in handles], timeout=5)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            places = []  # a dead or hung worker: nothing to wait for
        for handle in handles:
            ray.kill(handle)
        _wait_exited(places, timeout_s)


@dataclass(frozen=True)
class SplitPolicy(PolicyRef):
    """Samplers and a trainer, each its own Ray actor (several samplers spread over nodes)."""

    @classmethod
    def start(
        cls,
        name: str,
        paths: dict[str, str],
        specs: dict[str, WorkerSpec],
        options: dict,
        samplers: int,
    ) -> SplitPolicy:
        names = tuple(f"{name}-sampler" + (f"-{i}" if i else "") for i in range(samplers))
        ref = cls(samplers=names, trainer=f"{name}-trainer")
        workers = [
            *((SamplerWorker, "sampler", n) for n in names),
            (TrainerWorker, "trainer", ref.trainer),
        ]
        handles = {
            actor_name: ray.remote(worker)
            .options(
                name=actor_name,
                scheduling_strategy="SPREAD"
                if worker is SamplerWorker and samplers > 1
                else "DEFAULT",
                runtime_env={
                    "env_vars": _worker_env(specs[role].torch_threads),
                    **backend_runtime_env(paths[role]),
                },
                **options,
            )
            .remote(paths[role], specs[role])
            for worker, role, actor_name in workers
        }
        ray.get([h.__ray_ready__.remote() for h in handles.values()])
        _OWNED_ACTORS.update(handles)
        return ref

    def sync(self) -> int:
        # The weights travel trainer -> object store -> samplers (one copy in the store,
        # fetched by each sampler's node), never through this process.
        weights = ray.get_actor(self.trainer, namespace=RAY_NAMESPACE).call.remote("get_weights")
        handles = [ray.get_actor(name, namespace=RAY_NAMESPACE) for name in self.samplers]
        return min(ray.get([h.call.remote("set_weights", weights) for h in handles]))

    def restart(self, specs: dict[str, WorkerSpec]) -> bool:
        roles = {**dict.fromkeys(self.samplers, "sampler"), self.trainer: "trainer"}
        handles = {n: ray.get_actor(n, namespace=RAY_NAMESPACE) for n in roles}
        return all(ray.get([handles[n].restart.remote(specs[r]) for n, r in roles.items()]))


@dataclass(frozen=True)
class ColocatedPolicy(PolicyRef):
    """One actor (``ColocatedWorker``, ``<name>-policy``) is the sampler and the trainer,
    asking the cluster for the policy's resources once; a sync is a copy inside it."""

    colocated = True

    @classmethod
    def start(
        cls, name: str, paths: dict[str, str], specs: dict[str, WorkerSpec], options: dict
    ) -> ColocatedPolicy:
        ref = cls(samplers=(f"{name}-policy",), trainer=f"{name}-policy")
        threads = max(s.torch_threads for s in specs.values())
        handle = (
            ray.remote(ColocatedWorker)
            .options(name=ref.trainer, runtime_env={"env_vars": _worker_env(threads)}, **options)
            .remote(paths, specs)
        )
        ray.get(handle.__ray_ready__.remote())
        _OWNED_ACTORS[ref.trainer] = handle
        return ref

    def sync(self) -> int:
        return ray.get(ray.get_actor(self.trainer, namespace=RAY_NAMESPACE).sync.remote())

    def restart(self, specs: dict[str, WorkerSpec]) -> bool:
        return ray.get(ray.get_actor(self.trainer, namespace=RAY_NAMESPACE).restart.remote(specs))

    def play_episodes(self, batch: EpisodeBatch) -> list[Trajectory]:
        actor = ray.get_actor(self.trainer, namespace=RAY_NAMESPACE)
        return ray.get(actor.play_episodes.remote(batch))


@dataclass(frozen=True)
class LocalPolicy(PolicyRef):
    """The workers as objects in this process, without Ray (benchmarks, notebooks, tests)."""

    local = True

    @classmethod
    def start(
        cls, name: str, paths: dict[str, str], specs: dict[str, WorkerSpec], samplers: int
    ) -> LocalPolicy:
        names = tuple(f"{name}-sampler" + (f"-{i}" if i else "") for i in range(samplers))
        ref = cls(samplers=names, trainer=f"{name}-trainer")
        roles = {**dict.fromkeys(names, "sampler"), ref.trainer: "trainer"}
        _LOCAL_WORKERS.update({n: backend_class(paths[r])(specs[r]) for n, r in roles.items()})
        return ref

    def sampler_worker(self, index: int = 0) -> _Proxy:
        return _Proxy(_LOCAL_WORKERS[self.samplers[index]], False, "sampler")

    def trainer_worker(self) -> _Proxy:
        return _Proxy(_LOCAL_WORKERS[self.trainer], False, "trainer")

    def nodes(self) -> dict[str, str]:
        return dict.fromkeys(self.actors, "local")

    def sync(self) -> int:
        weights = _LOCAL_WORKERS[self.trainer].get_weights()
        return min(_LOCAL_WORKERS[name].set_weights(weights) for name in self.samplers)

    def restart(self, specs: dict[str, WorkerSpec]) -> bool:
        roles = {**dict.fromkeys(self.samplers, "sampler"), self.trainer: "trainer"}
        return all(
            _rebuild(_LOCAL_WORKERS, n, type(_LOCAL_WORKERS[n]), specs[r]) for n, r in roles.items()
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        for name in self.actors:
            _LOCAL_WORKERS.pop(name, None)


class SharedHost:
    """The Ray actor of a shared base-model worker (``SHARED_WORKER``, built in the actor's own
    process: the process that starts it imports no torch)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._impl = backend_class(SHARED_WORKER)(*args, **kwargs)

    def call_as(self, tenant: str, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        return self._impl.call_as(tenant, role, verb, *args, **kwargs)

    def do(self, method: str, *args: Any) -> Any:
        """One of the worker's own methods (join, leave, sync, restart, stats, ...)."""
        return getattr(self._impl, method)(*args)

    def where(self) -> tuple[str, int]:
        return _here()


@dataclass(frozen=True)
class SharedPolicy(PolicyRef):
    """A tenant of a shared base-model worker (``backends.engines.shared_worker``): its sampler and
    trainer are LoRA adapters on the worker's base, named ``tenant``; a sync is a copy inside
    the worker; stopping it leaves the worker (which others may use) running."""

    tenant: str = ""

    @classmethod
    def start(
        cls,
        name: str,
        specs: dict[str, WorkerSpec],
        placement: SharedWorkerSettings,
        resources: ActorResources,
    ) -> SharedPolicy:
        """Join the worker of ``specs``' base model, starting it if none runs."""
        spec = specs["trainer"]
        base = WorkerSpec(
            model_uri=spec.model_uri,
            cache_dir=spec.cache_dir,
            device=spec.device,
            dtype=spec.dtype,
            torch_threads=max(s.torch_threads for s in specs.values()),
        )
        worker, _ = join_shared_worker(base, placement, resources, name, JobTenancy(specs))
        return cls(samplers=(worker,), trainer=worker, tenant=name)

    def _host(self) -> Any:
        return ray.get_actor(self.trainer, namespace=RAY_NAMESPACE)

    def describe(self) -> str:
        held = shared_worker_stats(self.trainer)
        return (
            f"tenant {self.tenant} of shared worker {self.trainer} (pid {held['pid']}, base "
            f"loaded {held['base_loads']} time, {len(held['tenants'])} tenants now)"
        )

    def sampler_worker(self, index: int = 0) -> _Proxy:
        return _Proxy(self._host(), True, self.tenant, "sampler")

    def trainer_worker(self) -> _Proxy:
        return _Proxy(self._host(), True, self.tenant, "trainer")

    def sync(self) -> int:
        return ray.get(self._host().do.remote("sync", self.tenant))

    def restart(self, specs: dict[str, WorkerSpec]) -> bool:
        return ray.get(self._host().do.remote("restart", self.tenant, specs))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Leave the worker (idempotent); the worker goes on for its other tenants."""
        try:
            ray.get(self._host().do.remote("leave", self.tenant), timeout=timeout_s)
        except (ValueError, ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # the worker is gone already: nothing to leave


def admission(base: WorkerSpec, slots: int) -> contextlib.AbstractContextManager:
    """A tenant's admission to the shared worker of ``base``'s model: one of its ``slots``
    adapter slots (the Prefect limit ``adapter-slots-<worker>``), held while the context is,
    waiting while all are taken. Jobs and Tinker models are admitted the same way; how many
    admitted tenants stay in the worker's memory at once is its residency
    (``SharedWorkerSettings.resident``), a separate matter. (``SharedTenant.admission`` is the
    placement's way to it.)"""
    from flowrl.infra.scheduler import adapter_slots

    return adapter_slots(admission_limit(shared_worker_name(base)), slots)


def admission_limit(worker: str) -> str:
    """The Prefect concurrency limit whose slots admit tenants to the shared worker ``worker``."""
    return f"adapter-slots-{worker}"


def join_shared_worker(
    base: WorkerSpec,
    placement: SharedWorkerSettings,
    resources: ActorResources,
    tenant: str,
    tenancy: Tenancy,
) -> tuple[str, dict[str, Any]]:
    """Join ``tenant`` (a job's workers or a Tinker model: ``tenancy``) to the shared worker of
    ``base``'s model (its name: ``shared_worker_name``), starting it if none runs; its name and
    what the join answered (``SharedWorker.join``)."""
    worker = shared_worker_name(base)
    env = _worker_env(base.torch_threads)
    if placement.prefect_api_url:  # where the worker holds its GPU slots
        env["PREFECT_API_URL"] = placement.prefect_api_url
    for attempt in range(3):
        handle = (
            ray.remote(SharedHost)
            .options(
                name=worker,
                namespace=RAY_NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                # Threads: tenants' calls wait on one lock inside, where sampling calls that
                # arrive meanwhile are answered together (backends.engines.shared_worker).
                max_concurrency=SHARED_CONCURRENCY,
                runtime_env={"env_vars": env},
            )
            .remote(
                base,
                placement.gpus,
                placement.idle_timeout_s,
                mix_batches=placement.mix_batches,
                resident=placement.resident,
            )
        )
        try:
            return worker, ray.get(handle.do.remote("join", tenant, tenancy))
        except ray.exceptions.RayActorError:
            if attempt == 2:  # it ended as we joined (idle): the next one starts anew
                raise
            time.sleep(1.0 + attempt)  # until Ray has released the ended worker's name
    raise AssertionError("unreachable")


def shared_worker_stats(name: str) -> dict[str, Any]:
    """What the shared worker ``name`` holds (``SharedWorker.stats``)."""
    return ray.get(ray.get_actor(name, namespace=RAY_NAMESPACE).do.remote("stats"))


def run_on_ray(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as a one-off Ray task with the job's environment, in a worker that exits
    after it (its imports, torch's included, leave with it; one on this machine is waited for);
    in-process when this process has not initialised Ray (notebooks, local workers)."""
    if not ray.is_initialized():
        return fn(*args)
    options = {"num_cpus": 1, "max_calls": 1, "runtime_env": {"env_vars": worker_environment()}}
    result, place = ray.get(ray.remote(**options)(_located).remote(fn, *args))
    _wait_exited([place], timeout_s=30.0)
    return result


def _located(fn: Callable[..., Any], *args: Any) -> tuple[Any, tuple[str, int]]:
    return fn(*args), _here()
