"""Long-lived workers that hold a policy's weights, as named Ray actors (or in-process).

Prefect tasks never load weights: they receive a small ``PolicyRef`` (actor names) and call
the workers' verbs through ``sampler(ref)`` / ``trainer(ref)``. The same verbs run in-process
when a ``PolicyRef`` is started with ``local=True`` (benchmarks, notebooks without Ray).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from flowrl.backends.deepspeed_trainer import DeepSpeedTrainer, DeepSpeedZero3Trainer
from flowrl.backends.hf_workers import HFSampler, TorchTrainer
from flowrl.backends.precision import Precision
from flowrl.backends.types import WorkerSpec
from flowrl.backends.vllm_sampler import VLLMSampler
from flowrl.infra.settings import worker_environment

NAMESPACE = "flowrl"

# Workers started with local=True live here, keyed by their would-be actor name.
_LOCAL_WORKERS: dict[str, Any] = {}
# Ray garbage-collects a (non-detached) actor once its creator drops every handle, named or
# not: the creating process keeps one here until stop_policy.
_OWNED_ACTORS: dict[str, Any] = {}

SAMPLER_BACKENDS: dict[str, type] = {"hf": HFSampler, "vllm": VLLMSampler}
TRAINER_BACKENDS: dict[str, type] = {
    "torch": TorchTrainer,
    "deepspeed": DeepSpeedTrainer,  # ZeRO-2
    "deepspeed_zero3": DeepSpeedZero3Trainer,
}
"""Backends by the name ``resources.*_backend`` selects. DeepSpeed and vLLM are imported when
a worker starts, so only the machines that run them need the packages."""


@dataclass(frozen=True)
class PolicyRef:
    """Names of one policy's sampler and trainer workers (picklable, passed to tasks)."""

    sampler: str
    trainer: str
    local: bool = False


@dataclass(frozen=True)
class ActorResources:
    """What each worker asks the cluster for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


@dataclass(frozen=True)
class WorkerPlan:
    """How a job's policy workers start (warm-up's included): what each asks the cluster for,
    which backends, torch's threads per worker and the precision (``backends.precision``)."""

    resources: ActorResources = ActorResources()
    sampler_backend: str = "hf"
    trainer_backend: str = "torch"
    torch_threads: int = 1
    dtype: Precision = "auto"

    def start(self, name: str, spec: WorkerSpec) -> PolicyRef:
        """Start a policy's sampler and trainer as planned (``spec.torch_threads`` and
        ``spec.dtype`` overridden)."""
        spec = spec.model_copy(update={"torch_threads": self.torch_threads, "dtype": self.dtype})
        return start_policy(name, spec, self.resources, self.sampler_backend, self.trainer_backend)


class _Proxy:
    """Calls a worker's verbs synchronously, whether it is a Ray actor or a local object."""

    def __init__(self, target: Any, remote: bool):
        self._target = target
        self._remote = remote

    def __getattr__(self, verb: str) -> Callable[..., Any]:
        method = getattr(self._target, verb)
        if not self._remote:
            return method
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


def _worker(name: str, local: bool) -> _Proxy:
    if local:
        return _Proxy(_LOCAL_WORKERS[name], remote=False)
    return _Proxy(ray.get_actor(name, namespace=NAMESPACE), remote=True)


def sampler(ref: PolicyRef) -> _Proxy:
    return _worker(ref.sampler, ref.local)


def trainer(ref: PolicyRef) -> _Proxy:
    return _worker(ref.trainer, ref.local)


def start_policy(
    name: str,
    spec: WorkerSpec,
    resources: ActorResources = ActorResources(),
    sampler_backend: str = "hf",
    trainer_backend: str = "torch",
    local: bool = False,
) -> PolicyRef:
    """Start a sampler and a trainer for one policy and wait until both hold their weights."""
    sampler_cls = _pick(SAMPLER_BACKENDS, sampler_backend, "sampler")
    trainer_cls = _pick(TRAINER_BACKENDS, trainer_backend, "trainer")
    ref = PolicyRef(sampler=f"{name}-sampler", trainer=f"{name}-trainer", local=local)
    if local:
        _LOCAL_WORKERS[ref.sampler] = sampler_cls(spec)
        _LOCAL_WORKERS[ref.trainer] = trainer_cls(spec)
        return ref
    env = {"env_vars": worker_environment() | {"OMP_NUM_THREADS": str(spec.torch_threads)}}
    handles = [
        ray.remote(cls)
        .options(
            name=actor_name,
            namespace=NAMESPACE,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            runtime_env=env,
            max_concurrency=1,
        )
        .remote(spec)
        for cls, actor_name in ((sampler_cls, ref.sampler), (trainer_cls, ref.trainer))
    ]
    ray.get([h.__ray_ready__.remote() for h in handles])
    _OWNED_ACTORS.update({ref.sampler: handles[0], ref.trainer: handles[1]})
    return ref


def stop_policy(ref: PolicyRef) -> None:
    """Release the workers (idempotent)."""
    for name in (ref.sampler, ref.trainer):
        if ref.local:
            _LOCAL_WORKERS.pop(name, None)
            continue
        _OWNED_ACTORS.pop(name, None)
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass  # already gone


def sync_weights(ref: PolicyRef) -> int:
    """Copy the trainer's weights into the sampler; returns the synced weights version."""
    if ref.local:
        return _LOCAL_WORKERS[ref.sampler].set_weights(_LOCAL_WORKERS[ref.trainer].get_weights())
    trainer_handle = ray.get_actor(ref.trainer, namespace=NAMESPACE)
    sampler_handle = ray.get_actor(ref.sampler, namespace=NAMESPACE)
    # The weights travel trainer -> object store -> sampler, never through this process.
    return ray.get(sampler_handle.set_weights.remote(trainer_handle.get_weights.remote()))


def _pick(registry: dict[str, type], name: str, what: str) -> type:
    if name not in registry:
        raise ValueError(f"unknown {what} backend {name!r}; known: {sorted(registry)}")
    return registry[name]
