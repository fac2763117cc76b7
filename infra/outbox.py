"""A job's records for MLflow, kept on disk and delivered in order, each once: a tracking
outage delays the dashboard, not the job.

``Outbox(folder, deliver)`` appends each record (a JSON object) to ``<folder>/records.jsonl``
(flushed and fsynced before ``put`` returns) and a sender thread hands them to ``deliver`` in
the order they were put, several at once where it can. A record is delivered when ``deliver``
returns; the count delivered is written to ``<folder>/sent.json`` (atomically) after each
delivery. While ``deliver`` raises a ``Retryable`` error (the server does not answer) the
sender waits and tries again, for as long as it takes, and says so every minute; any other
error is kept and raised by ``drain``. A client may retry inside ``deliver`` for minutes before
it raises (MLflow's does): given a ``probe`` (does the server answer?), the sender says the
server is unreachable as soon as a delivery has hung ``stall_s`` seconds and the probe fails.

A process that dies leaves its folder: the next ``Outbox`` on it (the job's next attempt)
delivers what was not yet, first. A record delivered just before a crash, whose count was not
written, is handed to ``deliver`` again: ``deliver`` makes that harmless (the job's deliverer
skips metric points MLflow already has at that step; artifacts are overwritten).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RECORDS = "records.jsonl"
SENT = "sent.json"
MAX_BATCH = 200
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
SAY_EVERY_S = 60.0
STALL_S = 10.0

logger = logging.getLogger("flowrl.outbox")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` written whole: a last line cut by a crash mid-write was never
    put, so it is cut from the file too, and what is appended next reads."""
    if not path.exists():
        return []
    records, good = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                records.append(json.loads(line))
            except ValueError:
                break
            good += len(line)
    if good != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return records


class Retryable(Exception):
    """``deliver`` could not reach its server: try the same records again later."""


class Outbox:
    def __init__(
        self,
        folder: Path,
        deliver: Callable[[list[dict[str, Any]]], None],
        say: Callable[[str], None] | None = None,
        backoff_s: tuple[float, ...] = BACKOFF_S,
        probe: Callable[[], bool] | None = None,
        stall_s: float = STALL_S,
    ):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._deliver = deliver
        self._say = say or logger.warning
        self._backoff = backoff_s
        self._probe = probe
        self._stall_s = stall_s
        self._lock = threading.Condition()
        self._records = self._read_records()
        self._sent = min(self._read_sent(), len(self._records))
        self._error: BaseException | None = None
        self._waiting_since: float | None = None
        self._closed = False
        self._file = open(self.folder / RECORDS, "a", encoding="utf-8")  # noqa: SIM115
        self._thread = threading.Thread(target=self._run, name="outbox", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the job's side

    @property
    def pending(self) -> int:
        """Records put and not yet delivered."""
        with self._lock:
            return len(self._records) - self._sent

    def put(self, record: dict[str, Any]) -> None:
        """Keep ``record`` on disk, then queue it for delivery (never waits for the server)."""
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._records.append(record)
            self._lock.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every record put so far is delivered (as long as the server takes to come
        back, or ``timeout`` seconds); True if all were. Raises the error of a record that could
        not be delivered for another reason than an unreachable server."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            target = len(self._records)
            while self._sent < target and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(timeout=1.0 if left is None else min(left, 1.0))
            if self._error is not None:
                raise self._error
            return True

    def close(self) -> None:
        """Stop the sender (what is undelivered stays on disk for the next ``Outbox``)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        self._file.close()

    # ------------------------------------------------------------------ the sender

    def _run(self) -> None:
        failures = 0
        while True:
            with self._lock:
                while not self._closed and (self._sent >= len(self._records) or self._error):
                    self._lock.wait()
                if self._closed:
                    return
                batch = self._records[self._sent : self._sent + MAX_BATCH]
            try:
                if not self._deliver_watched(batch):
                    return  # closed while a delivery hung: its records stay for the next Outbox
            except Retryable as err:
                self._note_outage(err)
                delay = self._backoff[min(failures, len(self._backoff) - 1)]
                failures += 1
                with self._lock:
                    self._lock.wait(timeout=delay)  # close() cuts the wait short
                continue
            except BaseException as err:  # noqa: BLE001 - raised by drain(), in the job
                with self._lock:
                    self._error = err
                    self._lock.notify_all()
                continue
            if self._waiting_since is not None:
                waited = time.monotonic() - self._waiting_since
                self._tell(f"tracking server back after {waited:.0f} s; delivering what waited")
                self._waiting_since = None
            failures = 0
            with self._lock:
                self._sent += len(batch)
                self._write_sent(self._sent)
                self._lock.notify_all()

    def _deliver_watched(self, batch: list[dict[str, Any]]) -> bool:
        """``deliver(batch)``; with a probe, in a helper thread watched every ``stall_s``: while
        it hangs and the server does not answer, the outage is said. False if closed meanwhile."""
        if self._probe is None:
            self._deliver(batch)
            return True
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                self._deliver(batch)
                outcome.append(None)
            except BaseException as err:  # noqa: BLE001 - re-raised in the sender
                outcome.append(err)

        helper = threading.Thread(target=call, name="outbox-delivery", daemon=True)
        began = time.monotonic()
        helper.start()
        while True:
            helper.join(timeout=self._stall_s)
            if not helper.is_alive():
                break
            with self._lock:
                if self._closed:
                    return False
            if not self._probe():
                self._note_outage(Retryable(f"a delivery hung {time.monotonic() - began:.0f} s"))
        if outcome[0] is not None:
            raise outcome[0]
        return True

    def _note_outage(self, err: BaseException) -> None:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = self._last_said = now
            self._tell(f"tracking server unreachable ({err}); the job goes on, records kept")
        elif now - self._last_said >= SAY_EVERY_S:
            self._last_said = now
            self._tell(
                f"tracking server unreachable for {now - self._waiting_since:.0f} s; "
                f"{self.pending} records kept for it"
            )

    def _tell(self, line: str) -> None:
        try:
            self._say(line)
        except Exception:  # noqa: BLE001 - a log line never stops delivery
            logger.warning(line)

    # ------------------------------------------------------------------ the files

    def _read_records(self) -> list[dict[str, Any]]:
        return read_records(self.folder / RECORDS)

    def _read_sent(self) -> int:
        try:
            return int(json.loads((self.folder / SENT).read_text())["sent"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _write_sent(self, sent: int) -> None:
        tmp = self.folder / f".{SENT}.tmp"
        tmp.write_text(json.dumps({"sent": sent}))
        os.replace(tmp, self.folder / SENT)
