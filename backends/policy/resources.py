"""What a policy's workers are built from and ask for, as plain values: the backends by name,
the resources each worker asks the cluster for, a shared worker's settings and name. Importing
it imports no Ray and no torch: job schemas (``tasks.schemas``) and placements
(``backends.policy.placement``) are built from it in processes that start nothing."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from flowrl.backends.types import WorkerSpec
from flowrl.infra.settings import get_settings

SAMPLER_BACKENDS: dict[str, str] = {
    "hf": "flowrl.backends.engines.hf_sampler:HFSampler",
    "vllm": "flowrl.backends.engines.vllm_sampler:VLLMSampler",
}
TRAINER_BACKENDS: dict[str, str] = {
    "torch": "flowrl.backends.engines.torch_trainer:TorchTrainer",
    "deepspeed": "flowrl.backends.engines.deepspeed_trainer:DeepSpeedTrainer",  # ZeRO-2
    "deepspeed_zero3": "flowrl.backends.engines.deepspeed_trainer:DeepSpeedZero3Trainer",
}
"""Backends by the name ``resources.*_backend`` selects, as ``module:Class``. A backend is
imported by the worker that runs it, never by the process that starts it: the flow's driver
holds no torch models, PEFT or DeepSpeed, and only the machines that run vLLM or DeepSpeed need
the packages."""


TINKER_VLLM_BACKEND = "flowrl.backends.engines.tinker.vllm_sampling:TinkerVLLMSampler"
"""The Tinker API's sampling models on vLLM (``backends.policy.placement.VLLMEngines``)."""
VLLM_VENV_BACKENDS = (SAMPLER_BACKENDS["vllm"], TINKER_VLLM_BACKEND)
"""Backends that import vLLM, so run on the interpreter of vLLM's venv."""


@dataclass(frozen=True)
class ActorResources:
    """What each worker asks the cluster for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


def role_specs(spec: WorkerSpec, trainer_threads: int | None) -> dict[str, WorkerSpec]:
    """The sampler's and the trainer's spec: the trainer may run its own number of threads."""
    trainer_spec = spec.model_copy(update={"torch_threads": trainer_threads or spec.torch_threads})
    return {"sampler": spec, "trainer": trainer_spec}


SHARED_WORKER = "flowrl.backends.engines.shared_worker:SharedWorker"
SHARED_CONCURRENCY = 64  # calls a shared worker takes in at once (its tenants' and its own)


@dataclass(frozen=True)
class SharedWorkerSettings:
    """How a tenant's shared base-model worker is found or started (``SharedTenant``'s): the
    worker holds ``gpus`` slots of the scheduler's ``gpu`` limit once, for all its tenants
    (through the Prefect API at ``prefect_api_url``), and ends after ``idle_timeout_s`` without
    a tenant. The worker that starts first sets these for all its tenants."""

    gpus: int = 0
    idle_timeout_s: float = 120.0
    prefect_api_url: str | None = None
    mix_batches: bool = True  # tenants' concurrent sampling calls share forward passes
    resident: int = 0  # tenants in the worker's memory at once, others parked on disk (0: all)

    @classmethod
    def from_settings(
        cls, gpus: int = 0, prefect_api_url: str | None = None
    ) -> SharedWorkerSettings:
        """The settings' idle timeout, residency and batch mixing (``FLOWRL_SHARED_*``)."""
        s = get_settings()
        return cls(
            gpus=gpus,
            idle_timeout_s=s.shared_idle_s,
            prefect_api_url=prefect_api_url,
            mix_batches=s.shared_mix_batches,
            resident=s.shared_resident,
        )


def shared_worker_name(spec: WorkerSpec) -> str:
    """The name of the shared worker for ``spec``'s base model, device and precision: the
    tenants of one base find one worker; its admission limit is ``adapter-slots-<name>``."""
    key = json.dumps([spec.model_uri, spec.device, spec.dtype])
    return f"shared-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class SamplerChoice:
    """The sampler engine ``resources.sampler_backend: auto`` picked for a job, and why."""

    backend: str
    why: str


