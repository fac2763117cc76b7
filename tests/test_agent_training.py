"""Agents of the user's own train as they are (issue 42): examples/agents' plain ``openai``-SDK
calculator agent and its LangGraph twin, through rollout sessions, under ``rl_train`` on a real
Prefect API, Ray and MLflow store, with fixed seeds. Both play one task, so the second reuses
the first's warm-up.

The bar is issue 42's: held-out reward (here accuracy: the task gives no format reward) rises
by the e2e test's 0.05, and the training reward rises. The warm-up stops at 0.2 (the
examples' configs): stopped at 0.3 it left RL too little room for a rise 50 greedy
episodes show reliably (docs/openai.md). 100 held-out rows: with 50, the Intel machine's
trajectories (pinned and native) missed the bar that the AMD machine's met. The rollout
sessions sample in lockstep (``sessions.Batcher``), so these runs are the same however loaded
the machine is; both agents send the same requests, so their figures are the same too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from services import assert_learns, metric_history

from flowrl.tasks.schemas import load_job

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agents"
STEPS = 60
# Warm-up stops at the first check at or over 0.2 (every 10 SFT steps): the tiny model learns
# the call format abruptly, so this leaves RL room to improve whichever kernels ran it.
OVERRIDES = [
    f"schedule.steps={STEPS}",
    "schedule.eval_every=60",
    "schedule.checkpoint_every=60",
    "warmup.eval_every=10",
    "env.params.task_params.eval_size=100",
]


@pytest.fixture(scope="module", params=["calculator-agent", "langgraph-agent"])
def trained(request, prefect_api, flowrl_home):
    from flowrl.flows.rl import rl_train

    sys.path.insert(0, str(EXAMPLE))  # PYTHONPATH=examples/agents, as the examples say
    try:
        config = load_job(str(EXAMPLE / f"{request.param}.yaml"), OVERRIDES)
        yield config, rl_train(config)
    finally:
        sys.path.remove(str(EXAMPLE))


def test_the_agent_learns(trained):
    config, result = trained
    assert_learns(result, STEPS, config.name, min_rise=0.0, min_held_out_rise=0.05)


def test_its_episodes_were_played_through_sessions_and_none_failed(trained):
    _, result = trained
    requests = metric_history(result.mlflow_run_id, "env/requests")
    assert len(requests) == STEPS and all(1.0 <= r <= 3.0 for r in requests)
    failed = metric_history(result.mlflow_run_id, "rollout/failed_episodes")
    assert sum(failed) <= 0.01 * STEPS * 128, failed  # 128 episodes a step
