"""One-step-off RL (``schedule.off_policy_steps: 1``): step n+1's rollout is started before
update n ends, every batch is at most one update old, and a checkpoint holds only trained
batches, so a resumed job neither trains a batch twice nor skips one.

The rollout pipeline is tested with fake futures; the flow end to end on the real Prefect API,
Ray and MLflow (one 6-step job, ~50 s of its own on 2 cores)."""

from __future__ import annotations

import pytest
from services import metric_history

from flowrl.tasks.schemas import load_job
from flowrl.tasks.types import RolloutBatch

STEPS, ROWS, EVERY = 6, 4, 3
PREFIX = "jobs/off-policy-e2e/checkpoints"


class _Done:
    """A finished future."""

    def __init__(self, value: RolloutBatch):
        self.value = value

    def result(self) -> RolloutBatch:
        return self.value


def _stream(ahead: int, start_cursor: dict | None = None, total: int = 4):
    """A RolloutStream over fake rollouts of ROWS rows each; records every (step, cursor)
    it starts a rollout at."""
    from flowrl.flows.rollouts import RolloutStream

    started: list[tuple[int, dict | None]] = []

    def start(step: int, cursor: dict | None, skip: int) -> _Done:
        started.append((step, cursor) if not skip else (step, cursor, skip))
        index = (cursor or {"index": 0})["index"] + ROWS * (skip + 1)
        return _Done(RolloutBatch(step, f"steps/{step}", {"index": index}, 0.1, 0))

    return RolloutStream(start, start_cursor, ahead, total), started


def test_one_step_off_starts_the_next_rollout_with_the_batch_and_none_past_the_end():
    stream, started = _stream(ahead=1)
    assert stream.take(0).step == 0
    assert started == [(0, None), (1, {"index": 4})]  # step 1 runs during update 0
    for step in (1, 2, 3):
        assert stream.take(step).step == step
    assert started[-1] == (3, {"index": 12}) and len(started) == 4  # nothing for step 4


def test_k_ahead_starts_k_rollouts_side_by_side_each_past_the_steps_between():
    """max_staleness 3: taking step 0 starts steps 1-3 at once, on the rows after step 0's
    (step 2 skips step 1's batch, step 3 two batches); each later take starts one more, none
    past the end; every batch's cursor is where the next step's rows begin."""
    stream, started = _stream(ahead=3, total=6)
    batches = [stream.take(0)]
    assert started == [(0, None), (1, {"index": 4}), (2, {"index": 4}, 1), (3, {"index": 4}, 2)]
    batches.append(stream.take(1))
    assert started[-1] == (4, {"index": 8}, 2)
    batches += [stream.take(step) for step in (2, 3, 4, 5)]
    assert [s[0] for s in started] == [0, 1, 2, 3, 4, 5]  # each step once, none past the end
    assert [b.cursor["index"] for b in batches] == [4, 8, 12, 16, 20, 24]


def test_on_policy_starts_each_rollout_only_when_taken():
    stream, started = _stream(ahead=0)
    stream.take(0)
    assert started == [(0, None)]
    stream.take(1)
    assert started == [(0, None), (1, {"index": 4})]


def test_resumed_stream_samples_its_first_step_again_from_the_checkpoint_cursor():
    # The checkpoint after 2 steps holds the cursor of the 2 trained batches; the rollout of
    # step 2 that was sampled ahead is not in it, so it is sampled again (new weights).
    stream, started = _stream(ahead=1, start_cursor={"index": 8})
    assert stream.take(2).cursor == {"index": 12}
    assert started == [(2, {"index": 8}), (3, {"index": 12})]


def test_settle_waits_for_the_rollout_ahead_then_syncs(monkeypatch):
    import flowrl.flows.rollouts

    synced = []
    monkeypatch.setattr(flowrl.flows.rollouts, "weight_sync", lambda p: synced.append(p) or 1.0)
    stream, _ = _stream(ahead=1)
    stream.take(0)
    settled = stream.settle("policy")
    assert (settled.rollout_ahead_seconds, settled.sync_seconds) == (0.1, 1.0)
    assert synced == ["policy"]
    on_policy, _ = _stream(ahead=0)
    on_policy.take(0)
    assert on_policy.settle("policy") is None and synced == ["policy"]  # update synced already


def test_k_ahead_syncs_at_once_without_waiting_for_the_rollouts_in_flight(monkeypatch):
    import flowrl.flows.rollouts
    from flowrl.flows.rollouts import RolloutStream

    class _InFlight:
        def result(self):  # noqa: ANN202 - a rollout that has not ended: waiting is a bug
            raise AssertionError("settle waited for a rollout in flight")

    def start(step: int, cursor: dict | None, skip: int):  # noqa: ANN202
        if step == 0:
            return _Done(RolloutBatch(0, "steps/0", {"index": ROWS}, 0.1, 0))
        return _InFlight()

    synced = []
    monkeypatch.setattr(flowrl.flows.rollouts, "weight_sync", lambda p: synced.append(p) or 1.0)
    stream = RolloutStream(start, None, 3, 6)
    stream.take(0)
    settled = stream.settle("policy")
    assert settled.rollout_ahead_seconds is None and settled.sync_seconds == 1.0
    assert synced == ["policy"]


@pytest.fixture(scope="module")
def job(prefect_api, flowrl_home):
    from flowrl.flows.rl import rl_train

    config = load_job(
        None,
        [
            "name=off-policy-e2e",
            "warmup.enabled=false",  # learning is not what this test is about: keep it fast
            f"schedule.steps={STEPS}",
            "schedule.off_policy_steps=1",
            f"schedule.checkpoint_every={EVERY}",
            "schedule.eval_every=100",
            f"rollout.prompts_per_step={ROWS}",
            "rollout.group_size=4",
            "env.params.eval_size=20",
        ],
    )
    return rl_train(config, return_state=True)


@pytest.mark.e2e
def test_batches_are_at_most_one_update_old(job):
    # Step 1 trains on weights v0's batch with the trainer at v0; every later batch was sampled
    # while the previous update ran: one update old. The update fails a step beyond that.
    assert metric_history(job.result().mlflow_run_id, "train/staleness") == [0, 1, 1, 1, 1, 1]


@pytest.mark.e2e
def test_next_rollout_starts_before_the_update_ends(job):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[job.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=flow_filter, limit=200)
    by_name: dict[str, list] = {}
    for r in sorted(task_runs, key=lambda r: r.start_time):
        by_name.setdefault(r.name.rsplit("-", 1)[0], []).append(r)
    rollouts, updates = by_name["rollout"], by_name["update"]
    assert len(rollouts) == len(updates) == len(by_name["sync"]) == STEPS
    for n in range(STEPS - 1):  # rollout n+1 was not held back until update n was done
        assert rollouts[n + 1].start_time < updates[n].end_time, n


@pytest.mark.e2e
def test_checkpoints_hold_trained_batches_only(job, flowrl_home):
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage, load_checkpoint

    storage = Storage(get_settings().storage_root)
    # When step 3's checkpoint was taken, step 4's rollout was done too: it is not in it.
    _, meta = load_checkpoint(storage, PREFIX, EVERY)
    assert meta["cursor"] == {"index": EVERY * ROWS} and meta["weights_version"] == EVERY
    _, meta = load_checkpoint(storage, PREFIX, STEPS)
    assert meta["cursor"] == {"index": STEPS * ROWS} and meta["weights_version"] == STEPS
    result = job.result()
    assert result.steps == STEPS and result.model_uri.startswith("models:/off-policy-e2e/")