def pick_sampler(
    *,
    parameters: int | None,
    vision: bool,
    colocate: bool | None,
    placement: str,
    vllm_python: str,
    vllm_present: bool,
    min_parameters: int,
    gpus: bool = True,
    on_cpu: bool = False,
) -> SamplerChoice:
    """``resources.sampler_backend: auto``: vLLM where it can serve the job, its workers have
    GPUs (``gpus``; on CPU workers only with ``on_cpu``), its venv is there (``vllm_present``:
    ``vllm_python`` exists) and the model has at least ``min_parameters`` parameters (below
    that vLLM's start-up and per-call cost are not paid back: docs/benchmarks/engines.md);
    else HF. The first rule that decides gives its reason."""
    if placement == "shared":
        return SamplerChoice("hf", "a shared worker's tenant samples on the worker's hf engine")
    if colocate:
        return SamplerChoice("hf", "resources.colocate: the vLLM engine needs a process of its own")
    if vision:
        return SamplerChoice("hf", "a vision-language model: the vLLM sampler takes no images")
    if not gpus and not on_cpu:
        return SamplerChoice(
            "hf",
            "CPU workers: there HF sampling in the trainer's process matched vLLM's step time "
            "from 0.34M to 99M parameters with half its memory (docs/benchmarks/field.md); "
            "FLOWRL_VLLM_AUTO_ON_CPU=1 picks vLLM by size on CPUs too",
        )
    if parameters is None:
        return SamplerChoice("hf", "the model's size is unknown (no safetensors weights)")
    size = f"{parameters / 1e6:.2f}M parameters"
    if parameters < min_parameters:
        return SamplerChoice(
            "hf",
            f"{size}, below FLOWRL_VLLM_AUTO_MIN_PARAMETERS ({min_parameters:,}), where vLLM's "
            "start-up and per-call cost outweigh its speed",
        )
    if not vllm_present:
        return SamplerChoice(
            "hf", f"{size}, but no vLLM venv at {vllm_python} (`make setup-vllm` adds it)"
        )
    return SamplerChoice(
        "vllm",
        f"{size}, at least FLOWRL_VLLM_AUTO_MIN_PARAMETERS ({min_parameters:,}), and "
        f"vLLM's venv at {vllm_python}",
    )


@dataclass(frozen=True)
class ThreadChoice:
    """The torch threads ``resources.torch_threads: auto`` gave a policy's workers, and why."""

    sampler: int
    trainer: int
    why: str


def pick_threads(
    *, cores: int, gpus: float, kind: str, colocate: bool, on_policy: bool, samplers: int
) -> ThreadChoice:
    """``resources.torch_threads: auto`` for a policy of ``kind`` whose workers share
    ``cores`` CPU cores (``FLOWRL_CPU_THREADS``; unset: every core this process may run on):
    the cores its workers would otherwise leave idle. A sampler and a trainer that take turns
    (on-policy, or one actor for both) each get them all; a trainer that trains while its
    samplers sample (one-step-off, asynchronous) keeps all the cores and the samplers half, as
    measured on 2 cores (idle OpenMP threads sleep: ``workers._threads_environment``). GPU
    workers and workers that are not the job's own keep one thread."""
    if gpus > 0:
        return ThreadChoice(1, 1, "GPU workers: the GPU does the arithmetic")
    if kind != "own":
        return ThreadChoice(1, 1, f"{kind} placement: the workers are not the job's own")
    each = max(1, cores // samplers)
    if colocate:
        return ThreadChoice(cores, cores, f"one actor samples and trains in turn on {cores} cores")
    if on_policy:
        return ThreadChoice(
            each, cores, f"{samplers} sampler(s) and the trainer take turns on {cores} cores"
        )
    return ThreadChoice(
        max(1, each // 2),
        cores,
        f"the trainer trains while {samplers} sampler(s) sample ahead, on {cores} cores",
    )


def pick_backend(registry: dict[str, str], name: str, what: str) -> str:
    """The ``module:Class`` of backend ``name`` in ``registry``; an unknown name raises."""
    if name not in registry:
        raise ValueError(f"unknown {what} backend {name!r}; known: {sorted(registry)}")
    return registry[name]
