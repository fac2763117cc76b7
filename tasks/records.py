"""Per-step records: stages hand each other storage paths, not the records themselves.

A rollout of a few hundred episodes is tens of thousands of token ids; passed as a task
argument, Prefect walks every element looking for futures (≈120 ms per step at the default
size, measured in docs/benchmarks/step_time.md) and the flow process carries it twice.

So a stage saves its records under a path in the job's storage
(``jobs/<name>/steps/<step>/…``) and passes the path; the next stage, in the same flow
process, loads them by that path. The records stay in the process's memory, keyed by
(storage, path), until ``discard`` drops the consumed step's folder: no JSON is encoded or
decoded on the way (at the default size that cost ~50 ms a step, and holding the GIL while
encoding in the background stalled the stages). Only when more than ``MEMO_ENTRIES`` records
are held at once (stages that never consume theirs) does the oldest go to storage as JSON,
from where a later load reads it: nothing is lost, memory stays bounded. Images (encoded
bytes) are stored as base64 strings.
"""

from __future__ import annotations

import base64
import json
import threading
from collections import OrderedDict
from dataclasses import fields
from typing import Any

from flowrl.agent_loop.types import StopReason, Trajectory
from flowrl.backends.types import Datum
from flowrl.infra.storage import Storage

MEMO_ENTRIES = 16
"""Records held in memory (a step holds two per policy: its trajectories and its data; three
with ``algorithm.kl_in: reward``, its rewards)."""

_memo: OrderedDict[tuple[str, str], tuple[Storage, list[Any], Any]] = OrderedDict()
_spilled: set[tuple[str, str]] = set()
_lock = threading.Lock()


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


def save_rows(storage: Storage, rel: str, rows: list[dict[str, Any]]) -> None:
    """Small JSON rows (e.g. a step's rewards and group ids), held like the other records."""
    _save(storage, rel, rows, dict)


def load_rows(storage: Storage, rel: str) -> list[dict[str, Any]]:
    kept = _kept(storage, rel)
    if kept is not None:
        return kept
    return json.loads(storage.read_bytes(rel))


def discard(storage: Storage, prefix: str) -> None:
    """Drop the records under ``prefix`` (a consumed step's folder), from memory and, where
    any went there, from storage."""
    with _lock:
        for key in [k for k in _memo if k[0] == storage.url and _under(k[1], prefix)]:
            del _memo[key]
        spilled = {k for k in _spilled if k[0] == storage.url and _under(k[1], prefix)}
        _spilled.difference_update(spilled)
    if spilled:
        storage.delete(prefix)


def _under(rel: str, prefix: str) -> bool:
    return rel == prefix or rel.startswith(prefix.rstrip("/") + "/")


def _save(storage: Storage, rel: str, records: list[Any], row: Any) -> None:
    """Hold ``records`` in memory; the oldest held records go to storage past the bound."""
    key = (storage.url, rel)
    with _lock:
        _memo[key] = (storage, records, row)
        _memo.move_to_end(key)
        evicted = [_memo.popitem(last=False) for _ in range(len(_memo) - MEMO_ENTRIES)]
        _spilled.update(k for k, _ in evicted)
    for (_, old_rel), (old_storage, old_records, old_row) in evicted:
        old_storage.write_bytes(old_rel, json.dumps([old_row(r) for r in old_records]).encode())


def _kept(storage: Storage, rel: str) -> Any:
    with _lock:
        held = _memo.get((storage.url, rel))
    return None if held is None else held[1]


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
