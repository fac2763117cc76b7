"""The self-play flow end to end on tiny policies: phase barriers read from Prefect's own
task-run records, per-agent metrics in MLflow, one registered version per agent."""

from __future__ import annotations

import pytest

from flowrl.tasks.schemas import SelfPlayJobConfig

pytestmark = pytest.mark.e2e

STEPS = 3


@pytest.fixture(scope="module")
def played(prefect_api, flowrl_home):
    from flowrl.flows.selfplay import self_play

    config = SelfPlayJobConfig.model_validate(
        {
            "name": "duel-e2e",
            "warmup": {"enabled": False},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
            "schedule": {"steps": STEPS, "eval_every": 2, "checkpoint_every": 10},
            "env": {
                "name": "gomoku",
                "params": {"size": 3, "win_length": 3, "move_format": "cell", "eval_size": 4},
            },
        }
    )
    state = self_play(config, return_state=True)
    return config, state.result(), state.state_details.flow_run_id


def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return sorted(runs, key=lambda r: r.start_time)


def test_no_update_starts_before_the_rollout_phase_ends_and_vice_versa(played):
    _, _, flow_run_id = played
    runs = _task_runs(flow_run_id)
    rollouts = [r for r in runs if r.name.startswith("duel-rollout")]
    updates = [r for r in runs if r.name.startswith("update")]
    assert len(rollouts) == STEPS and len(updates) == 2 * STEPS
    for step, rollout in enumerate(rollouts):
        phase = updates[2 * step : 2 * step + 2]  # both agents' updates of this step
        assert all(u.start_time >= rollout.end_time for u in phase)
        if step + 1 < STEPS:
            assert all(u.end_time <= rollouts[step + 1].start_time for u in phase)


def test_each_agent_has_its_own_policy_metrics_and_registered_version(played):
    from flowrl.infra.tracking import client

    config, result, _ = played
    assert set(result.model_uris) == {"X", "O"}
    assert result.model_uris["X"].startswith("models:/duel-e2e-X/")
    assert result.model_uris["O"].startswith("models:/duel-e2e-O/")
    run = client().get_run(result.mlflow_run_id)
    for agent in ("X", "O"):
        assert f"agent-{agent}/outcome" in run.data.metrics
        assert f"agent-{agent}/invalid_moves" in run.data.metrics
        assert f"eval/{agent}/accuracy" in run.data.metrics  # score vs the heuristic
        assert f"{agent}/train/loss" in run.data.metrics
    history = client().get_metric_history(result.mlflow_run_id, "eval/X/accuracy")
    assert len(history) >= 2  # logged at each evaluation, not only at the end
    assert {"h2h/x_wins", "h2h/o_wins", "h2h/draws"} <= set(run.data.metrics)
    h2h = sum(run.data.metrics[k] for k in ("h2h/x_wins", "h2h/o_wins", "h2h/draws"))
    assert h2h == 2


def test_outcomes_are_zero_sum(played):
    """Each game's +1/-1/0 is attributed to the right player: the agents' means cancel."""
    from flowrl.infra.tracking import client

    _, result, _ = played
    x = client().get_metric_history(result.mlflow_run_id, "agent-X/outcome")
    o = client().get_metric_history(result.mlflow_run_id, "agent-O/outcome")
    assert len(x) == len(o) == STEPS
    for a, b in zip(sorted(x, key=lambda m: m.step), sorted(o, key=lambda m: m.step), strict=True):
        assert a.value == pytest.approx(-b.value)
