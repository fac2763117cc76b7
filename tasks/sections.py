"""The sections of the job schemas (``tasks/schemas.py``): environment, model, warm-up,
algorithm, rollout, schedule, resources, SFT data and training, each a frozen pydantic model
validated at the edge. Sections carry their own resolvers (``rollout.limits()``,
``resources.placement_for()``), so no stage builds them by hand; they are pure (what depends on
where a job runs is resolved by its run and passed in)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flowrl.agent_loop.loop import LoopLimits
from flowrl.backends.models.tiny_model import TinyModelSpec
from flowrl.backends.policy.resources import SharedWorkerSettings
from flowrl.backends.types import (
    ADVANTAGE_NAMES,
    KL_ESTIMATOR_NAMES,
    LOSS_AGGREGATION_NAMES,
    POLICY_LOSS_NAMES,
    LoraSettings,
    Precision,
)
from flowrl.environments.agent import AgentTask
from flowrl.environments.data import ROW_FORMATS
from flowrl.environments.registry import (
    EnvironmentLoadError,
    check_environment,
    load,
    make_games,
    make_task,
)
from flowrl.environments.types import TaskConfig
from flowrl.infra.configfile import STRICT_MODEL_CONFIG
from flowrl.infra.redact import redact_text

if TYPE_CHECKING:
    from flowrl.backends.policy.placement import Placement

JOB_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9-]{0,79}$"
"""``register_as``: no ``_`` (the namespace separator), so a job never names a model of another
namespace."""


def _no_credentials(uri: str) -> str:
    """A URL in a config never carries credentials: configs are recorded (MLflow params,
    job.json, Prefect parameters). The message does not repeat the value."""
    if redact_text(uri) != uri:
        raise ValueError(
            "a URL holds credentials (user:password@): configs are recorded, so give them to "
            "the processes instead (AWS_* variables for s3://, FLOWRL_ENV_SERVICE_KEY for "
            "the environment service)"
        )
    return uri


def _row_file(uri: str) -> str:
    _no_credentials(uri)
    if not uri.split("?", 1)[0].lower().endswith(ROW_FORMATS):
        raise ValueError(f"{uri!r}: expected one of {', '.join(ROW_FORMATS)}")
    return uri


NoCredentials = Annotated[str, AfterValidator(_no_credentials)]
RowFile = Annotated[str, AfterValidator(_row_file)]
"""A row file flowrl reads (JSONL, JSON or parquet by extension), local or any fsspec URL."""


class _Section(BaseModel):
    """A config section. Its ``title`` (a class keyword) heads it in the Prefect UI's run form,
    which otherwise shows the class name."""

    model_config = STRICT_MODEL_CONFIG


class EnvDataSection(_Section, title="Environment data"):
    """Rows of an environment given as a class (each row's fields go to ``reset(**row)``)."""

    train: RowFile | None = Field(
        default=None, description="Training rows: JSONL, JSON or parquet; local path or s3://."
    )
    eval: RowFile | None = Field(default=None, description="Held-out rows, same formats.")


SUCCESS_RULE = r"^(auto|info\.[A-Za-z_][\w.-]*|reward\s*(>=|>)\s*-?\d+(\.\d+)?)$"


class EnvSection(_Section, title="Environment"):
    name: str = Field(
        default="arithmetic",
        description="An installed environment's name (entry point group flowrl.environments: "
        "arithmetic, tool_math, gomoku, geometry, or a package's own), package.module:Class, "
        "reasoning_gym:<dataset> (the envs extra; env.params = the dataset's config), "
        "textarena:<Game-v0> (the envs extra; a game between agents), or "
        "agent:package.module:function (your agent, through an OpenAI endpoint, playing "
        "env.params.task).",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="The environment class's constructor arguments (a built-in's task fields).",
    )
    data: EnvDataSection = Field(
        default_factory=EnvDataSection,
        description="Row files of an environment class; unset = generated rows {seed: n}.",
    )
    eval_size: int = Field(
        default=200,
        ge=1,
        le=1_000_000,
        description="Generated held-out rows {seed: 0..eval_size-1} (environment classes).",
    )
    success: str = Field(
        default="auto",
        pattern=SUCCESS_RULE,
        description="When an episode counts as a success (accuracy): 'info.<key>' (truthy), "
        "'reward>=X' / 'reward>X', or 'auto' (info.correct if reported, else reward > 0).",
    )
    mode: Literal["local", "ray", "http"] = Field(
        default="local",
        description="Where episodes run: in the rollout task, in a pool of Ray actors, or "
        "behind the HTTP environment service (flowrl serve environments).",
    )
    service_url: NoCredentials | None = Field(
        default=None,
        pattern=r"^https?://[^\s]+$",
        description="Base URL of the environment service (mode http): http:// or https://.",
    )
    ray_actors: int = Field(default=2, ge=1, le=1024, description="Actors in the pool (mode ray).")
    step_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="Seconds one reset or step of the environment may take, in every mode; an "
        "overrun fails that episode alone (env/stop_error, rollout/failed_episodes).",
    )

    @field_validator("params")
    @classmethod
    def _check_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """A built-in's params validate here, so a bad one is named ``env.params.<field>``."""
        try:
            loaded = load(info.data["name"]) if "name" in info.data else None
        except EnvironmentLoadError:
            return params  # the environment check below names the cause
        if loaded is not None and loaded.is_task_config:
            loaded.target.model_validate(params)
        return params

    @model_validator(mode="after")
    def _check_environment(self) -> EnvSection:
        if self.mode == "http" and not self.service_url:
            raise ValueError("env.mode 'http' needs env.service_url")
        task = self.task()
        if isinstance(task, AgentTask):  # an agent plays in the rollout's process
            if self.mode != "local":
                raise ValueError("env.mode: an agent (env.name agent:…) runs 'local' only")
            task = task.inner
        check_environment(task, self.step_timeout_s)  # import, API, params, one reset
        return self

    def task(self, seed: int = 0) -> TaskConfig:
        """The environment's task config; ``seed`` (the job's) seeds generated training rows
        and the shuffling of row files."""
        return make_task(
            self.name, self.params, data=self.data, eval_size=self.eval_size, seed=seed
        )

    def games(self, seed: int = 0) -> Any:
        """The environment's self-play side (a game between agents); raises naming why not."""
        return make_games(
            self.name, self.params, data=self.data, eval_size=self.eval_size, seed=seed
        )


