"""Every job schema, in one place: a frozen pydantic model per job kind, validated at the edge
(their sections: ``tasks/sections.py``, importable from here too).

A bad value fails at once with the field's dotted name, before any job starts. Each job kind
extends ``JobConfig`` (identity, model, resources); its model is the parameter of its flow, so
the Prefect UI shows it as a form. Sections carry their own resolvers (``rollout.limits()``,
``resources.placement_for()``) so no stage builds them by hand. The models are pure: what depends on
where a job runs (settings, the Prefect API, the namespace) is resolved by the run
(``flowrl.flows.lifecycle``) and passed in. Reading YAML and ``--set`` overrides is
``flowrl.infra.configfile``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from flowrl.backends.policy.resources import SharedWorkerSettings
from flowrl.backends.types import LoraSettings
from flowrl.environments.registry import EnvironmentLoadError, load
from flowrl.infra.configfile import Config, load_config
from flowrl.infra.settings import scoped_model_name
from flowrl.tasks.sections import (
    JOB_NAME_PATTERN,
    MODEL_NAME_PATTERN,
    SUCCESS_RULE,
    AlgorithmSection,
    EnvDataSection,
    EnvSection,
    ModelSection,
    NoCredentials,
    ResourcesSection,
    RolloutSection,
    RowFile,
    ScheduleSection,
    SFTDataSection,
    SFTTrainSection,
    WarmupSection,
    _Section,
)

if TYPE_CHECKING:
    from flowrl.backends.policy.placement import Placement

__all__ = [  # the job schemas, and their sections (defined in ``tasks/sections.py``)
    "JOB_KINDS",
    "JOB_NAME_PATTERN",
    "MODEL_NAME_PATTERN",
    "SUCCESS_RULE",
    "AlgorithmSection",
    "EnvDataSection",
    "EnvSection",
    "EvalJobConfig",
    "InferenceJobConfig",
    "JobConfig",
    "ModelSection",
    "NoCredentials",
    "RLJobConfig",
    "ResourcesSection",
    "RetrainConfig",
    "RolloutSection",
    "RowFile",
    "SFTDataSection",
    "SFTJobConfig",
    "SFTTrainSection",
    "ScheduleSection",
    "SelfPlayJobConfig",
    "TinkerSessionConfig",
    "TrainingJobConfig",
    "WarmupSection",
    "load_job",
]


class JobConfig(_Section):
    """What every job has: who it is (name, seed, MLflow experiment), which model, which workers."""

    name: str = Field(
        default="job",
        pattern=JOB_NAME_PATTERN,
        description="Job name: storage prefix (jobs/<name>/) and MLflow run name; resubmitting "
        "a training job of the same name resumes it.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        lt=2**63,
        description="Seed of sampling, data order and initialisation.",
    )
    experiment: str = Field(default="flowrl", min_length=1, description="MLflow experiment.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model.")
    resources: ResourcesSection = Field(default_factory=ResourcesSection, description="Workers.")

    shared_placement: ClassVar[bool] = False
    """Whether this job kind can be a tenant of a shared worker (``resources.placement``)."""
    shared_placement_trains: ClassVar[bool] = True
    """Whether such a tenant trains its adapter (``model.lora`` then needed) or runs a LoRA
    version's (batch inference)."""

    @model_validator(mode="after")
    def _shared_placement_for_lora_rl(self) -> JobConfig:
        if self.resources.placement != "shared":
            return self
        if not type(self).shared_placement:
            raise ValueError(
                "resources.placement shared is for rl-train jobs (a tenant trains a LoRA "
                "adapter on the shared worker) and batch inference of LoRA versions; use "
                "placement own"
            )
        if type(self).shared_placement_trains and not self.model.lora.enabled:
            raise ValueError(
                "resources.placement shared trains a LoRA adapter on a shared base: set "
                "model.lora.enabled true (or placement own for full-parameter training)"
            )
        return self

    def worker_settings(self) -> dict[str, Any]:
        """``WorkerSpec`` fields this job kind sets for its policy workers."""
        return {"lora": self.model.lora}

    def placement_for(self, shared_worker: SharedWorkerSettings | None = None) -> Placement:
        """``resources.placement_for()`` for this job: on-policy unless it samples ahead of its
        updates (``schedule.staleness_bound``); ``shared_worker`` as there."""
        schedule = getattr(self, "schedule", None)
        on_policy = not getattr(schedule, "staleness_bound", 0)
        return self.resources.placement_for(on_policy, shared_worker)


