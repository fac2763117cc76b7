"""The processes that hold a policy's weights, as Ray actors: a sampler's or a trainer's worker
(its backend built in the actor's own process), both roles in one process (``ColocatedWorker``),
a shared base-model worker's host and its admission; and the backends' runtime environments.
The driver's side, the ``PolicyRef`` a job's tasks hold, is ``actors``'s."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from flowrl.backends.policy.resources import (
    SHARED_CONCURRENCY,
    SHARED_WORKER,
    VLLM_VENV_BACKENDS,
    ActorResources,
    SharedWorkerSettings,
    shared_worker_name,
)
from flowrl.backends.types import Tenancy, WorkerSpec
from flowrl.infra.heap import freeze_heap, refrozen
from flowrl.infra.settings import RAY_NAMESPACE, get_settings, worker_environment

if TYPE_CHECKING:  # annotations only: the job's process need not import the agent loop here
    from flowrl.agent_loop.types import Trajectory
    from flowrl.backends.engines.episodes import EpisodeBatch


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
                "env_vars": worker_env(spec.torch_threads),
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
        freeze_heap()

    def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._impl, verb)(*args, **kwargs)

    def call_as(self, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``call``: this worker has one role (``ColocatedWorker`` has two)."""
        return self.call(verb, *args, **kwargs)

    def restart(self, spec: WorkerSpec) -> bool:
        """Build the backend again from ``spec`` in this process, as a new worker would (its
        imports stay: a policy's next job needs no new process). False, leaving the worker as
        it is, for a backend that cannot be built twice in one process (``restartable``)."""
        with refrozen():
            return rebuild(vars(self), "_impl", backend_class(self._backend), spec)

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
    imports, one CUDA context) serves both. Where it can, the sampler samples the trainer's own
    model (``_both_roles``): one copy of the weights, and a weight sync that copies nothing;
    else a sync is a copy inside the process. Each role runs its own number of torch
    threads."""

    def __init__(self, backends: dict[str, str], specs: dict[str, WorkerSpec]):
        self._backends = backends
        self._specs = specs
        self._impls = _both_roles(backends, specs)
        freeze_heap()

    def call_as(self, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        self._threads(role)
        return getattr(self._impls[role], verb)(*args, **kwargs)

    def sync(self) -> int:
        """The trainer's weights into the sampler; the synced weights version. A sampler of the
        trainer's own model (``following``) has them already: nothing is copied."""
        if getattr(self._impls["sampler"], "follows", None) is self._impls["trainer"]:
            return self.call_as("sampler", "catch_up")
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
        with refrozen():
            self._impls.clear()  # the old roles' memory freed first
            gc.collect()
            self._impls = _both_roles(self._backends, specs)
        return True

    def where(self) -> tuple[str, int]:
        return _here()

    def _threads(self, role: str) -> None:
        import torch  # loaded by the backends already

        torch.set_num_threads(self._specs[role].torch_threads)


ROLES = ("sampler", "trainer")


def _both_roles(backends: dict[str, str], specs: dict[str, WorkerSpec]) -> dict[str, Any]:
    """A colocated policy's backends: the trainer, then a sampler of the trainer's own model
    where the sampler's class can be one (``HFSampler.following``: one copy of the weights in
    the process, and a sync that copies nothing, as a hybrid engine's); else one of its own."""
    trainer = backend_class(backends["trainer"])(specs["trainer"])
    sampler_class = backend_class(backends["sampler"])
    following = getattr(sampler_class, "following", None)
    sampler = following(specs["sampler"], trainer) if following else None
    return {"sampler": sampler or sampler_class(specs["sampler"]), "trainer": trainer}


class _Role:
    """One role of a ``ColocatedWorker``, called in its process: its verbs as methods."""

    def __init__(self, worker: ColocatedWorker, role: str):
        self._worker, self._role = worker, role

    def __getattr__(self, verb: str) -> Callable[..., Any]:
        return functools.partial(self._worker.call_as, self._role, verb)


def worker_env(threads: int, shares_cores: bool = True) -> dict[str, str]:
    """A worker's environment: the job's settings (``worker_environment``) and its threads
    (``shares_cores``: ``_threads_environment``)."""
    return worker_environment() | _threads_environment(threads, shares_cores)


def _threads_environment(threads: int, shares_cores: bool = True) -> dict[str, str]:
    """torch's threads for a worker. A worker whose cores other workers of the policy compute
    on at the same time (a trainer beside its samplers) lets its idle OpenMP threads sleep at
    once (``PASSIVE``) rather than spin: a trainer with more threads than the cores its sampler
    leaves free would otherwise burn the sampler's core waiting (one-step-off on 2 cores, the
    benchmark's large size, ``trainer_threads: 2``: 1.37 s a step spinning, 1.14 s sleeping).
    One that has its cores to itself (``shares_cores=False``: a colocated policy's one actor,
    which samples and trains in turn) keeps OpenMP's default, a short spin before sleeping:
    sleeping at once made each of the ~100 small kernels of a decode step wake its threads, and
    sampling a batch at the large size took 1.19 s against 0.92-0.94."""
    env = {"OMP_NUM_THREADS": str(threads)}
    return env | {"OMP_WAIT_POLICY": "PASSIVE"} if shares_cores else env


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
    env = worker_env(base.torch_threads)
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
    wait_exited([place], timeout_s=30.0)
    return result


def _located(fn: Callable[..., Any], *args: Any) -> tuple[Any, tuple[str, int]]:
    return fn(*args), _here()


def rebuild(holder: dict[str, Any], key: str, cls: type, spec: WorkerSpec) -> bool:
    """Replace the backend ``holder[key]`` by ``cls(spec)``, the old one's memory freed first;
    False, changing nothing, when ``cls`` cannot be built twice in a process (``restartable``)."""
    if not getattr(cls, "restartable", False):
        return False
    holder[key] = None
    gc.collect()
    holder[key] = cls(spec)
    return True


def wait_exited(places: list[tuple[str, int]], timeout_s: float) -> None:
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