class ModelSection(_Section, title="Model"):
    source: NoCredentials = Field(
        default="tiny",
        description="'tiny' (build a tiny Llama offline from `tiny`; a tiny LLaVA with "
        "`tiny.vision.enabled`) or a model URI: local HF folder, s3://… folder, or "
        "models:/name@alias.",
    )
    tiny: TinyModelSpec = Field(default_factory=TinyModelSpec, description="Tiny model shape.")
    chat_format: Literal[
        "auto", "flowrl", "chatml", "qwen3", "llama3", "gemma3", "mistral", "template"
    ] = Field(
        default="auto",
        description="Chat template family: auto (detected from the template), flowrl, chatml "
        "(Qwen2.5), qwen3, llama3, gemma3, mistral (instruct), or template (any other; the "
        "start-of-job probe decides).",
    )
    tool_messages: Literal["auto", "tool", "user"] = Field(
        default="auto",
        description="How tool observations reach the chat template: tool (its tool role), user "
        "(as user turns, for families without a tool role: Gemma 3, Mistral instruct), or auto "
        "(user when the template refuses a tool message but accepts a user one).",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA or full RL.")


class WarmupSection(_Section, title="Warm-up"):
    enabled: bool = Field(default=True, description="Run SFT warm-up before RL (cached).")
    target_accuracy: float = Field(
        default=0.3, gt=0, le=1, description="Stop warm-up once held-out accuracy reaches this."
    )
    max_steps: int = Field(default=1500, ge=1, description="Upper bound on warm-up SFT steps.")
    batch_size: int = Field(default=32, ge=1, description="SFT examples per step.")
    learning_rate: float = Field(default=3e-3, gt=0, le=1, description="SFT AdamW learning rate.")
    eval_every: int = Field(default=25, ge=1, description="Warm-up steps between accuracy checks.")
    data: RowFile | None = Field(
        default=None,
        description="Demonstrations: a chat-format file (rows {messages: [...]}); unset = the "
        "environment's own (built-ins, or a class with a demonstration() method).",
    )


class AlgorithmSection(_Section, title="Algorithm"):
    """The RL math, all chosen by name (``backends/engines/algorithms.py``): switching algorithm is
    a config change only. Dr. GRPO = ``advantage: dr_grpo`` + ``loss_agg: seq-mean-token-sum``;
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
    tis_cap: float | None = Field(
        default=None,
        gt=1,
        description="Truncated importance sampling for sampler/trainer log-prob mismatch (Yao "
        "et al. 2025): ratio against the trainer's own log-probs, each token weighted by "
        "min(p_trainer / p_sampler, tis_cap); unset = off (ratio against the sampler's).",
    )
    is_correction: Literal["none", "tis", "mis", "decoupled"] = Field(
        default="none",
        description="Off-policy correction against the sampler's (behaviour) log-probs: the "
        "ratio against the trainer's own log-probs before the update, each token weighted by "
        "rho = p_trainer / p_sampler truncated at is_cap (tis), dropped outside mis_band (mis), "
        "or unclipped and dropped over is_cap (decoupled PPO, AReaL); none = the ratio against "
        "the sampler's. tis_cap C is the same as tis with is_cap C.",
    )
    is_cap: float = Field(
        default=2.0, gt=1, description="tis: the truncation of rho; decoupled: the drop cap."
    )
    mis_band: tuple[float, float] = Field(
        default=(0.5, 2.0), description="mis: tokens whose rho leaves [low, high] are dropped."
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

    skip_zero_advantage: bool = Field(
        default=True,
        description="Rows of advantage 0 skip the trainer's forward and backward passes: their "
        "gradient is 0, so the update is the same, sooner (false: every row runs, as in TRL).",
    )

    @field_validator("advantage", "loss", "loss_agg", "kl_estimator")
    @classmethod
    def _known_name(cls, v: str, info: ValidationInfo) -> str:
        registry, kind = {
            "advantage": (ADVANTAGE_NAMES, "advantage estimator"),
            "loss": (POLICY_LOSS_NAMES, "policy loss"),
            "loss_agg": (LOSS_AGGREGATION_NAMES, "loss aggregation"),
            "kl_estimator": (KL_ESTIMATOR_NAMES, "KL estimator"),
        }[info.field_name]
        return _known(v, registry, kind)

    @field_validator("mis_band")
    @classmethod
    def _band(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < v[0] < 1.0 < v[1]:
            raise ValueError(f"mis_band must be [low, high] with 0 < low < 1 < high, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _one_correction(self) -> AlgorithmSection:
        if self.tis_cap is not None and self.is_correction not in ("none", "tis"):
            raise ValueError(
                f"algorithm.tis_cap and is_correction {self.is_correction!r} are two "
                "corrections: set one"
            )
        return self

    def correction(self) -> dict[str, Any] | None:
        """The off-policy correction the trainer applies (``torch_trainer._off_policy_correction``),
        or None."""
        if self.tis_cap is not None:
            return {"name": "tis", "cap": self.tis_cap}
        if self.is_correction == "none":
            return None
        return {"name": self.is_correction, "cap": self.is_cap, "band": list(self.mis_band)}

    def loss_config(self) -> dict[str, Any]:
        """The options ``TorchTrainer.forward_backward`` passes to the loss (KL in the loss
        only when ``kl_in == "loss"``)."""
        kl_coef = self.kl_coef if self.kl_in == "loss" else 0.0
        return {
            "clip_eps": self.clip_eps,
            "clip_eps_high": self.clip_eps_high,
            "loss_agg": self.loss_agg,
            "is_correction": self.correction(),
            "kl_coef": kl_coef,
            "kl_estimator": self.kl_estimator,
            "skip_zero_advantage": self.skip_zero_advantage,
        }


def _known(name: str, registry: tuple[str, ...], kind: str) -> str:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}")
    return name


class RolloutSection(_Section, title="Rollout"):
    prompts_per_step: int = Field(
        default=64, ge=1, le=100_000, description="Data rows per RL step."
    )
    group_size: int = Field(default=8, ge=1, le=4096, description="Samples per row (GRPO group).")
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature.")
    max_new_tokens: int = Field(
        default=8, ge=1, le=1_000_000, description="Token budget of one policy turn."
    )
    max_turns: int = Field(default=1, ge=1, description="Policy turns per episode.")
    unfinished_turn_reward: float = Field(
        default=0.0,
        le=0,
        description="Added to a turn's reward when the policy did not end it (cut at "
        "max_new_tokens): teaches it to stop; 0 = off.",
    )
    max_context_tokens: int = Field(
        default=256,
        ge=8,
        le=10_000_000,
        description="Token budget of an episode (at most the model's positions: checked when "
        "the model is prepared).",
    )

    def limits(self, greedy: bool = False) -> LoopLimits:
        """The agent loop's budgets; ``greedy`` samples at temperature 0 (evaluation)."""
        return LoopLimits(
            max_turns=self.max_turns,
            max_new_tokens=self.max_new_tokens,
            max_context_tokens=self.max_context_tokens,
            temperature=0.0 if greedy else self.temperature,
            unfinished_turn_reward=self.unfinished_turn_reward,
        )


class ScheduleSection(_Section, title="Schedule"):
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
        "1 update; the loss clips the ratio to the sampler's log-probs). The older spelling of "
        "max_staleness 0 / 1.",
    )
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        le=8,
        description="Updates a batch may be behind the trainer (k). 0: on-policy; 1: one step "
        "off (as off_policy_steps 1); k >= 2: asynchronous, k rollouts run ahead of the "
        "trainer side by side, the weights are synced after every update without waiting for "
        "them, and a batch more than k updates behind is dropped (counted). Unset = "
        "off_policy_steps.",
    )

    @model_validator(mode="after")
    def _one_bound(self) -> ScheduleSection:
        if self.max_staleness is not None and self.off_policy_steps not in (
            0,
            self.max_staleness,
        ):
            raise ValueError(
                f"schedule.off_policy_steps {self.off_policy_steps} and max_staleness "
                f"{self.max_staleness} disagree: set max_staleness only"
            )
        return self

    @property
    def staleness_bound(self) -> int:
        """k: how many updates a trained batch may be behind the trainer."""
        return self.off_policy_steps if self.max_staleness is None else self.max_staleness


