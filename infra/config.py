"""The RL job config: one frozen pydantic model, validated at the edge.

A bad value fails at once with the field's dotted name, before any job starts. The same model
is the parameter of the ``rl-train`` flow, so the Prefect UI shows it as a form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from backends.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
)
from backends.models import TinyModelSpec
from backends.types import LoraSettings
from environments.registry import ENVIRONMENTS, make_task


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvSection(_Section):
    name: str = Field(default="arithmetic", description="Environment name (environments.registry).")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Parameters of the environment's task config."
    )
    mode: Literal["local", "ray", "http"] = Field(
        default="local",
        description="Where episodes run: in the rollout task, in a pool of Ray actors, or "
        "behind the HTTP environment service (python -m environments.service).",
    )
    service_url: str | None = Field(
        default=None, description="Base URL of the environment service (mode http)."
    )
    ray_actors: int = Field(default=2, ge=1, le=1024, description="Actors in the pool (mode ray).")

    @model_validator(mode="after")
    def _check_params(self) -> EnvSection:
        if self.name not in ENVIRONMENTS:
            raise ValueError(f"unknown environment {self.name!r}; known: {sorted(ENVIRONMENTS)}")
        make_task(self.name, self.params)  # raises with the bad parameter named
        if self.mode == "http" and not self.service_url:
            raise ValueError("env.mode 'http' needs env.service_url")
        return self

    def task(self) -> Any:
        return make_task(self.name, self.params)


class ModelSection(_Section):
    source: str = Field(
        default="tiny",
        description="'tiny' (build a tiny Llama offline from `tiny`; a tiny LLaVA with "
        "`tiny.vision.enabled`) or a model URI: local HF folder, s3://… folder, or "
        "models:/name@alias.",
    )
    tiny: TinyModelSpec = Field(default_factory=TinyModelSpec, description="Tiny model shape.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA or full RL.")


class WarmupSection(_Section):
    enabled: bool = Field(default=True, description="Run SFT warm-up before RL (cached).")
    target_accuracy: float = Field(
        default=0.3, gt=0, le=1, description="Stop warm-up once held-out accuracy reaches this."
    )
    max_steps: int = Field(default=1500, ge=1, description="Upper bound on warm-up SFT steps.")
    batch_size: int = Field(default=32, ge=1, description="SFT examples per step.")
    learning_rate: float = Field(default=3e-3, gt=0, le=1, description="SFT AdamW learning rate.")
    eval_every: int = Field(default=25, ge=1, description="Warm-up steps between accuracy checks.")


class AlgorithmSection(_Section):
    """The RL math, all chosen by name (``backends/algorithms.py``): switching algorithm is a
    config change only. Dr. GRPO = ``advantage: dr_grpo`` + ``loss_agg: seq-mean-token-sum``;
    DAPO's clip-higher = ``clip_eps: 0.2`` + ``clip_eps_high: 0.28``; GSPO's paper uses
    ``clip_eps: 3.0e-4`` + ``clip_eps_high: 4.0e-4`` + ``loss_agg: seq-mean-token-mean``."""

    advantage: str = Field(
        default="grpo", description="Advantage estimator name: grpo, dr_grpo, rloo, reinforce_pp."
    )
    loss: str = Field(default="ppo_clip", description="Policy loss name: ppo_clip, cispo, gspo.")
    clip_eps: float = Field(
        default=0.2, gt=0, lt=1, description="Clip range below 1 (and above, unless clip_eps_high)."
    )
    clip_eps_high: float | None = Field(
        default=None,
        gt=0,
        description="Clip range above 1 (DAPO clip-higher; CISPO's weight cap); unset = clip_eps.",
    )
    loss_agg: str = Field(
        default="token-mean",
        description="Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean.",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the KL to the reference (LoRA: adapter off; full: a frozen copy); "
        "0 = no reference.",
    )
    kl_estimator: str = Field(default="k3", description="KL estimator: k1, k2, k3 (Schulman).")
    kl_in: Literal["loss", "reward"] = Field(
        default="loss", description="Where the KL goes: a loss term, or a penalty on the reward."
    )
    learning_rate: float = Field(default=3e-4, gt=0, le=1, description="RL AdamW learning rate.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        return _known(v, ADVANTAGE_ESTIMATORS, "advantage estimator")

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        return _known(v, POLICY_LOSSES, "policy loss")

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, v: str) -> str:
        return _known(v, LOSS_AGGREGATIONS, "loss aggregation")

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        return _known(v, KL_ESTIMATORS, "KL estimator")

    def loss_config(self) -> dict[str, Any]:
        """The options ``TorchTrainer.forward_backward`` passes to the loss (KL in the loss
        only when ``kl_in == "loss"``)."""
        kl_coef = self.kl_coef if self.kl_in == "loss" else 0.0
        return {
            "clip_eps": self.clip_eps,
            "clip_eps_high": self.clip_eps_high,
            "loss_agg": self.loss_agg,
            "kl_coef": kl_coef,
            "kl_estimator": self.kl_estimator,
        }


def _known(name: str, registry: dict[str, Any], kind: str) -> str:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}")
    return name


class RolloutSection(_Section):
    prompts_per_step: int = Field(default=64, ge=1, description="Data rows per RL step.")
    group_size: int = Field(default=8, ge=1, description="Samples per row (GRPO group).")
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature.")
    max_new_tokens: int = Field(default=8, ge=1, description="Token budget of one policy turn.")
    max_turns: int = Field(default=1, ge=1, description="Policy turns per episode.")
    max_context_tokens: int = Field(default=256, ge=8, description="Token budget of an episode.")


class ScheduleSection(_Section):
    steps: int = Field(default=150, ge=1, description="RL steps.")
    eval_every: int = Field(default=25, ge=1, description="Steps between held-out evaluations.")
    checkpoint_every: int = Field(default=50, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(default=2, ge=1, description="Complete checkpoints kept.")
    off_policy_steps: int = Field(
        default=0,
        ge=0,
        le=1,
        description="Rollouts sampled ahead of their update. 0: on-policy (rollout, update, "
        "weight sync, in turn). 1: the next step's rollout runs on the sampler while this step's "
        "update runs on the trainer, and the weights are synced once both end (staleness at most "
        "1 update; the loss clips the ratio to the sampler's log-probs).",
    )


class ResourcesSection(_Section):
    sampler_backend: Literal["hf", "vllm"] = Field(
        default="hf", description="Sampler backend: hf (generate), vllm (GPU)."
    )
    trainer_backend: Literal["torch", "deepspeed", "deepspeed_zero3"] = Field(
        default="torch", description="Trainer backend: torch, deepspeed (ZeRO-2), deepspeed_zero3."
    )
    gpus_per_worker: float = Field(
        default=0, ge=0, description="GPUs each of the sampler and trainer actors asks Ray for."
    )
    torch_threads: int = Field(default=1, ge=1, le=256, description="torch threads per worker.")
    gpus: int = Field(
        default=0,
        ge=0,
        description="GPU slots the job holds for its whole run (scheduler's `gpu` limit); "
        "0 = CPU job.",
    )


class RLJobConfig(_Section):
    """An RL training job: environment + model + algorithm + resources → a registered policy."""

    name: str = Field(
        default="arithmetic-demo",
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Job name: storage prefix, MLflow run name; resubmitting it resumes.",
    )
    seed: int = Field(default=0, description="Seed of sampling, data order and initialisation.")
    env: EnvSection = Field(default_factory=EnvSection, description="Environment.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model.")
    warmup: WarmupSection = Field(default_factory=WarmupSection, description="SFT warm-up.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="RL math.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Sampling.")
    schedule: ScheduleSection = Field(default_factory=ScheduleSection, description="Loop.")
    resources: ResourcesSection = Field(default_factory=ResourcesSection, description="Workers.")
    experiment: str = Field(default="flowrl", min_length=1, description="MLflow experiment.")
    register_as: str | None = Field(
        default=None, description="Registered model name in MLflow; unset = the job name."
    )

    @property
    def registered_model_name(self) -> str:
        return self.register_as or self.name

    @model_validator(mode="after")
    def _images_need_a_vision_model(self) -> RLJobConfig:
        shows_images = getattr(ENVIRONMENTS[self.env.name], "shows_images", False)
        if shows_images and self.model.source == "tiny" and not self.model.tiny.vision.enabled:
            raise ValueError(
                f"env {self.env.name!r} shows images: set model.tiny.vision.enabled (a tiny "
                "LLaVA) or a vision-language model.source"
            )
        return self


class ConfigError(ValueError):
    """A job config that cannot run; the message names every bad field."""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(config)"
        lines.append(f"  {where}: {e['msg']}")
    return "invalid job config:\n" + "\n".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["a.b=3", "c=x"]`` → nested dict; values are parsed as YAML scalars/lists."""
    data: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected key=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    return data


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    kind: type[BaseModel] | None = None,
) -> Any:
    """Read a YAML job config (or the embedded defaults when ``path`` is None), apply overrides,
    validate as ``kind`` (default ``RLJobConfig``; e.g. ``SelfPlayJobConfig``)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        data = loaded
    data = _merge(data, parse_overrides(overrides or []))
    return validate_config(data, kind)


def validate_config(data: dict[str, Any], kind: type[BaseModel] | None = None) -> Any:
    try:
        return (kind or RLJobConfig).model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def _tic_tac_toe() -> EnvSection:
    return EnvSection(
        name="gomoku",
        params={"size": 3, "win_length": 3, "move_format": "cell", "max_policy_turns": 9},
    )


class SelfPlayJobConfig(RLJobConfig):
    """Two agents play two-player Gomoku against each other; each learns (or one shared
    policy plays both sides). Every RL field keeps its meaning, applied per trained policy."""

    name: str = Field(
        default="gomoku-selfplay",
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Job name: storage prefix, MLflow run name.",
    )
    env: EnvSection = Field(default_factory=_tic_tac_toe, description="A gomoku environment.")
    shared_policy: bool = Field(
        default=False,
        description="One policy plays both sides (self-play) instead of one policy per agent.",
    )

    @property
    def agents(self) -> tuple[str, ...]:
        return ("X", "O")

    @model_validator(mode="after")
    def _gomoku_only(self) -> SelfPlayJobConfig:
        if self.env.name != "gomoku":
            raise ValueError(f"self-play needs env.name 'gomoku', got {self.env.name!r}")
        if self.env.mode != "local":
            raise ValueError("self-play runs its games in the rollout task (env.mode 'local')")
        if self.schedule.off_policy_steps:
            raise ValueError("self-play runs on-policy (schedule.off_policy_steps 0)")
        return self