class TrainingJobConfig(JobConfig):
    """A job whose result is a new registered model version."""

    register_as: str | None = Field(
        default=None,
        pattern=MODEL_NAME_PATTERN,
        description="Registered model name in MLflow (in the job's namespace, if any); "
        "unset = the job name.",
    )

    @property
    def model_name(self) -> str:
        """The registered model's own name, before any namespace."""
        return self.register_as or self.name

    def registered_model_name(self, namespace: str | None) -> str:
        """The name registered in MLflow for a job of ``namespace`` (the run's
        ``FLOWRL_NAMESPACE``): ``<namespace>_<model_name>``, or ``model_name`` without one."""
        return scoped_model_name(self.model_name, namespace)

    @property
    def optimiser(self) -> AlgorithmSection | SFTTrainSection:
        """The section holding this job kind's ``learning_rate`` and ``max_grad_norm``."""
        raise NotImplementedError

    def worker_settings(self) -> dict[str, Any]:
        o = self.optimiser
        return super().worker_settings() | {
            "learning_rate": o.learning_rate,
            "max_grad_norm": o.max_grad_norm,
        }


class RLJobConfig(TrainingJobConfig):
    """An RL training job: environment + model + algorithm + resources → a registered policy."""

    name: str = Field(
        default="arithmetic-demo",
        pattern=JOB_NAME_PATTERN,
        description="Job name: storage prefix, MLflow run name; resubmitting it resumes.",
    )
    env: EnvSection = Field(default_factory=EnvSection, description="Environment.")
    warmup: WarmupSection = Field(default_factory=WarmupSection, description="SFT warm-up.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="RL math.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Sampling.")
    schedule: ScheduleSection = Field(default_factory=ScheduleSection, description="Loop.")

    shared_placement: ClassVar[bool] = True

    @property
    def optimiser(self) -> AlgorithmSection:
        return self.algorithm

    @model_validator(mode="after")
    def _images_need_a_vision_model(self) -> RLJobConfig:
        shows_images = getattr(load(self.env.name).target, "shows_images", False)
        if shows_images and self.model.source == "tiny" and not self.model.tiny.vision.enabled:
            raise ValueError(
                f"env {self.env.name!r} shows images: set model.tiny.vision.enabled (a tiny "
                "LLaVA) or a vision-language model.source"
            )
        return self

    @model_validator(mode="after")
    def _colocated_policies_run_on_policy(self) -> RLJobConfig:
        if self.resources.colocate and self.schedule.staleness_bound:
            raise ValueError(
                "resources.colocate: a colocated policy cannot sample while it trains; "
                "set schedule.max_staleness 0 or leave resources.colocate unset"
            )
        return self

    @model_validator(mode="after")
    def _context_fits_the_tiny_model(self) -> RLJobConfig:
        positions = self.model.tiny.max_position_embeddings
        if self.model.source == "tiny" and self.rollout.max_context_tokens > positions:
            raise ValueError(
                f"rollout.max_context_tokens={self.rollout.max_context_tokens} exceeds the "
                f"tiny model's model.tiny.max_position_embeddings={positions}"
            )
        return self


def _tic_tac_toe() -> EnvSection:
    return EnvSection(
        name="gomoku",
        params={"size": 3, "win_length": 3, "move_format": "cell", "max_policy_turns": 9},
    )


class SelfPlayJobConfig(RLJobConfig):
    """Agents of a game play each other: flowrl's Gomoku (X and O) or a user's game given as a
    class (docs/environments.md: "Your own game"); each agent learns, or one shared policy plays
    every side. Every RL field keeps its meaning, applied per trained policy."""

    shared_placement: ClassVar[bool] = False

    name: str = Field(
        default="gomoku-selfplay",
        pattern=JOB_NAME_PATTERN,
        description="Job name: storage prefix, MLflow run name.",
    )
    env: EnvSection = Field(
        default_factory=_tic_tac_toe,
        description="A game between agents: gomoku, or a class with the game API.",
    )
    shared_policy: bool = Field(
        default=False,
        description="One policy plays every side (self-play) instead of one policy per agent.",
    )
    _agents: tuple[str, ...] = PrivateAttr(default=())

    @property
    def agents(self) -> tuple[str, ...]:
        """The game's agents, in turn order of its ``agents`` tuple."""
        return self._agents or tuple(self.games().agents)

    def games(self) -> Any:
        """The self-play side of the environment (``registry.make_games``)."""
        return self.env.games(self.seed)

    @model_validator(mode="after")
    def _a_game(self) -> SelfPlayJobConfig:
        try:
            self._agents = tuple(self.games().agents)
        except EnvironmentLoadError as exc:
            raise ValueError(str(exc)) from None
        if self.env.mode != "local":
            raise ValueError("self-play runs its games in the rollout task (env.mode 'local')")
        if self.schedule.staleness_bound:
            raise ValueError("self-play runs on-policy (schedule.max_staleness 0)")
        return self


class SFTJobConfig(TrainingJobConfig):
    """A supervised fine-tuning job: chat data + model → a registered policy.

    Chat rows (JSONL/JSON/parquet ``{"messages": [...]}``, local or any fsspec URL) train the
    model on its assistant tokens only; held-out conversations are scored by greedy exact match.
    """

    name: str = Field(
        default="sft",
        pattern=JOB_NAME_PATTERN,
        description="Job name: storage prefix and MLflow run name.",
    )
    experiment: str = Field(default="flowrl-sft", min_length=1, description="MLflow experiment.")
    data: SFTDataSection = Field(description="Chat datasets.")
    train: SFTTrainSection = Field(default_factory=SFTTrainSection, description="Optimisation.")

    @property
    def optimiser(self) -> SFTTrainSection:
        return self.train


def _registered_champion() -> ModelSection:
    return ModelSection(source="models:/arithmetic-demo@champion")


class InferenceJobConfig(JobConfig):
    """A batch-inference job: a registered model + an environment → scored episodes (JSONL).
    With ``resources.placement: shared`` a LoRA version runs as an adapter on the shared
    worker of its base model."""

    shared_placement: ClassVar[bool] = True
    shared_placement_trains: ClassVar[bool] = False

    name: str = Field(
        default="inference-demo",
        pattern=JOB_NAME_PATTERN,
        description="Job name: storage prefix (jobs/<name>/inference/) and MLflow run name.",
    )
    experiment: str = Field(default="flowrl-inference", min_length=1, description="MLflow exp.")
    model: ModelSection = Field(
        default_factory=_registered_champion,
        description="The model: `source` is a models:/name@alias, models:/name/version, s3://… "
        "or folder URI (a bare string is taken as the source).",
    )
    env: EnvSection = Field(default_factory=EnvSection, description="Environment.")
    data: Literal["eval", "stream"] = Field(
        default="eval", description="Prompts: the held-out set, or the environment's data stream."
    )
    num_prompts: int = Field(default=64, ge=1, description="Prompts to run (at most the set).")
    samples_per_prompt: int = Field(default=1, ge=1, description="Episodes per prompt.")
    rollout: RolloutSection = Field(
        default_factory=lambda: RolloutSection(temperature=1.0),
        description="Sampling limits (temperature, tokens, turns) as in training.",
    )
    greedy: bool = Field(default=True, description="Greedy decoding (ignores temperature).")

    @field_validator("model", mode="before")
    @classmethod
    def _uri_as_source(cls, v: Any) -> Any:
        return {"source": v} if isinstance(v, str) else v


class RetrainConfig(_Section):
    """A retraining round: the training job template and the promotion gate."""

    job: RLJobConfig = Field(
        default_factory=lambda: RLJobConfig(name="arithmetic-retrain"),
        description="Training job template; name, seed and model.source are set per round.",
    )
    alias: str = Field(default="champion", description="Registry alias of the serving model.")
    min_improvement: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Promote only if challenger accuracy > champion + this (0..1: a worse "
        "model never takes the alias).",
    )

    # What ``JobRun`` reads of a job, for the round's own run (its gate, with the template's
    # experiment, workers and GPU slots): job.json, result.json and one MLflow run per round.
    @property
    def name(self) -> str:
        """The round's job name: ``jobs/<job.name>-retrain/`` and its MLflow run's name."""
        return f"{self.job.name[:55]}-retrain"

    @property
    def seed(self) -> int:
        return self.job.seed

    @property
    def experiment(self) -> str:
        return self.job.experiment

    @property
    def resources(self) -> ResourcesSection:
        return self.job.resources

    @property
    def env(self) -> EnvSection:
        return self.job.env

    def worker_settings(self) -> dict[str, Any]:
        return self.job.worker_settings()

    def placement_for(self, shared_worker: SharedWorkerSettings | None = None) -> Placement:
        return self.job.placement_for(shared_worker)


class EvalJobConfig(JobConfig):
    """An evaluation job: models side by side on environments' held-out sets. Per (model,
    environment): greedy accuracy, pass@k for each ``k`` and avg@``samples`` (unbiased, from
    ``samples`` sampled episodes per prompt), mean reward, failed and truncated episodes."""

    name: str = Field(
        default="evaluate",
        pattern=JOB_NAME_PATTERN,
        description="Job name: storage prefix (jobs/<name>/: result.json) and MLflow run name.",
    )
    experiment: str = Field(default="flowrl-eval", min_length=1, description="MLflow experiment.")
    models: list[NoCredentials] = Field(
        default_factory=lambda: ["models:/arithmetic-demo@champion"],
        min_length=1,
        max_length=16,
        description="Models to compare: models:/name/version, models:/name@alias (pinned to its "
        "version at the start), a local HF folder or an s3://… folder (a job's policy/ folder). "
        "`model` keeps its chat-format settings for all of them; its source is not used.",
    )
    envs: list[EnvSection] = Field(
        default_factory=lambda: [EnvSection()],
        min_length=1,
        max_length=8,
        description="Environments, each with its own params and held-out set.",
    )
    samples: int = Field(
        default=4,
        ge=0,
        le=64,
        description="Sampled episodes per held-out prompt (at rollout.temperature) for pass@k "
        "and avg@samples; 0 = greedy accuracy only.",
    )
    k: list[int] = Field(default=[1, 4], description="pass@k for each k (each at most `samples`).")
    num_prompts: int | None = Field(
        default=None, ge=1, description="At most this many held-out prompts per environment."
    )
    rollout: RolloutSection = Field(
        default_factory=lambda: RolloutSection(temperature=1.0),
        description="Sampling limits (temperature, tokens, turns) as in training.",
    )

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalJobConfig:
        too_big = [k for k in self.k if k < 1 or k > self.samples]
        if too_big:
            raise ValueError(
                f"k={too_big[0]} needs 1 <= k <= samples={self.samples} (pass@k is estimated "
                "from `samples` episodes per prompt): raise samples or lower k"
            )
        return self


JOB_KINDS: dict[str, type[JobConfig]] = {
    "rl-train": RLJobConfig,
    "self-play": SelfPlayJobConfig,
    "sft-train": SFTJobConfig,
    "batch-inference": InferenceJobConfig,
    "evaluate": EvalJobConfig,
}
"""Each job kind's schema, by the name of its flow."""


def load_job(
    path: str | Path | None, overrides: list[str] | None = None, kind: type[Config] = RLJobConfig
) -> Config:
    """A job config from YAML (None = embedded defaults) and ``--set`` overrides, validated as
    ``kind``; ``ConfigError`` naming every bad field otherwise."""
    return load_config(path, overrides, kind)


class TinkerSessionConfig(JobConfig, title="Tinker session"):
    """One training model of a Tinker API session (the service fills it in). Its ``seed`` is
    the model's: its adapter's initial weights and its sampling RNG."""

    model_id: str = Field(description="The Tinker model id (<session>:train:<n>).")
    base_model: str = Field(description="Catalogue name of the base model.")
    base_uri: str = Field(description="Where the base model is (folder, s3://, models:/, tiny).")
    lora: LoraSettings = Field(
        description="The model's adapter: the client's Tinker LoraConfig (tinker_lora)."
    )
    owner: str | None = Field(default=None, description="The API key's namespace.")
    generation: int = Field(
        default=0,
        ge=0,
        description="How many times the service has made this model again after its weights "
        "were lost (its actor's name carries it).",
    )