class ResourcesSection(_Section, title="Resources"):
    sampler_backend: Literal["auto", "hf", "vllm"] = Field(
        default="auto",
        description="Sampler engine: hf (transformers' generate, in flowrl's venv), vllm "
        "(vLLM in a venv of its own, `make setup-vllm`; CPU or CUDA), or auto: picked when the "
        "job starts, vllm where its venv is there, the workers have GPUs (CPUs too with "
        "FLOWRL_VLLM_AUTO_ON_CPU), the model has at least FLOWRL_VLLM_AUTO_MIN_PARAMETERS "
        "parameters (1M) and can run on it (no images, not colocated, not a shared tenant), "
        "else hf; the job's log and its MLflow tags "
        "sampler_backend / sampler_backend.why say which and why. The sampler of rollouts, "
        "evaluations and batch inference.",
    )
    trainer_backend: Literal["torch", "deepspeed", "deepspeed_zero3"] = Field(
        default="torch", description="Trainer backend: torch, deepspeed (ZeRO-2), deepspeed_zero3."
    )
    gpus_per_worker: float = Field(
        default=0, ge=0, description="GPUs each of the sampler and trainer actors asks Ray for."
    )
    torch_threads: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        default="auto",
        description="torch threads per worker, or auto: on a CPU, the cores its workers would "
        "leave idle (FLOWRL_CPU_THREADS, unset = every core): a sampler and a trainer that take "
        "turns (on-policy) each get them all; one that trains while its samplers sample ahead "
        "keeps them all and each sampler half; GPU workers and shared workers' tenants 1. The "
        "job's log says what auto gave.",
    )
    trainer_threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="torch threads of the trainer, when it should have more than the samplers "
        "(e.g. all of a CPU machine's cores: one-step-off's trainer then takes the cores the "
        "sampler leaves idle); unset = torch_threads (auto: auto's trainer threads). Ray still "
        "counts the trainer as 1 CPU.",
    )
    samplers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Sampler actors per policy, spread over the cluster's nodes, each holding "
        "the synced weights; a rollout's groups are split between them.",
    )
    colocate: bool | None = Field(
        default=None,
        description="The sampler and the trainer in one actor process (a hybrid engine: one "
        "set of imports and one CUDA context; the hf sampler samples the trainer's own "
        "weights where they are in its precision: one copy, and a weight sync copies nothing). "
        "Unset = where the job never samples while it trains: on-policy, one sampler, the hf "
        "and torch backends.",
    )
    gpus: int = Field(
        default=0,
        ge=0,
        description="GPU slots the job holds for its whole run (scheduler's `gpu` limit); "
        "0 = CPU job.",
    )
    dtype: Precision = Field(
        default="auto",
        description="Precision of sampler and trainer: float32, bfloat16, or auto (bf16 on CUDA, "
        "and from 50M parameters on CPUs with AVX512-BF16/AMX; else float32; tags dtype(.why) "
        "say why). Trainer: float32 masters and AdamW state (bf16 autocast); log-probs float32.",
    )
    placement: Literal["own", "shared"] = Field(
        default="own",
        description="own: the job's workers hold their own copy of the model. shared (rl-train "
        "with model.lora, or batch inference of a LoRA version): the job is a tenant of the "
        "shared worker of its base model, which holds the base once for every such job and "
        "each job's adapter; the job holds one of its adapter slots (Prefect limit "
        "adapter-slots-<worker>), the worker its GPU slots.",
    )

    @model_validator(mode="after")
    def _colocate_one_sampler(self) -> ResourcesSection:
        if self.colocate and self.samplers > 1:
            raise ValueError(
                f"resources.colocate needs one sampler (resources.samplers={self.samplers})"
            )
        return self

    @model_validator(mode="after")
    def _vllm_in_a_process_of_its_own(self) -> ResourcesSection:
        if self.sampler_backend == "vllm" and self.colocate:
            raise ValueError(
                "resources.colocate with sampler_backend vllm: the vLLM engine runs in a "
                "process (and venv) of its own, apart from the trainer; leave colocate unset"
            )
        return self

    @model_validator(mode="after")
    def _shared_worker_runs_hf_and_torch(self) -> ResourcesSection:
        if self.placement != "shared":
            return self
        backends = (self.sampler_backend, self.trainer_backend)
        if (
            self.samplers > 1
            or backends[1] != "torch"
            or backends[0] == "vllm"
            or (self.colocate is False)
        ):
            raise ValueError(
                "resources.placement shared: a tenant has one sampler and one trainer on the "
                "shared worker (resources.samplers 1, sampler_backend hf or auto, trainer_backend "
                f"torch, colocate unset); got samplers={self.samplers}, backends={backends}, "
                f"colocate={self.colocate}"
            )
        return self

    def placement_for(
        self, on_policy: bool = True, shared_worker: SharedWorkerSettings | None = None
    ) -> Placement:
        """Where every policy of the job lives (``backends.policy.placement``; warm-up's too, except
        a shared tenant's, which warms up on workers of its own: ``tasks.model.warmup``):
        ``OwnWorkers`` with ``placement`` own, a ``SharedTenant`` with shared, as
        ``backends.policy.placement.place`` (the one place that decides) makes them from the
        job's resources. Its workers' build: the job's GPU slots split
        evenly between a policy's samplers and trainer unless set per worker (a colocated
        policy's one actor, or a shared worker, holds them all), its backends, torch threads and
        precision. ``on_policy``: the job never samples while it trains (``colocate`` unset).
        ``shared_worker`` (needed with ``placement`` shared): how the run finds or starts its
        shared worker, from its settings and Prefect API (``flows.lifecycle`` resolves them);
        the worker's GPU slots are the job's ``gpus``."""
        if self.placement == "shared" and shared_worker is None:
            raise ValueError(
                "resources.placement shared: placement_for() needs the run's shared_worker "
                "settings (flows.auto.shared_worker_settings)"
            )
        from flowrl.backends.policy.placement import place

        return place(
            self.placement,
            gpus=self.gpus,
            gpus_per_worker=self.gpus_per_worker,
            samplers=self.samplers,
            colocate=self.colocate,
            on_policy=on_policy,
            sampler_backend=self.sampler_backend,
            trainer_backend=self.trainer_backend,
            torch_threads=self.torch_threads,
            dtype=self.dtype,
            trainer_threads=self.trainer_threads,
            shared_worker=shared_worker,
        )


class SFTDataSection(_Section, title="SFT data"):
    train: RowFile = Field(
        description="Chat rows {'messages': [...]}: a .jsonl/.json/.parquet path or fsspec URL "
        "(s3://…)."
    )
    eval: RowFile | None = Field(
        default=None, description="Held-out chat rows (same format); unset = split off `train`."
    )
    eval_size: int = Field(
        default=200,
        ge=1,
        description="Rows held out of `train` for evaluation when `eval` is unset.",
    )


class SFTTrainSection(_Section, title="SFT training"):
    steps: int = Field(default=300, ge=1, description="Optimiser steps.")
    batch_size: int = Field(default=32, ge=1, description="Conversations per step.")
    learning_rate: float = Field(
        default=1e-3,
        gt=0,
        le=1,
        description="AdamW learning rate (3e-3 stalled on 3 of 8 seeds of the tiny arithmetic "
        "SFT; 1e-3 learned on all).",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    eval_every: int = Field(default=100, ge=1, description="Steps between held-out evaluations.")
    max_new_tokens: int = Field(
        default=16, ge=1, description="Token budget of a generated answer at evaluation."
    )


# ------------------------------------------------------------------------------- job kinds
