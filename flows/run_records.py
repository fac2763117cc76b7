"""A job run's records on their way to MLflow: metrics, JSON artifacts and tags go through a
durable outbox (``infra/outbox.py``), on disk first, then delivered by one background thread,
in order, off the step's path, a few steps per write; an MLflow outage delays them and not the
job. ``JobRun`` (``flows/lifecycle.py``) holds one per run."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

from flowrl.flows.run_page import RunPage
from flowrl.infra import tracking
from flowrl.infra.outbox import Outbox
from flowrl.infra.settings import get_settings

METRIC_WRITE_STEPS = 10
"""``JobRun.log`` writes to MLflow once this many steps' metrics are waiting ..."""
METRIC_WRITE_SECONDS = 2.0
"""... or once the oldest has waited this long (checked when the next step logs)."""


class RunRecords:
    """The records of one MLflow run (``open``), also shown on the run's ``page``."""

    def __init__(self, page: RunPage, say: Callable[[str], None]):
        self.page = page
        self.say = say
        self.outbox: Outbox | None = None
        self._unsent: list[tuple[dict[str, float], int]] = []
        self._unsent_since = 0.0
        self._logged_through: dict[str, int] = {}  # a continued run's last step of each metric

    def open(self, run_id: str, continued: bool, warn: Callable[[str], None]) -> None:
        """Start sending to MLflow run ``run_id``; a ``continued`` run's points already sent
        are not sent again, and its table and curve start from them. One outbox per MLflow run:
        a resumed attempt on this machine first delivers what the one before it could not.
        ``warn``: the outbox's lines (tracking server unreachable, back), from its thread."""
        if continued:
            # Steps after the last checkpoint run again; the points a killed run already sent
            # for them stay and are not logged twice.
            self._logged_through = tracking.logged_through(run_id)
            for row in tracking.metric_table(run_id, self.page.metrics, limit=10**9):
                self.page.record(row, int(row.pop("step")))  # the table and curve of a resumed run
        folder = get_settings().resolved_home / "outbox" / run_id
        self.outbox = Outbox(
            folder, tracking.MlflowDelivery(run_id), say=warn, probe=tracking.reachable
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """``JobRun.log``: ``metrics`` at ``step``, to MLflow in order, every
        ``METRIC_WRITE_STEPS`` calls or ``METRIC_WRITE_SECONDS``; a continued run skips what it
        logged before at that step (or later)."""
        if self._logged_through:
            seen = self._logged_through
            metrics = {k: v for k, v in metrics.items() if step > seen.get(k, -1)}
            if not metrics:
                return
        self.page.record(metrics, step)
        if not self._unsent:
            self._unsent_since = time.monotonic()
        self._unsent.append((metrics, step))
        due = time.monotonic() - self._unsent_since >= METRIC_WRITE_SECONDS
        if due or len(self._unsent) >= METRIC_WRITE_STEPS:
            self._send_metrics()

    def _send_metrics(self) -> None:
        if self._unsent and self.outbox is not None:
            rows, self._unsent = self._unsent, []
            at = int(time.time() * 1000)
            self.outbox.put({"kind": "metrics", "rows": rows, "at": at})

    def put(self, record: dict[str, Any]) -> None:
        """A JSON artifact or tags of the run, in the background like ``log``."""
        assert self.outbox is not None
        self.outbox.put(record)

    def flush(self, wait: bool = True, timeout: float | None = None) -> None:
        """``JobRun.flush_metrics``: every metric logged so far into the outbox; with ``wait``,
        until MLflow has them all (or ``timeout`` seconds)."""
        self._send_metrics()
        if wait and self.outbox is not None:
            if self.outbox.pending:
                self.say(f"waiting for MLflow to take {self.outbox.pending} records")
            self.outbox.drain(timeout)

    def close(self) -> None:
        """Stop the sender; an outbox with nothing left to deliver is removed."""
        if self.outbox is not None:
            self.outbox.close()
            if self.outbox.pending == 0:
                shutil.rmtree(self.outbox.folder, ignore_errors=True)
