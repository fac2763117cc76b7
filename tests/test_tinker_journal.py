"""The Tinker service's journal (``backends/services/tinker/journal.py``): what a restarted service
carries on is exactly what was live: sessions not ended, their models not unloaded, their
samplers, and the calls whose results the client had not taken, in order. (The restart
itself, SIGKILL and all, is tested on the stack: ``test_stack.py``.)"""

from __future__ import annotations

from pathlib import Path

from flowrl.backends.services.tinker import journal as journal_module
from flowrl.backends.services.tinker.journal import Journal, pending


def _session(sid: str) -> dict:
    return {"op": "session", "session_id": sid, "ns": None, "display_name": None, "meta": {}}


def _model(mid: str, sid: str) -> dict:
    return {"op": "model", "model_id": mid, "ns": None, "session_id": sid, "lora": {}}


def _call(rid: str, target: str, verb: str = "optim_step") -> dict:
    return {"op": "call", "rid": rid, "verb": verb, "ns": None, "target": target, "body": ""}


def test_only_what_is_live_is_carried_on(tmp_path: Path):
    journal = Journal(tmp_path)
    for entry in [
        _session("a"),
        _session("b"),
        _model("a:train:0", "a"),
        _model("a:train:1", "a"),
        _model("b:train:0", "b"),
        {"op": "sampler", "sampler_id": "a:sample:1", "session_id": "a"},
        _call("r1", "a:train:0"),
        _call("r2", "a:train:0"),
        _call("r3", "a:train:1"),
        _call("r4", "b:train:0"),
        _call("r5", "a:sample:1", "asample"),
        {"op": "done", "rid": "r1"},
        {"op": "unload", "model_id": "a:train:1"},
        {"op": "end_session", "session_id": "b"},
        _call("r6", "a:train:0"),
    ]:
        journal.write(entry)
    live = pending(journal.read())
    assert list(live.sessions) == ["a"]
    assert list(live.models) == ["a:train:0"]  # unloaded, and of an ended session: gone
    assert list(live.samplers) == ["a:sample:1"]
    assert [c["rid"] for c in live.calls] == ["r2", "r5", "r6"]  # in order, none done
    journal.rewrite(live.entries())
    assert pending(journal.read()).entries() == live.entries()  # rewriting keeps it all
    journal.write(_call("r7", "a:train:0"))  # and the journal goes on after a rewrite
    assert [c["rid"] for c in pending(journal.read()).calls][-1] == "r7"
    journal.close()


def test_a_line_cut_by_a_crash_was_never_answered(tmp_path: Path):
    journal = Journal(tmp_path)
    journal.write(_session("a"))
    journal.close()
    with open(journal.path, "a") as f:
        f.write('{"op": "session", "session_id": "b"')  # the process died mid-write
    again = Journal(tmp_path)  # the restarted service's
    assert list(pending(again.read()).sessions) == ["a"]
    again.write(_session("c"))  # appended after the last whole entry: it reads
    assert list(pending(again.read()).sessions) == ["a", "c"]


def test_it_stays_small_what_clients_took_goes(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(journal_module, "COMPACT_BYTES", 4096)
    journal = Journal(tmp_path)
    journal.write(_session("a"))
    journal.write(_model("a:train:0", "a"))
    for n in range(500):  # a long loop: each call answered and taken
        journal.write({**_call(f"r{n}", "a:train:0"), "body": "x" * 100})
        journal.write({"op": "done", "rid": f"r{n}"})
    journal.write(_call("last", "a:train:0"))
    assert journal.path.stat().st_size < 2 * 4096
    live = pending(journal.read())
    assert list(live.models) == ["a:train:0"] and [c["rid"] for c in live.calls] == ["last"]
