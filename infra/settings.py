"""Where flowrl finds its engines: one place, overridable by environment variables.

Every engine has an embedded default for a single machine (Prefect's ephemeral API, a local
Ray, MLflow on a SQLite file, storage in a local folder) and is swapped for the production
engine by configuration alone, e.g. ``FLOWRL_STORAGE_URL=s3://bucket/flowrl``.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

RAY_NAMESPACE = "flowrl"
"""The Ray namespace of every named actor flowrl starts (workers, environment pools, Tinker
models), where its processes find them by name."""
NAMESPACE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}$"
"""A namespace: lowercase letters, digits and dashes (it names folders and model prefixes)."""


def scoped_model_name(name: str, namespace: str | None) -> str:
    """A registered model's name in ``namespace``: ``<namespace>_<name>`` (MLflow names allow no
    dot); unscoped without one. Neither a namespace nor a job's own ``register_as`` holds a
    ``_``, so no job reaches another namespace's names."""
    return f"{namespace}_{name}" if namespace else name


def job_prefix(name: str, namespace: str | None) -> str:
    """A job's storage prefix: ``jobs/<name>``, under ``ns/<namespace>/`` in a namespace."""
    return f"ns/{namespace}/jobs/{name}" if namespace else f"jobs/{name}"


class Settings(BaseSettings):
    """Engine locations. Each field reads ``FLOWRL_<FIELD>`` from the environment."""

    model_config = SettingsConfigDict(env_prefix="FLOWRL_", frozen=True, extra="ignore")

    home: Path = Field(
        default=Path(".flowrl"),
        description="Local folder for the embedded defaults (MLflow DB, storage, caches).",
    )
    prefect_api_url: str | None = Field(
        default=None,
        description="Prefect API URL (e.g. http://127.0.0.1:4200/api); unset = ephemeral API.",
    )
    ray_address: str | None = Field(
        default=None,
        description="Ray cluster address host:port (or ray://host:10001); unset = local Ray.",
    )
    ray_num_cpus: int = Field(
        default=8,
        ge=1,
        description="Logical CPUs of a local Ray (actors and stage tasks share them).",
    )
    ray_num_gpus: int | None = Field(
        default=None,
        ge=0,
        description="GPUs of a local Ray; unset = detected (set it on CPU to simulate a pool).",
    )
    ray_daemon_niceness: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Niceness of the helper daemons of a Ray flowrl starts (dashboard, its "
        "agents, log and autoscaler monitors): on a small machine they yield the CPU to the "
        "policy's workers, which run at 0. 0 = as the job.",
    )
    ray_local_daemons: Literal["needed", "all"] = Field(
        default="needed",
        description="Helper daemons of a local Ray flowrl starts: `needed` stops, once it is up, "
        "the three no job uses (the log monitor: the job's Ray does not forward workers' logs, "
        "which stay in Ray's session folder; the autoscaler monitor: a local Ray has a fixed "
        "size; the dashboard head, started even without a dashboard); `all` keeps them, as "
        "`ray.init` leaves them (`ray status`, the state API).",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI; unset = sqlite:///<home>/mlflow.db.",
    )
    model_cache: Path | None = Field(
        default=None,
        description="Local folder for models copied from storage or MLflow and for built tiny "
        "models, shareable by every home on the machine (like HF_HOME); "
        "unset = <home>/model-cache.",
    )
    storage_url: str | None = Field(
        default=None,
        description="Root URL for checkpoints, caches and results (any fsspec URL, "
        "e.g. s3://bucket/x); unset = <home>/storage.",
    )

    namespace: str | None = Field(
        default=None,
        pattern=NAMESPACE_PATTERN,
        description="Owner of the jobs this process runs: scopes their storage prefix, "
        "warm-up cache, MLflow run and registered model names; unset = the shared space.",
    )

    scheduler_file: Path | None = Field(
        default=None,
        description="YAML declaration of the work pool, queues and GPU limit; "
        "unset = infra/scheduler.yaml.",
    )
    pool_gpus: int | None = Field(
        default=None,
        ge=0,
        description="GPUs in the work pool (slots of the `gpu` limit); unset = the declaration's.",
    )

    shared_adapter_slots: int = Field(
        default=4,
        ge=1,
        description="Adapter slots of a shared base-model worker: tenants (rl-train jobs with "
        "resources.placement shared) it holds at once; the next waits in Prefect.",
    )
    shared_resident: int = Field(
        default=0,
        ge=0,
        description="Tenants whose adapters, gradients and optimiser state a shared base-model "
        "worker keeps in memory at once; beyond it the least recently used is parked on the "
        "worker's disk and restored exactly on its next call. 0 = all stay in memory.",
    )
    shared_mix_batches: bool = Field(
        default=True,
        description="Tenants' sampling calls that arrive together at a shared base-model worker "
        "run as one batch (each row with its tenant's adapter and its own random stream); false: "
        "each call alone, so a tenant samples bit for bit what workers of its own would.",
    )
    shared_idle_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds a shared base-model worker without tenants waits before it ends "
        "and gives back its GPU slots.",
    )
    tinker_models: dict[str, str] = Field(
        default={"flowrl/tiny": "tiny"},
        description="The Tinker API's base models: name -> a local HF folder, s3://… folder, "
        "models:/name@alias, or 'tiny' (the default tiny model, built offline). JSON in "
        "FLOWRL_TINKER_MODELS.",
    )
    vllm_python: Path | None = Field(
        default=None,
        description="Python of the venv that holds vLLM (`make setup-vllm`): a vLLM sampler's "
        "Ray actor runs on it, so vLLM's pins never meet flowrl's. Unset = .venv-vllm/bin/python "
        "in flowrl's checkout. On a cluster: that venv's path on every node.",
    )
    cpu_threads: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="CPU cores a job's workers share, for resources.torch_threads auto: 0 = "
        "every core this process may run on. Set it lower where several jobs or test workers "
        "share one machine (the test suite sets 1).",
    )
    vllm_auto_min_parameters: int = Field(
        default=1_000_000,
        ge=0,
        description="resources.sampler_backend auto picks vLLM (where its venv is) for a model "
        "of at least this many parameters: on this project's 2-core CPU vLLM sampled 1.15x "
        "slower than HF at 0.34M parameters, 2.1x faster at 3.2M, and starts ~8 s later "
        "(docs/benchmarks/engines.md).",
    )
    vllm_auto_on_cpu: bool = Field(
        default=False,
        description="resources.sampler_backend auto picks vLLM by size for CPU workers too "
        "(by default only for workers with GPUs: on this project's 2-core CPU, HF sampling in "
        "the trainer's process matched vLLM's step time at 0.34M-99M parameters with half its "
        "memory, docs/benchmarks/field.md).",
    )
    vllm_cpu_kv_cache_mb: int = Field(
        default=512,
        ge=16,
        description="KV cache of a vLLM engine on CPU, in MB (vLLM's own default reserves most "
        "of the machine's memory).",
    )
    config_dir: Path | None = Field(
        default=None,
        description="The user's flowrl folder: holds the pointer to the running local stack "
        "(stack.json), so `flowrl jobs` finds it from any directory; "
        "unset = $XDG_CONFIG_HOME/flowrl, else ~/.config/flowrl.",
    )

    @cached_property
    def resolved_home(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def resolved_config_dir(self) -> Path:
        if self.config_dir is not None:
            return self.config_dir.expanduser().resolve()
        base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
        return (Path(base).expanduser() / "flowrl").resolve()

    @property
    def job_cores(self) -> int:
        """``cpu_threads``, or (0) the cores this process may run on."""
        return self.cpu_threads or len(os.sched_getaffinity(0))

    @property
    def resolved_vllm_python(self) -> Path:
        if self.vllm_python is not None:
            return self.vllm_python.expanduser()
        return Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"

    @property
    def tracking_uri(self) -> str:
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        return f"sqlite:///{self.resolved_home / 'mlflow.db'}"

    @property
    def storage_root(self) -> str:
        return self.storage_url or str(self.resolved_home / "storage")

    @property
    def model_cache_dir(self) -> str:
        if self.model_cache is not None:
            return str(self.model_cache.expanduser().resolve())
        return str(self.resolved_home / "model-cache")

    def apply_to_environment(self) -> None:
        """Export what the engines read themselves (Prefect API, MLflow) for child processes."""
        self.resolved_home.mkdir(parents=True, exist_ok=True)
        if self.prefect_api_url:
            os.environ["PREFECT_API_URL"] = self.prefect_api_url
        os.environ["MLFLOW_TRACKING_URI"] = self.tracking_uri
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # The ephemeral API's first start migrates its database: ~15 s alone, more on a busy box.
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # see infra/stack_programs.py
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


WORKER_ENV_PREFIXES = ("FLOWRL_", "MLFLOW_", "AWS_", "ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_")
"""Settings and credentials a job's Ray tasks and actors read from their environment, and the
CPU-kernel caps (ATen, MKL, oneDNN) that make a run's numbers the same on any x86-64 CPU."""


def worker_environment() -> dict[str, str]:
    """The variables a job's Ray workers need (storage, MLflow, S3 credentials), taken from
    this process after ``apply_to_environment``: they travel as the workers' ``runtime_env``,
    never as task parameters, so a Ray cluster started elsewhere (or earlier) sees the job's
    settings."""
    env = {k: v for k, v in os.environ.items() if k.startswith(WORKER_ENV_PREFIXES)}
    return env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def get_settings() -> Settings:
    """Read the settings afresh from the environment (cheap; no caching across tests)."""
    return Settings()
