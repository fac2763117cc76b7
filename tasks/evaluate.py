"""The evaluation stage: one model on one environment's held-out set, greedy and sampled.

Greedy accuracy is training's own held-out evaluation (``evaluate_policy``: the same episodes,
success rule and numbers); pass@k and avg@n come from ``n`` sampled episodes per prompt with the
unbiased estimator of Chen et al. (2021): with ``c`` of ``n`` samples correct,
``pass@k = 1 - C(n - c, k) / C(n, k)``, averaged over prompts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.backends.policy.actors import PolicyRef
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.episodes import (
    episode_source,
    episode_succeeded,
    evaluate_policy,
    run_group_episodes,
)
from flowrl.tasks.schemas import EnvSection, ModelSection, RolloutSection
from flowrl.tasks.types import JobContext


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from ``n``
    (``c`` of them correct) is correct: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalSpec:
    """What ``score_model`` needs of a job: the environment and how to sample."""

    env: EnvSection
    model: ModelSection
    rollout: RolloutSection
    seed: int = 0
    samples: int = 0
    k: tuple[int, ...] = ()
    num_prompts: int | None = None


@dataclass(frozen=True)
class ModelScore:
    """One model on one environment."""

    env: str
    prompts: int
    greedy_accuracy: float
    reward_mean: float
    """Mean reward of the greedy episodes."""
    failed: int
    """Greedy and sampled episodes whose environment raised or hung."""
    truncated: int
    """Greedy and sampled episodes cut by the token or turn limits."""
    samples: int
    pass_at: dict[int, float] = field(default_factory=dict)
    avg_at: float | None = None
    """Mean success over the ``samples`` sampled episodes of each prompt (avg@samples)."""
    seconds: float = 0.0

    def metrics(self, prefix: str) -> dict[str, float]:
        """The scores as MLflow metrics under ``prefix`` (``pass_at_<k>``, ``avg_at_<n>``:
        MLflow keys allow no ``@``)."""
        out = {
            f"{prefix}/greedy_accuracy": self.greedy_accuracy,
            f"{prefix}/reward_mean": self.reward_mean,
            f"{prefix}/failed": float(self.failed),
            f"{prefix}/truncated": float(self.truncated),
        }
        out |= {f"{prefix}/pass_at_{k}": v for k, v in sorted(self.pass_at.items())}
        if self.avg_at is not None:
            out[f"{prefix}/avg_at_{self.samples}"] = self.avg_at
        return out


@task(name="score-model", cache_policy=NO_CACHE)
def score_model(spec: EvalSpec, ctx: JobContext, model_uri: str, policy: PolicyRef) -> ModelScore:
    """Greedy accuracy on the held-out set (as training evaluates), then ``spec.samples``
    sampled episodes per prompt for pass@k and avg@samples."""
    start = time.perf_counter()
    task_cfg = spec.env.task(spec.seed)
    chat = chat_format(model_uri, ctx.cache_dir, spec.model)
    make_env = episode_source(spec.env, ctx.run_name)
    rows = task_cfg.eval_set()[: spec.num_prompts]
    limits = spec.rollout.limits(greedy=True)
    greedy = evaluate_policy(task_cfg, policy, chat, limits, make_env, spec.env.success, rows)
    failed, truncated = greedy.num_failed, _truncated(greedy.env_metrics, greedy.num_episodes)
    pass_at: dict[int, float] = {}
    avg_at = None
    if spec.samples:
        episodes = run_group_episodes(
            make_env,
            rows,
            spec.samples,
            policy,
            chat,
            spec.rollout.limits(),
            seed=spec.seed,
            id_prefix="eval-sampled",
        )
        correct = [0] * len(rows)
        for i, t in enumerate(episodes):
            ok = not t.failed and episode_succeeded(spec.env.success, t.reward, t.info)
            correct[i // spec.samples] += ok
            failed += t.failed
            truncated += t.stop_reason is not None and t.stop_reason.value.startswith("max_")
        n = spec.samples
        pass_at = {k: _mean(pass_at_k(n, c, k) for c in correct) for k in spec.k}
        avg_at = _mean(c / n for c in correct)
    return ModelScore(
        env=spec.env.name,
        prompts=len(rows),
        greedy_accuracy=greedy.accuracy,
        reward_mean=greedy.reward_mean,
        failed=failed,
        truncated=truncated,
        samples=spec.samples,
        pass_at=pass_at,
        avg_at=avg_at,
        seconds=time.perf_counter() - start,
    )


def _truncated(env_metrics: dict[str, float], episodes: int) -> int:
    share = sum(v for k, v in env_metrics.items() if k.startswith("env/stop_max_"))
    return round(share * episodes)


def _mean(values) -> float:  # noqa: ANN001 - any iterable of numbers
    items = list(values)
    return sum(items) / len(items) if items else 0.0
