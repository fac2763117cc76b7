"""A job's log as it comes: its flow run's lines on the Prefect API, each once, in time order,
and the progress its step lines tell.

A training job logs a line per step (or per k steps, ``flows.run_page.STEP_LINES``) with its
metrics: ``step 3/20: reward 0.412, loss 0.113, 1.80 s/step, accuracy 0.550``. ``follow``
reads the run's lines while it runs and hands each to a callback (``flowrl jobs logs
--follow``, ``flowrl jobs wait``'s progress line) until the run is final and its last lines
are in.

A flow-run process sends its lines in batches, the last batch after the run's final state; so
each read looks ``LATE_S`` back again (lines already shown are skipped by id), and a final run
is read on until its "Finished in state" line (or for ``FINAL_GRACE_S``: a killed process
never sends one).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from flowrl.infra.client import JobClient, JobStatus, api_restarting

LATE_S = 10.0
"""Each read looks this far back before the newest line seen (lines arrive in batches)."""
FINAL_GRACE_S = 10.0
"""Once the run is final: how long to wait for its last lines at most."""
PAGE = 200
"""Lines per API call (the API's own cap is 200)."""
STEP_LINE = re.compile(r"^step (\d+)/(\d+)(?::\s*(.*))?$")


@dataclass(frozen=True)
class LogLine:
    """One line of a job's log."""

    time: datetime
    level: int
    message: str
    task_run_id: str | None = None
    """Set for a line of one of the job's task runs (its warnings and errors)."""

    def text(self) -> str:
        """``12:03:04  step 3/20: …`` (local time; the level when it is not INFO)."""
        level = "" if self.level == logging.INFO else f"{logging.getLevelName(self.level)}  "
        return f"{self.time.astimezone():%H:%M:%S}  {level}{self.message}"

    def as_json(self) -> dict[str, Any]:
        return {
            "time": self.time.isoformat(),
            "level": logging.getLevelName(self.level),
            "message": self.message,
            "task_run_id": self.task_run_id,
        }


@dataclass(frozen=True)
class Progress:
    """What a step line says: the step, the total, the metrics' words."""

    step: int
    total: int
    words: str
    seconds_per_step: float | None

    @classmethod
    def parse(cls, message: str) -> Progress | None:
        match = STEP_LINE.match(message.strip())
        if match is None:
            return None
        words = match.group(3) or ""
        rate = re.search(r"([0-9.]+) s/step", words)
        return cls(
            int(match.group(1)), int(match.group(2)), words, float(rate.group(1)) if rate else None
        )

    def text(self) -> str:
        """``step 12/50 (24%): reward 0.410, 1.80 s/step; about 1 min 8 s left``."""
        share = 100 * self.step / self.total if self.total else 100.0
        line = f"step {self.step}/{self.total} ({share:.0f}%)" + (
            f": {self.words}" if self.words else ""
        )
        if self.seconds_per_step is not None and self.step < self.total:
            line += f"; about {_duration((self.total - self.step) * self.seconds_per_step)} left"
        return line


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


class LogReader:
    """A flow run's log lines on the Prefect API, each returned once by ``read``."""

    def __init__(self, run_id: str):
        self.run_id = UUID(run_id)
        self._newest: datetime | None = None
        self._seen: dict[UUID, datetime] = {}
        self.finished = False
        """The run's own "Finished in state …" line has been read: no more lines come."""

    def read(self) -> list[LogLine]:
        """The lines not read before, in time order."""
        from prefect import get_client
        from prefect.client.schemas.filters import (
            LogFilter,
            LogFilterFlowRunId,
            LogFilterTimestamp,
        )
        from prefect.client.schemas.sorting import LogSort

        flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[self.run_id]))
        if self._newest is not None:
            flt.timestamp = LogFilterTimestamp(after_=self._newest - timedelta(seconds=LATE_S))
        found = []
        with get_client(sync_client=True) as client:
            while True:
                page = client.read_logs(
                    log_filter=flt, limit=PAGE, offset=len(found), sort=LogSort.TIMESTAMP_ASC
                )
                found += page
                if len(page) < PAGE:
                    break
        lines = []
        for log in found:
            if log.id in self._seen:
                continue
            self._seen[log.id] = log.timestamp
            task = str(log.task_run_id) if log.task_run_id else None
            lines.append(LogLine(log.timestamp, log.level, log.message, task))
            if task is None and log.message.startswith("Finished in state"):
                self.finished = True
        if found:
            self._newest = max(self._newest or found[-1].timestamp, found[-1].timestamp)
            horizon = self._newest - timedelta(seconds=2 * LATE_S)
            self._seen = {k: t for k, t in self._seen.items() if t >= horizon}
        return lines


def follow(
    run_id: str,
    on_line: Callable[[LogLine], None],
    timeout: float | None = None,
    poll: float = 1.0,
    jobs: JobClient | None = None,
) -> JobStatus:
    """Hand each of the job's log lines to ``on_line`` as it comes, until the job is final
    (through a crash the stack resumes) and its last lines are read; its final status.
    ``TimeoutError`` once ``timeout`` seconds have passed with the job still going. A Prefect
    API that stops answering once followed (restarting) is asked again."""
    jobs = jobs or JobClient()
    jobs.status(run_id)  # an API that does not answer at all, or an unknown id: raised now
    reader = LogReader(run_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    final_at: float | None = None
    while True:
        try:
            for line in reader.read():
                on_line(line)
            status = jobs.status(run_id)
        except Exception as err:
            if not api_restarting(err) or (deadline is not None and time.monotonic() > deadline):
                raise
            time.sleep(max(poll, 2.0))
            continue
        if status.final:
            final_at = final_at or time.monotonic()
            if reader.finished or time.monotonic() - final_at > FINAL_GRACE_S:
                return status
        else:  # an attempt that crashed and is resumed logs on: its "Finished" was not the last
            reader.finished = False
        if not status.final and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {run_id} still {status.state} after {timeout:g} s")
        time.sleep(poll)
