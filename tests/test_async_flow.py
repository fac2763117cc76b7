"""Asynchronous RL (``schedule.max_staleness: 4``, issue 43) end to end on the e2e test's job
(real Prefect API, Ray and MLflow; fixed seeds): it learns by the e2e bar, every batch is at
most 4 updates old (in steady state exactly 4), and the rollouts of later steps run while
earlier updates run; a shared worker's tenant runs asynchronously too. Resume after SIGKILL:
tests/test_resume_kill.py."""

from __future__ import annotations

import pytest
from services import assert_learns, metric_history

from flowrl.tasks.schemas import load_job

pytestmark = pytest.mark.e2e

STEPS, K = 80, 4


@pytest.fixture(scope="module")
def trained(prefect_api, flowrl_home):
    from flowrl.flows.rl import rl_train

    config = load_job(
        None,
        [
            "name=async-e2e",
            f"schedule.steps={STEPS}",
            "schedule.eval_every=40",
            "schedule.checkpoint_every=40",
            f"schedule.max_staleness={K}",
            "rollout.prompts_per_step=32",
        ],
    )
    return config, rl_train(config)


def test_reward_and_held_out_accuracy_rise_at_staleness_four(trained):
    assert_learns(trained[1], STEPS, f"k={K}")


def test_batches_are_at_most_k_updates_old_and_none_was_dropped(trained):
    _, result = trained
    staleness = metric_history(result.mlflow_run_id, "train/staleness")
    assert len(staleness) == STEPS and all(0 <= s <= K for s in staleness)
    # Steps 1..k train rollouts started before any update; from then on each rollout was
    # started k updates before it was trained.
    assert staleness[:K] == list(range(K)) and set(staleness[K:]) <= {K - 1, K}, staleness
    assert sum(metric_history(result.mlflow_run_id, "train/dropped_batches")) == 0


def test_a_shared_workers_tenant_runs_asynchronously(prefect_api, flowrl_home):
    """``resources.placement: shared`` at ``max_staleness: 3``: the tenant's rollouts run up to
    three updates ahead on the shared worker (its sampler adapter synced from its trainer
    adapter between updates), each batch trained at the staleness the stream promises, and
    the job registers a policy."""
    from flowrl.flows.rl import rl_train

    steps, k = 8, 3
    config = load_job(
        None,
        [
            "name=async-shared",
            "model.lora.enabled=true",
            "resources.placement=shared",
            f"schedule.max_staleness={k}",
            f"schedule.steps={steps}",
            "schedule.eval_every=8",
            "schedule.checkpoint_every=8",
            "rollout.prompts_per_step=8",
        ],
    )
    result = rl_train(config)
    assert result.steps == steps and result.model_uri.startswith("models:/")
    staleness = metric_history(result.mlflow_run_id, "train/staleness")
    assert staleness[:k] == list(range(k)) and set(staleness[k:]) <= {k - 1, k}, staleness
    assert sum(metric_history(result.mlflow_run_id, "train/dropped_batches")) == 0
