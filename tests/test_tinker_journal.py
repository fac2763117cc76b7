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


def _ran(rid: str, mid: str = "a:train:0") -> dict:
    return {"op": "ran", "model_id": mid, "rid": rid}


def test_a_models_history_is_what_its_weights_are_made_of(tmp_path: Path):
    """Each live model's history: its calls that changed its weights, in the order they ran,
    from its last saved state on; the gradients of calls not yet stepped outlive a save. It
    survives a rewrite whole (bodies and all), and a call that ran twice (a replay answered
    from the actor) is there once."""
    journal = Journal(tmp_path)
    fb = {"verb": "forward_backward"}
    for entry in [
        _session("a"),
        _model("a:train:0", "a"),
        _model("a:train:1", "a"),
        {**_call("f1", "a:train:0"), **fb, "body": "RjE="},
        _call("s1", "a:train:0"),
        _ran("f1"),
        _ran("s1"),
        {"op": "done", "rid": "f1"},
        {"op": "done", "rid": "s1"},
        {**_call("f2", "a:train:0"), **fb},
        _ran("f2"),
        {"op": "saved", "model_id": "a:train:0", "folder": "tinker/a/weights/mid"},
        {"op": "snap", "model_id": "a:train:0", "key": "snapshot-1"},
        {**_call("f3", "a:train:0"), **fb},
        _ran("f3"),
        _ran("f3"),  # replayed after a restart: the actor answered it from what it kept
        {"op": "done", "rid": "f2"},
        {"op": "loaded", "model_id": "a:train:1", "folder": "x", "optimizer": False},
        {**_call("f4", "a:train:1"), **fb},
        _ran("f4", "a:train:1"),
    ]:
        journal.write(entry)
    live = pending(journal.read())
    history = live.history["a:train:0"]
    assert [(h["op"], h.get("rid") or h.get("key")) for h in history] == [
        ("loaded", None),  # the saved state (with its optimizer)...
        ("ran", "f2"),  # ...the gradients it does not hold...
        ("snap", "snapshot-1"),
        ("ran", "f3"),  # ...and what came after, once
    ]
    assert history[0] == {
        "op": "loaded",
        "model_id": "a:train:0",
        "folder": "tinker/a/weights/mid",
        "optimizer": True,
    }
    assert [h["op"] for h in live.history["a:train:1"]] == ["loaded", "ran"]
    assert [c["rid"] for c in live.calls] == ["f3", "f4"]  # not taken yet: replayed too
    journal.rewrite(live.entries())
    again = pending(journal.read())
    assert again.history == live.history and history[1]["verb"] == "forward_backward"
    journal.write({"op": "unload", "model_id": "a:train:1"})
    assert list(pending(journal.read()).history) == ["a:train:0"]  # an unloaded model's goes
    journal.close()
