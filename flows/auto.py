"""What a job's ``auto`` resources come to (``resources.sampler_backend``, ``torch_threads``,
``dtype``), decided once in the job's flow process before its workers start, each with a line
for the job's log and MLflow tags saying what was picked and why."""

from __future__ import annotations

import functools
from typing import Any

from prefect.settings import PREFECT_API_URL

from flowrl.backends.models.cpu_kernels import cpu_bf16, pick_cpu_dtype
from flowrl.backends.models.model_folder import is_vision_language, weight_count
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.policy.resources import SamplerChoice, SharedWorkerSettings, pick_sampler
from flowrl.infra.settings import get_settings
from flowrl.tasks.schemas import JobConfig


def shared_worker_settings() -> SharedWorkerSettings:
    """How this run's policies find or start a shared base-model worker: the settings' idle
    timeout, residency and batch mixing, and the Prefect API this process talks to (where the
    worker holds its GPU slots). The job's placement sets those slots
    (``ResourcesSection.placement_for``)."""
    return SharedWorkerSettings.from_settings(prefect_api_url=PREFECT_API_URL.value() or None)


def auto_sampler(resources: Any, folder: str, parameters: int | None) -> SamplerChoice:
    """``resources.sampler_backend: auto`` for the job's ``resources`` and its model's local
    folder: its size (``parameters``, from its safetensors headers), whether it takes images,
    whether its workers have GPUs, and whether vLLM's venv is on this machine
    (``resources.pick_sampler`` decides)."""
    settings = get_settings()
    python = settings.resolved_vllm_python
    return pick_sampler(
        parameters=parameters,
        vision=is_vision_language(folder),
        colocate=resources.colocate,
        placement=resources.placement,
        vllm_python=str(python),
        vllm_present=python.exists(),
        min_parameters=settings.vllm_auto_min_parameters,
        gpus=resources.gpus > 0 or resources.gpus_per_worker > 0,
        on_cpu=settings.vllm_auto_on_cpu,
    )


def auto_resources(
    config: JobConfig, model_uri: str, cache_dir: str
) -> tuple[JobConfig, list[tuple[str, dict[str, str]]]]:
    """``config`` with ``resources.sampler_backend`` then ``torch_threads`` (which depend on
    the engine) auto decided for the model ``model_uri``, and a CPU job's ``dtype`` (by
    this machine's kernels and the model's size, ``cpu_kernels.pick_cpu_dtype``, so that every
    worker computes alike), and per decision a log line and MLflow tags (``sampler_backend``,
    ``torch_threads``, ``dtype``, their ``.why``). Retrain's ``resources`` are
    not its own field (its rl-train subflow picks): its config is left as it is."""
    if "resources" not in type(config).model_fields:
        return config, []
    said = []
    resources = config.resources

    @functools.cache
    def model() -> tuple[str, int | None]:
        """The model's local folder and its size, read once for every decision that needs it."""
        folder = resolve_model_uri(model_uri, cache_dir)
        return folder, weight_count(folder)

    if resources.sampler_backend == "auto":
        choice = auto_sampler(resources, *model())
        resources = resources.model_copy(update={"sampler_backend": choice.backend})
        config = config.model_copy(update={"resources": resources})
        line = f"sampler: {choice.backend} (resources.sampler_backend auto: {choice.why})"
        said.append((line, {"sampler_backend": choice.backend, "sampler_backend.why": choice.why}))
    if resources.torch_threads == "auto":
        build = config.placement_for(shared_worker_settings()).build
        threads = {"torch_threads": build.torch_threads, "trainer_threads": build.trainer_threads}
        config = config.model_copy(update={"resources": resources.model_copy(update=threads)})
        why = build.threads_why
        line = f"threads: {build.threads()} (resources.torch_threads auto: {why})"
        said.append((line, {"torch_threads": build.threads(), "torch_threads.why": why}))
    if resources.dtype == "auto" and resources.gpus == 0 and resources.gpus_per_worker == 0:
        dtype, why = pick_cpu_dtype(model()[1], cpu_bf16())
        resources = config.resources.model_copy(update={"dtype": dtype})
        config = config.model_copy(update={"resources": resources})
        said.append(
            (f"dtype: {dtype} (resources.dtype auto: {why})", {"dtype": dtype, "dtype.why": why})
        )
    return config, said
