"""Per-step records: handed from stage to stage in the flow process's memory, bounded, and
spilled to storage (then read back from there) only past the bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.agent_loop.types import StopReason, Trajectory
from flowrl.backends.types import Datum
from flowrl.infra.storage import Storage
from flowrl.tasks import records


def _trajectory(i: int) -> Trajectory:
    return Trajectory(
        f"s0-{i}",
        i,
        tokens=[1, 2, 3 + i],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.25],
        turn_rewards=[1.0],
        stop_reason=StopReason.DONE,
        messages=[{"role": "user", "content": "1+1="}],
        info={"correct": True},
    )


def test_records_pass_in_memory_and_leave_nothing_in_storage(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    batch = [_trajectory(i) for i in range(3)]
    records.save_trajectories(storage, "jobs/j/steps/1/trajectories.json", batch)
    records.save_data(storage, "jobs/j/steps/1/data.json", [Datum([1, 2], [0, 1], 0.5)])
    assert records.load_trajectories(storage, "jobs/j/steps/1/trajectories.json") == batch
    assert not storage.exists("jobs/j/steps/1/trajectories.json")  # no JSON on the way
    records.discard(storage, "jobs/j/steps/1")
    with pytest.raises(FileNotFoundError):  # consumed: gone from memory too
        records.load_data(storage, "jobs/j/steps/1/data.json")


def test_past_the_bound_the_oldest_records_go_to_storage_and_load_from_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "MEMO_ENTRIES", 2)
    storage = Storage(str(tmp_path))
    batches = {step: [_trajectory(step)] for step in range(4)}
    for step, batch in batches.items():
        records.save_trajectories(storage, f"jobs/j/steps/{step}/trajectories.json", batch)
    spilled = [s for s in batches if storage.exists(f"jobs/j/steps/{s}/trajectories.json")]
    assert spilled == [0, 1]  # the two oldest; the two newest are still in memory
    for step, batch in batches.items():
        assert records.load_trajectories(storage, f"jobs/j/steps/{step}/trajectories.json") == batch
    for step in batches:
        records.discard(storage, f"jobs/j/steps/{step}")
    assert not storage.exists("jobs/j/steps/0") and not storage.exists("jobs/j/steps/1")


def test_records_of_two_storages_with_the_same_path_stay_apart(tmp_path: Path) -> None:
    a, b = Storage(str(tmp_path / "a")), Storage(str(tmp_path / "b"))
    records.save_trajectories(a, "steps/1/t.json", [_trajectory(1)])
    records.save_trajectories(b, "steps/1/t.json", [_trajectory(2)])
    assert records.load_trajectories(a, "steps/1/t.json") == [_trajectory(1)]
    assert records.load_trajectories(b, "steps/1/t.json") == [_trajectory(2)]
    records.discard(a, "steps/1")
    assert records.load_trajectories(b, "steps/1/t.json") == [_trajectory(2)]
    records.discard(b, "steps/1")
