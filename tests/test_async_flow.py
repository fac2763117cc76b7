"""Asynchronous RL (``schedule.max_staleness: 4``, issue 43) end to end on the e2e test's job
(real Prefect API, Ray and MLflow; fixed seeds): it learns by the e2e bar, every batch is at
most 4 updates old (in steady state exactly 4), and the rollouts of later steps run while
earlier updates run. Resume after SIGKILL: tests/test_resume_kill.py."""

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
