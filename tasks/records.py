"""Per-step records in storage: stages hand each other URIs, not the records themselves.

A rollout of a few hundred episodes is tens of thousands of token ids; passed as a task
argument, Prefect walks every element looking for futures (≈120 ms per step at the default
size, measured in docs/benchmarks/step_time.md) and the flow process carries it twice. As
JSON under ``jobs/<name>/steps/<step>/`` it costs a few ms, and a retried stage finds its input.
Images (encoded bytes) are stored as base64 strings.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict
from typing import Any

from flowrl.agent_loop.types import StopReason, Trajectory
from flowrl.backends.types import Datum
from flowrl.infra.storage import Storage


def save_trajectories(storage: Storage, rel: str, trajectories: list[Trajectory]) -> None:
    storage.write_bytes(rel, json.dumps([_to_json(asdict(t)) for t in trajectories]).encode())


def load_trajectories(storage: Storage, rel: str) -> list[Trajectory]:
    rows = [_from_json(row) for row in json.loads(storage.read_bytes(rel))]
    for row in rows:
        row["stop_reason"] = StopReason(row["stop_reason"]) if row["stop_reason"] else None
    return [Trajectory(**row) for row in rows]


def save_data(storage: Storage, rel: str, data: list[Datum]) -> None:
    storage.write_bytes(rel, json.dumps([_to_json(asdict(d)) for d in data]).encode())


def load_data(storage: Storage, rel: str) -> list[Datum]:
    return [Datum(**_from_json(row)) for row in json.loads(storage.read_bytes(rel))]


def _to_json(row: dict[str, Any]) -> dict[str, Any]:
    images = row.get("images") or []
    return {**row, "images": [base64.b64encode(image).decode("ascii") for image in images]}


def _from_json(row: dict[str, Any]) -> dict[str, Any]:
    images = row.get("images") or []
    return {**row, "images": [base64.b64decode(image) for image in images]}
