"""A policy as the driver holds it: the ``PolicyRef`` of its long-lived workers (named Ray
actors, ``workers``; or objects in-process).

Prefect tasks never load weights: they receive a small ``PolicyRef`` (where the workers are:
actor names) and call the workers' verbs through ``sampler(ref)`` / ``trainer(ref)``. A
``PolicyRef`` is one object with one interface (the workers, ``sync``, ``restart``, ``stop``,
``nodes``), implemented by ``SplitPolicy``, ``ColocatedPolicy``, ``SharedPolicy`` (a tenant's
LoRA adapters on a shared base-model worker, ``backends.engines.shared_worker``) and ``LocalPolicy``
(the same verbs in-process, without Ray: benchmarks, notebooks). Which one a policy gets is its
placement's (``backends.policy.placement``), which starts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from flowrl.backends.policy.resources import (
    ActorResources,
    SharedWorkerSettings,
    role_specs,
)
from flowrl.backends.policy.workers import (
    ColocatedWorker,
    SamplerWorker,
    TrainerWorker,
    backend_class,
    backend_runtime_env,
    join_shared_worker,
    rebuild,
    shared_worker_stats,
    wait_exited,
    worker_env,
)
from flowrl.backends.types import JobTenancy, WorkerSpec
from flowrl.infra.settings import RAY_NAMESPACE

if TYPE_CHECKING:  # annotations only: the job's process need not import the agent loop here
    from flowrl.agent_loop.types import Trajectory
    from flowrl.backends.engines.episodes import EpisodeBatch

# Workers started with local=True live here, keyed by their would-be actor name.
_LOCAL_WORKERS: dict[str, Any] = {}
# Ray garbage-collects a (non-detached) actor once its creator drops every handle, named or
# not: the creating process keeps one here until stop_policy.
_OWNED_ACTORS: dict[str, Any] = {}


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


@dataclass(frozen=True)
class PolicyRef:
    """Where one policy's workers are, and what can be done with them: a handle, small and
    picklable (actor names), passed to tasks. Every sampler holds the same weights: a weight
    sync reaches them all.

    Each kind owns its workers: ``SplitPolicy`` (samplers and a trainer, each a Ray actor),
    ``ColocatedPolicy`` (one actor is the only sampler and the trainer; the sampler samples the
    trainer's own weights where it can, else a sync is a copy inside its process),
    ``SharedPolicy`` (adapters on a shared worker) and ``LocalPolicy`` (in this process,
    without Ray). A placement (``backends.policy.placement``) starts one; nothing else
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
        wait_exited(places, timeout_s)


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
                    "env_vars": worker_env(specs[role].torch_threads),
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
    asking the cluster for the policy's resources once. Its sampler samples the trainer's own
    model where it can (``workers._both_roles``): one copy of the weights, a sync that copies
    nothing; else a sync is a copy inside it."""

    colocated = True

    @classmethod
    def start(
        cls, name: str, paths: dict[str, str], specs: dict[str, WorkerSpec], options: dict
    ) -> ColocatedPolicy:
        ref = cls(samplers=(f"{name}-policy",), trainer=f"{name}-policy")
        threads = max(s.torch_threads for s in specs.values())
        handle = (
            ray.remote(ColocatedWorker)
            .options(
                name=ref.trainer,
                runtime_env={"env_vars": worker_env(threads, shares_cores=False)},
                **options,
            )
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
            rebuild(_LOCAL_WORKERS, n, type(_LOCAL_WORKERS[n]), specs[r]) for n, r in roles.items()
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        for name in self.actors:
            _LOCAL_WORKERS.pop(name, None)


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
