"""The RL flow's rollouts, on-policy or sampled up to k steps ahead of their update
(``schedule.max_staleness``), and the time accounting of a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefect.futures import PrefectFuture

from flowrl.backends.policy.actors import PolicyRef
from flowrl.tasks.rl import weight_sync
from flowrl.tasks.types import RolloutBatch, ScoredBatch, UpdateResult


@dataclass(frozen=True)
class Settled:
    """What ``RolloutStream.settle`` waited for (off-policy): the rollout sampled ahead, and
    the weight sync after it."""

    rollout_ahead_seconds: float | None
    """None with k >= 2: the flow waits for no rollout there."""
    sync_seconds: float


def step_times(
    wall: float, scored: ScoredBatch, update: UpdateResult, settled: Settled | None
) -> dict[str, float]:
    """A step's ``time/*`` metrics. The critical path is rollout → reward → update on-policy;
    one step ahead, the next rollout runs beside reward + update, then the sync. Overhead is
    the rest of the step's wall time: orchestration."""
    stages = scored.seconds + update.seconds
    if settled is None:
        critical, sync = scored.rollout_seconds + stages, update.sync_seconds
    else:
        critical = max(settled.rollout_ahead_seconds or 0.0, stages) + settled.sync_seconds
        sync = settled.sync_seconds
    waited = None if settled is None else settled.rollout_ahead_seconds
    ahead = {} if waited is None else {"time/rollout_ahead_s": waited}
    return ahead | {
        "time/rollout_s": scored.rollout_seconds,
        "time/reward_s": scored.seconds,
        "time/update_s": update.seconds,
        "time/train_s": update.train_seconds,
        "time/sync_s": sync,
        "time/step_s": wall,
        "time/overhead_s": wall - critical,
    }


class RolloutStream:
    """The run's rollouts, each started up to ``ahead`` steps before its update
    (``schedule.max_staleness``, k).

    ``ahead=0``: step n's rollout starts when ``take(n)`` is called, after update n-1 and its
    weight sync: on-policy. ``ahead=1``: as soon as step n's batch is in, step n+1's rollout
    starts on the sampler, so it runs while update n runs on the trainer; ``settle`` then waits
    for it and syncs the weights. Each batch is sampled by weights one update behind the trainer
    (staleness 1; the first step and the first step after a resume: 0).

    ``ahead=k >= 2`` (asynchronous): when step n's batch is in, the rollouts of steps n+1 …
    n+k are running (each started once, side by side, each on the rows after the one before:
    it skips the batches of the steps between the last known cursor and its own), and
    ``settle`` syncs the weights at once, without waiting for them: a rollout in flight samples
    its later calls with the newer weights. A batch is trained at most k updates after the
    weights its rollout started with (``tasks.rl.update`` drops one further behind, counted).

    With ``ahead <= 1``, between ``settle`` and the next ``take`` nothing runs: eval and
    checkpoints see the sampler equal to the trainer. A checkpoint's cursor is that of the last
    *trained* batch, so the rollouts sampled ahead are not in it: a resumed run samples those
    steps again, from the checkpoint's weights.
    """

    def __init__(
        self,
        start_rollout: Callable[[int, dict | None, int], PrefectFuture],
        cursor: dict | None,
        ahead: int,
        total_steps: int,
    ):
        self._start = start_rollout
        self._cursor = cursor
        self._ahead = ahead
        self._total = total_steps
        self._pending: dict[int, PrefectFuture] = {}

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch; with ``ahead=k`` also starts the rollouts up to step
        ``step + k`` that are not running yet."""
        future = self._pending.pop(step, None) or self._start(step, self._cursor, 0)
        batch = future.result()
        self._cursor = batch.cursor
        for later in range(step + 1, min(step + self._ahead, self._total - 1) + 1):
            if later not in self._pending:  # the rows after step `step`'s, and the ones between
                self._pending[later] = self._start(later, batch.cursor, later - step - 1)
        return batch

    def settle(self, policy: PolicyRef) -> Settled | None:
        """After an update: with ``ahead=1`` wait for the rollout sampled ahead, then sync the
        weights; with ``ahead >= 2`` sync them at once (the rollouts in flight go on); with
        ``ahead=0`` the update has synced them already: None."""
        if not self._ahead:
            return None
        if self._ahead >= 2:
            return Settled(rollout_ahead_seconds=None, sync_seconds=weight_sync(policy))
        pending = next(iter(self._pending.values()), None)  # one step off: at most one
        ahead_s = pending.result().seconds if pending is not None else 0.0
        # Called, not submitted: a task run in the flow process (~5 ms, not a Ray task's ~150).
        return Settled(rollout_ahead_seconds=ahead_s, sync_seconds=weight_sync(policy))
