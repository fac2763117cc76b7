"""The RL flow's rollouts, on-policy or sampled one step ahead of their update, and the time
accounting of a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefect.futures import PrefectFuture

from flowrl.backends.actors import PolicyRef
from flowrl.tasks.rl import weight_sync
from flowrl.tasks.types import RolloutBatch, ScoredBatch, UpdateResult


@dataclass(frozen=True)
class Settled:
    """What ``RolloutStream.settle`` waited for (off-policy): the rollout sampled ahead, and
    the weight sync after it."""

    rollout_ahead_seconds: float
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
        critical = max(settled.rollout_ahead_seconds, stages) + settled.sync_seconds
        sync = settled.sync_seconds
    ahead = {} if settled is None else {"time/rollout_ahead_s": settled.rollout_ahead_seconds}
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
    """The run's rollouts, each started ``ahead`` steps before its update
    (``schedule.off_policy_steps``).

    ``ahead=0``: step n's rollout starts when ``take(n)`` is called, after update n-1 and its
    weight sync: on-policy. ``ahead=1``: as soon as step n's batch is in, step n+1's rollout
    starts on the sampler, so it runs while update n runs on the trainer; ``settle`` then waits
    for it and syncs the weights. Each batch is sampled by weights one update behind the trainer
    (staleness 1; the first step and the first step after a resume: 0).

    Between ``settle`` and the next ``take`` nothing runs: eval and checkpoints see the sampler
    equal to the trainer. A checkpoint's cursor is that of the last *trained* batch, so the
    rollout sampled ahead is not in it: a resumed run samples that step again, from the
    checkpoint's weights.
    """

    def __init__(
        self,
        start_rollout: Callable[[int, dict | None], PrefectFuture],
        cursor: dict | None,
        ahead: int,
        total_steps: int,
    ):
        self._start = start_rollout
        self._cursor = cursor
        self._ahead = ahead
        self._total = total_steps
        self._pending: PrefectFuture | None = None

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch; with ``ahead=1`` also starts step ``step + 1``'s rollout."""
        future = self._pending or self._start(step, self._cursor)
        batch = future.result()
        self._cursor, self._pending = batch.cursor, None
        if self._ahead and step + 1 < self._total:
            self._pending = self._start(step + 1, batch.cursor)
        return batch

    def settle(self, policy: PolicyRef) -> Settled | None:
        """After an update: wait for the rollout sampled ahead, then sync the weights (with
        ``ahead=0`` the update has synced them already: None)."""
        if not self._ahead:
            return None
        ahead_s = self._pending.result().seconds if self._pending is not None else 0.0
        # Called, not submitted: a task run in the flow process (~5 ms, not a Ray task's ~150).
        return Settled(rollout_ahead_seconds=ahead_s, sync_seconds=weight_sync(policy))
