"""The Tinker service's journal: what a restarted service needs to carry on its clients' loops.

A client's loop must not notice that the service's process was killed and started again: its
SDK retries a request that got no answer, and then asks for the futures it holds. So before a
verb's future id is answered, the service writes (``write``, fsynced) what it needs to answer
that future again: sessions, training models and sampling sessions as they are made and
ended, and each training or sampling call whose result is a future (the raw request, its
route and its future id). Once the client has its result, the call is marked ``done``.

A restarted service reads the journal (``pending``): it makes the live sessions, models and
samplers again (a model's weights live in its session run's Ray actor, which outlives the
service: ``Placement.find_model``), then sends each call not done again, in the order it came,
under its old future id. A call the actor had already run is answered from what the actor kept
(its key is ``<future id>/<n>``: ``handles.request_key``), so nothing runs twice. The journal is
then rewritten with only what is still live, as it is whenever it passes ``COMPACT_BYTES``.

It also keeps each live model's **history**: what its weights are made of since its last saved
state, so that a model whose weights were lost (its actor died with the Ray head, or it lived in
the killed process) is made again exactly (``Training.restore``). Entries, in the order they
ran on the model: ``ran`` (a ``forward_backward`` or ``optim_step`` call, by its future id: the
call's entry stays while it is history), ``snap`` (a sampler's snapshot of the weights) and
``loaded`` (a saved state loaded into it). A ``saved`` state (``save_state``, or the service's own
when a history grows past ``Training``'s bound) starts the history again from that state, with
the gradients of the ``forward_backward`` calls since the last ``optim_step``, which a saved
state does not hold. A restore writes ``restoring`` (its generation: the model's actor has a
name of its own each time) before it starts the model and ``restored`` once its history has
run: the model entry carries the last of each, so that a restarted service trusts only a
model whose restore ended, and closes one whose restore its killed predecessor had begun.

One JSON object per line in ``<folder>/journal.jsonl``; a last line cut by a crash is dropped.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.infra.outbox import read_records

FILE = "journal.jsonl"
COMPACT_BYTES = 32 * 2**20


@dataclass
class Pending:
    """What is live in a journal: entries by id, and the calls not done, in order."""

    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    samplers: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    losses: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The sessions' uploaded losses (``create_custom_loss``) by loss id."""
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Each live model's history (the module docstring), its ``ran`` entries with their
    call's ``verb`` and ``body``."""

    def entries(self) -> list[dict[str, Any]]:
        """The journal that holds only this (a history's calls written into its entries)."""
        out = list(self.sessions.values()) + list(self.losses.values())
        out += list(self.models.values())
        out += [e for model_history in self.history.values() for e in model_history]
        return out + list(self.samplers.values()) + self.calls


def pending(entries: list[dict[str, Any]]) -> Pending:
    """What the entries leave live: sessions not ended, their models not unloaded, their
    samplers, and the calls on those not marked done."""
    live = Pending()
    done = {e["rid"] for e in entries if e["op"] == "done"}
    bodies = {e["rid"]: e for e in entries if e["op"] == "call"}
    ran: set[str] = set()  # the calls already in a history (a replay notes one twice)
    for e in entries:
        op = e["op"]
        if op in HISTORY:
            _add_history(live.history, e, bodies, ran)
        if op == "session":
            live.sessions[e["session_id"]] = e
        elif op == "end_session":
            live.sessions.pop(e["session_id"], None)
        elif op == "model":
            live.models[e["model_id"]] = e
        elif op == "unload":
            live.models.pop(e["model_id"], None)
        elif op in ("restoring", "restored") and e["model_id"] in live.models:
            key = "generation" if op == "restored" else "restoring"
            live.models[e["model_id"]] = {**live.models[e["model_id"]], key: e["generation"]}
        elif op == "sampler":
            live.samplers[e["sampler_id"]] = e
        elif op == "custom_loss":
            live.losses[e["loss_id"]] = e
        elif op == "call" and e["rid"] not in done:
            live.calls.append(e)
    live.models = {k: m for k, m in live.models.items() if m["session_id"] in live.sessions}
    live.losses = {k: x for k, x in live.losses.items() if x["session_id"] in live.sessions}
    live.samplers = {k: s for k, s in live.samplers.items() if s["session_id"] in live.sessions}
    targets = live.models.keys() | live.samplers.keys()
    live.calls = [c for c in live.calls if c["target"] in targets]
    live.history = {k: h for k, h in live.history.items() if k in live.models}
    return live


HISTORY = ("ran", "snap", "loaded", "saved")


def _add_history(
    history: dict[str, list[dict[str, Any]]],
    e: dict[str, Any],
    bodies: dict[str, dict],
    ran: set[str],
) -> None:
    """One history entry ``e`` onto its model's history (the module docstring)."""
    past = history.setdefault(e["model_id"], [])
    op = e["op"]
    if op == "ran":
        call = e if "verb" in e else bodies.get(e["rid"])  # whole when a rewrite wrote it
        if call is None or e["rid"] in ran:
            return  # ran twice: a replay answered from the actor's kept answer
        ran.add(e["rid"])
        past.append({**e, "verb": call["verb"], "body": call["body"]})
    elif op == "snap":
        past.append(e)
    elif op == "loaded":
        past[:] = [e]
    else:  # saved: the state, and the gradients it does not hold
        gradients: list[dict[str, Any]] = []
        for h in past:
            if h["op"] == "loaded" or h.get("verb") == "optim_step":
                gradients = []
            elif h.get("verb") == "forward_backward":
                gradients.append(h)
        past[:] = [{**e, "op": "loaded", "optimizer": True}, *gradients]


class Journal:
    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / FILE
        self._lock = threading.Lock()
        read_records(self.path)  # a last entry cut by a crash is cut from the file
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` (fsynced); past ``COMPACT_BYTES`` the journal is first rewritten
        with only what is live (what the clients have taken goes)."""
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.tell() > COMPACT_BYTES:
                self._rewrite(pending(self._read()).entries())
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._read()

    def _read(self) -> list[dict[str, Any]]:
        return read_records(self.path)

    def rewrite(self, entries: list[dict[str, Any]]) -> None:
        """Replace the journal by ``entries`` (atomically)."""
        with self._lock:
            self._rewrite(entries)

    def _rewrite(self, entries: list[dict[str, Any]]) -> None:
        tmp = self.folder / f".{FILE}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in entries)
            f.flush()
            os.fsync(f.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        with self._lock:
            self._file.close()
