"""The rl-train flow with ``schedule.off_policy_steps: 1`` (one-step-off), end to end on the real
Prefect API, Ray and MLflow: step n+1's rollout is started before update n ends, every batch is
at most one update old, and a resumed job neither trains a batch twice nor skips one."""

from __future__ import annotations

import pytest

from infra.config import load_config

pytestmark = pytest.mark.e2e

FIRST, TOTAL, ROWS, EVERY = 6, 9, 4, 3
PREFIX = "jobs/off-policy-e2e/checkpoints"


def _config(steps: int):
    return load_config(
        None,
        [
            "name=off-policy-e2e",
            "warmup.enabled=false",  # learning is not what this test is about: keep it fast
            f"schedule.steps={steps}",
            "schedule.off_policy_steps=1",
            f"schedule.checkpoint_every={EVERY}",
            "schedule.eval_every=100",
            f"rollout.prompts_per_step={ROWS}",
            "rollout.group_size=4",
            "env.params.eval_size=20",
        ],
    )


@pytest.fixture(scope="module")
def runs(prefect_api, flowrl_home):
    """A 6-step job, as if it had crashed right after its step-3 checkpoint (while step 4's
    rollout, sampled ahead, was already done), resubmitted for 9 steps: it resumes at 3."""
    import ray

    from flows.rl import rl_train
    from infra.settings import get_settings
    from infra.storage import Storage, load_checkpoint, step_dir

    # Both flow runs join this Ray instead of starting their own (prefect-ray reuses it).
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="flowrl")
    try:
        first = rl_train(_config(FIRST), return_state=True)
        storage = Storage(get_settings().storage_root)
        _, meta_at_3 = load_checkpoint(storage, PREFIX, EVERY)
        storage.delete(step_dir(PREFIX, FIRST))  # the crash: steps 4-6 reached no checkpoint
        storage.delete(f"{PREFIX}/LATEST.json")
        second = rl_train(_config(TOTAL))
    finally:
        ray.shutdown()
    return first, meta_at_3, second


def _history(run_id: str, metric: str) -> list[tuple[int, float]]:
    """(step, value) in the order logged (a resumed job logs the redone steps again)."""
    from infra.tracking import client

    points = sorted(client().get_metric_history(run_id, metric), key=lambda m: m.timestamp)
    return [(m.step, m.value) for m in points]


def test_batches_are_at_most_one_update_old(runs):
    first, _, second = runs
    assert first.result().mlflow_run_id == second.mlflow_run_id  # the resumed job, same run
    staleness = _history(second.mlflow_run_id, "train/staleness")
    # Step 1 trains on weights v0's batch with the trainer at v0; every later batch was sampled
    # while the previous update ran (one update old). The first step after the resume samples
    # again from the checkpoint's weights, so it is on-policy, as the README says.
    first_run = [(1, 0.0)] + [(s, 1.0) for s in range(2, FIRST + 1)]
    resumed = [(EVERY + 1, 0.0)] + [(s, 1.0) for s in range(EVERY + 2, TOTAL + 1)]
    assert staleness == first_run + resumed


def test_next_rollout_starts_before_the_update_ends(runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    first, _, _ = runs
    flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[first.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=flow_filter, limit=200)
    by_name: dict[str, list] = {}
    for r in sorted(task_runs, key=lambda r: r.start_time):
        by_name.setdefault(r.name.rsplit("-", 1)[0], []).append(r)
    rollouts, updates = by_name["rollout"], by_name["update"]
    assert len(rollouts) == len(updates) == len(by_name["sync"]) == FIRST
    for n in range(FIRST - 1):  # rollout n+1 was not held back until update n was done
        assert rollouts[n + 1].start_time < updates[n].end_time, n


def test_checkpoints_hold_trained_batches_only_and_resume_continues(runs, flowrl_home):
    from infra.settings import get_settings
    from infra.storage import Storage, load_latest_checkpoint

    first, meta_at_3, second = runs
    # Step 4's rollout was done when step 3's checkpoint was taken, but it is not in it.
    assert meta_at_3["cursor"] == {"index": EVERY * ROWS}
    assert meta_at_3["weights_version"] == EVERY
    assert second.resumed_from == EVERY and second.steps == TOTAL
    step, _, meta = load_latest_checkpoint(Storage(get_settings().storage_root), PREFIX)
    assert step == TOTAL and meta["cursor"] == {"index": TOTAL * ROWS}
    assert meta["weights_version"] == TOTAL
    assert second.model_uri.startswith("models:/off-policy-e2e/")
