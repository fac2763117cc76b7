"""Per-step records: stages hand each other storage paths, not the records themselves.

A rollout of a few hundred episodes is tens of thousands of token ids; passed as a task
argument, Prefect walks every element looking for futures (≈120 ms per step at the default
size, measured in docs/benchmarks/step_time.md) and the flow process carries it twice.

So a stage saves its records under ``jobs/<name>/steps/<step>/`` and passes the path. The
flow process also keeps what it saved in memory, keyed by (storage, path): the next stage, in
the same process, takes the records from there, and the JSON is written by one background
thread, off the step's critical path (at the default size encoding and decoding the JSON on the
critical path cost ~50 ms a step). A stage in another process, or a retried one after the
records left memory, reads the JSON. ``discard`` waits for the writes under a step's folder,
then deletes it. Images (encoded bytes) are stored as base64 strings.
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from flowrl.agent_loop.types import StopReason, Trajectory
from flowrl.backends.types import Datum
from flowrl.infra.storage import Storage

logger = logging.getLogger(__name__)

MEMO_ENTRIES = 16
"""Records kept in memory (a step holds two: its trajectories and its data)."""

_memo: OrderedDict[tuple[str, str], list[Any]] = OrderedDict()
_pending: dict[tuple[str, str], Future[None]] = {}
_lock = threading.Lock()
_writer: ThreadPoolExecutor | None = None


def save_trajectories(storage: Storage, rel: str, trajectories: list[Trajectory]) -> None:
    _save(storage, rel, trajectories, _trajectory_row)


def load_trajectories(storage: Storage, rel: str) -> list[Trajectory]:
    kept = _kept(storage, rel)
    if kept is not None:
        return kept
    rows = [_from_json(row) for row in json.loads(storage.read_bytes(rel))]
    for row in rows:
        row["stop_reason"] = StopReason(row["stop_reason"]) if row["stop_reason"] else None
    return [Trajectory(**row) for row in rows]


def save_data(storage: Storage, rel: str, data: list[Datum]) -> None:
    _save(storage, rel, data, _datum_row)


def load_data(storage: Storage, rel: str) -> list[Datum]:
    kept = _kept(storage, rel)
    if kept is not None:
        return kept
    return [Datum(**_from_json(row)) for row in json.loads(storage.read_bytes(rel))]


def flush(storage: Storage | None = None, prefix: str = "") -> None:
    """Wait until the background writes (of ``storage`` under ``prefix``; default: all) have
    ended. A write that failed (storage down past its retries) is logged, not raised: the
    stages had the records from memory."""
    with _lock:
        waiting = {
            key: f
            for key, f in _pending.items()
            if storage is None or (key[0] == storage.url and _under(key[1], prefix))
        }
    for (url, rel), future in waiting.items():
        if future.exception() is not None:
            logger.warning("step record %s/%s was not written: %s", url, rel, future.exception())
        with _lock:
            if _pending.get((url, rel)) is future:
                del _pending[(url, rel)]


def discard(storage: Storage, prefix: str) -> None:
    """Drop the records under ``prefix`` (a consumed step's folder): from memory, and from
    storage once their writes have ended."""
    with _lock:
        for key in [k for k in _memo if k[0] == storage.url and _under(k[1], prefix)]:
            del _memo[key]
    flush(storage, prefix)
    storage.delete(prefix)


def _under(rel: str, prefix: str) -> bool:
    return not prefix or rel == prefix or rel.startswith(prefix.rstrip("/") + "/")


def _save(storage: Storage, rel: str, records: list[Any], row: Any) -> None:
    """Keep ``records`` in memory and write them as JSON in the background."""
    global _writer
    key = (storage.url, rel)
    with _lock:
        _memo[key] = records
        _memo.move_to_end(key)
        while len(_memo) > MEMO_ENTRIES:
            _memo.popitem(last=False)
        if _writer is None:
            _writer = ThreadPoolExecutor(1, thread_name_prefix="flowrl-records")
            atexit.register(_writer.shutdown)
        future = _writer.submit(_write, storage, rel, records, row)
        _pending[key] = future
    future.add_done_callback(lambda f: _done(key, f))


def _write(storage: Storage, rel: str, records: list[Any], row: Any) -> None:
    storage.write_bytes(rel, json.dumps([row(r) for r in records]).encode())


def _done(key: tuple[str, str], future: Future[None]) -> None:
    with _lock:
        if _pending.get(key) is future and future.exception() is None:
            del _pending[key]  # a failed write stays until ``flush`` logs it


def _kept(storage: Storage, rel: str) -> Any:
    with _lock:
        return _memo.get((storage.url, rel))


# Shallow rows: the lists inside are JSON already (``dataclasses.asdict`` would deep-copy them).
_TRAJECTORY_FIELDS = [f.name for f in fields(Trajectory)]
_DATUM_FIELDS = [f.name for f in fields(Datum)]


def _trajectory_row(t: Trajectory) -> dict[str, Any]:
    row = {name: getattr(t, name) for name in _TRAJECTORY_FIELDS}
    row["stop_reason"] = t.stop_reason.value if t.stop_reason else None
    return _to_json(row)


def _datum_row(d: Datum) -> dict[str, Any]:
    return _to_json({name: getattr(d, name) for name in _DATUM_FIELDS})


def _to_json(row: dict[str, Any]) -> dict[str, Any]:
    images = row.get("images") or []
    return {**row, "images": [base64.b64encode(image).decode("ascii") for image in images]}


def _from_json(row: dict[str, Any]) -> dict[str, Any]:
    images = row.get("images") or []
    return {**row, "images": [base64.b64decode(image) for image in images]}
