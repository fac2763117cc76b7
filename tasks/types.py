"""Small records that pass between stage tasks (picklable; no tensors, no models)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowrl.infra.settings import job_prefix

if TYPE_CHECKING:
    from flowrl.backends.policy.actors import PolicyRef


@dataclass(frozen=True)
class JobContext:
    """Where one job keeps its things. Every path is under the job's own storage prefix."""

    name: str
    storage_url: str
    """Root of the storage (any fsspec URL)."""
    cache_dir: str
    """Local folder for copies of remote models."""
    run_name: str
    """Unique per flow run: prefixes actor names so concurrent jobs never collide."""
    namespace: str | None = None
    """The job's owner (``FLOWRL_NAMESPACE``): a job is identified by (namespace, name)."""

    @property
    def prefix(self) -> str:
        return job_prefix(self.name, self.namespace)

    @property
    def cache_prefix(self) -> str:
        """Content-addressed results this namespace's jobs share (warm-up)."""
        return f"ns/{self.namespace}/cache" if self.namespace else "cache"

    @property
    def checkpoint_prefix(self) -> str:
        return f"{self.prefix}/checkpoints"

    def step_dir(self, step: int) -> str:
        """Where one step's records (trajectories, training data) live until consumed."""
        return f"{self.prefix}/steps/{step:08d}"


@dataclass(frozen=True)
class RolloutBatch:
    """What the rollout stage produced for one step (the episodes themselves are in storage)."""

    step: int
    trajectories: str
    """Storage-relative path of the step's trajectories (``tasks.records``)."""
    cursor: dict[str, Any]
    """Data-source state after this batch (saved in checkpoints)."""
    seconds: float
    weights_version: int | None = None
    """Version of the sampler's weights that sampled the batch (None: not recorded)."""


@dataclass(frozen=True)
class ScoredBatch:
    """Reward statistics and where the step's training data is, from the reward stage."""

    step: int
    data: str | None
    """Storage-relative path of the step's ``Datum`` list; None when no episode is trainable."""
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """A few transcripts for the sample-trajectories artifact."""
    weights_version: int | None = None
    """The rollout's ``RolloutBatch.weights_version``, for the update's staleness check."""
    rollout_seconds: float = 0.0
    """The rollout stage's own time (from its ``RolloutBatch``)."""
    seconds: float = 0.0
    """The reward stage's own time."""


@dataclass(frozen=True)
class UpdateResult:
    """What the update stage did: MLflow metrics (``train/*``) and where its time went."""

    metrics: dict[str, float]
    seconds: float
    """The whole stage."""
    train_seconds: float = 0.0
    """forward_backward + optim_step."""
    sync_seconds: float = 0.0
    """Weight sync trainer → sampler (0 when the flow syncs later, off-policy)."""


@dataclass(frozen=True)
class WarmupResult:
    """The model RL starts from, and how the SFT warm-up got there."""

    model_uri: str
    accuracy: float | None
    """Held-out accuracy at the end of warm-up (None: warm-up disabled or skipped)."""
    steps: int
    cached: bool
    """True when an earlier job's identical warm-up was reused from storage."""
    skipped: str | None = None
    """Why warm-up did not run (None when it ran or was disabled)."""
    workers: PolicyRef | None = None
    """The warm-up's workers, still running, when it ran with ``keep_workers``: the job
    restarts them from ``model_uri`` (``JobRun.start_policy(adopt=...)``)."""


@dataclass(frozen=True)
class DuelResult:
    """One self-play step's games: a ``RolloutBatch`` per trained policy, per-agent metrics."""

    batches: dict[str, RolloutBatch]
    metrics: dict[str, float]


@dataclass(frozen=True)
class InferenceOutput:
    """Where batch inference wrote its episodes (JSONL), and their metrics."""

    uri: str
    accuracy: float
    reward_mean: float
    num_episodes: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ExactMatch:
    """Greedy exact match of held-out conversations' last assistant turn (SFT evaluation)."""

    exact_match: float
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {"eval/exact_match": self.exact_match, "eval/seconds": self.seconds}


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    reward_mean: float
    num_episodes: int
    num_failed: int
    seconds: float
    env_metrics: dict[str, float] = field(default_factory=dict)
    """Environment-reported means over the held-out episodes (``env/<field>``)."""

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/reward_mean": self.reward_mean,
            f"{prefix}/failed": float(self.num_failed),
            f"{prefix}/seconds": self.seconds,
            **{f"{prefix}/{k}": v for k, v in self.env_metrics.items()},
        }
