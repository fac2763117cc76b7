"""The outbox a job's MLflow records go through (``infra/outbox.py``): in order, each once,
through an outage of any length, and across a restart of the process; then its deliverer on a
real MLflow store, which never logs a step twice."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from flowrl.infra.outbox import RECORDS, Outbox, Retryable

NO_WAIT = (0.01,)


class FlakyServer:
    """A deliverer whose server is down for its first ``down`` calls (then up), recording what
    it took."""

    def __init__(self, down: int = 0):
        self.down = down
        self.calls = 0
        self.taken: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, records: list[dict]) -> None:
        with self.lock:
            self.calls += 1
            if self.calls <= self.down:
                raise Retryable("connection refused")
            self.taken += [r["n"] for r in records]


def test_records_arrive_in_order_each_once(tmp_path: Path):
    server = FlakyServer()
    box = Outbox(tmp_path, server, backoff_s=NO_WAIT)
    for n in range(250):
        box.put({"n": n})
    assert box.drain(timeout=30)
    box.close()
    assert server.taken == list(range(250))


def test_an_outage_delays_delivery_and_loses_nothing(tmp_path: Path):
    said: list[str] = []
    server = FlakyServer(down=20)
    box = Outbox(tmp_path, server, say=said.append, backoff_s=NO_WAIT)
    for n in range(30):
        box.put({"n": n})  # never waits for the server
        time.sleep(0.002)
    assert box.drain(timeout=30)
    box.close()
    assert server.taken == list(range(30)) and server.calls > 20
    assert said[0].startswith("tracking server unreachable (connection refused)")
    assert said[-1].startswith("tracking server back after")


def test_a_delivery_that_hangs_while_the_server_is_down_is_said_at_once(tmp_path: Path):
    """A client that retries inside ``deliver`` for minutes (MLflow's does) does not hide the
    outage: once a delivery hung ``stall_s`` and the probe gets no answer, the job is told."""
    said: list[str] = []
    up = threading.Event()

    def slow_client(records: list[dict]) -> None:
        up.wait(timeout=30)  # its own retries, until the server is back

    box = Outbox(
        tmp_path, slow_client, say=said.append, probe=up.is_set, stall_s=0.1, backoff_s=NO_WAIT
    )
    box.put({"n": 0})
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.02)
    assert said and said[0].startswith("tracking server unreachable (a delivery hung 0 s)")
    assert box.pending == 1
    up.set()
    assert box.drain(timeout=10)
    box.close()
    assert said[-1].startswith("tracking server back after")


def test_what_a_dead_process_left_is_delivered_first_by_the_next(tmp_path: Path):
    down = FlakyServer(down=10**9)  # never up while the first process lives
    first = Outbox(tmp_path, down, backoff_s=NO_WAIT)
    for n in range(5):
        first.put({"n": n})
    assert not first.drain(timeout=0.3)
    first.close()  # the process dies; its records stay on disk
    server = FlakyServer()
    second = Outbox(tmp_path, server, backoff_s=NO_WAIT)
    for n in range(5, 8):
        second.put({"n": n})
    assert second.drain(timeout=30)
    second.close()
    assert down.taken == [] and server.taken == list(range(8))
    third = Outbox(tmp_path, server, backoff_s=NO_WAIT)  # all delivered: nothing again
    assert third.pending == 0 and third.drain(timeout=1)
    third.close()
    assert server.taken == list(range(8))


def test_a_line_cut_by_a_crash_is_dropped_and_later_records_stay_readable(tmp_path: Path):
    box = Outbox(tmp_path, FlakyServer(down=10**9), backoff_s=NO_WAIT)
    box.put({"n": 0})
    box.close()
    with open(tmp_path / RECORDS, "a") as f:
        f.write('{"n": 1, "cut')  # the process died mid-write
    server = FlakyServer()
    again = Outbox(tmp_path, server, backoff_s=NO_WAIT)
    again.put({"n": 2})
    assert again.drain(timeout=30)
    again.close()
    assert server.taken == [0, 2]
    assert Outbox(tmp_path, server).pending == 0  # the file reads whole


def test_an_error_that_is_not_an_outage_is_raised_by_drain(tmp_path: Path):
    def refuses(records: list[dict]) -> None:
        raise ValueError("INVALID_PARAMETER_VALUE: metric name")

    box = Outbox(tmp_path, refuses, backoff_s=NO_WAIT)
    box.put({"n": 0})
    with pytest.raises(ValueError, match="INVALID_PARAMETER_VALUE"):
        box.drain(timeout=30)
    box.close()


def test_the_mlflow_deliverer_never_logs_a_step_twice(tmp_path: Path, monkeypatch):
    """A record delivered, then delivered again (the process died before it wrote that it had):
    MLflow has each step's point once; an unreachable server is a Retryable outage."""
    from flowrl.infra import tracking

    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path))
    monkeypatch.delenv("FLOWRL_MLFLOW_TRACKING_URI", raising=False)
    run_id = tracking.start_run("outbox", "outbox-job", {}, None, None)
    record = {"kind": "metrics", "rows": [[{"loss": 0.5}, 1], [{"loss": 0.4}, 2]], "at": 1}
    tracking.MlflowDelivery(run_id)([record])
    later = {"kind": "metrics", "rows": [[{"loss": 0.3}, 3]], "at": 2}
    tracking.MlflowDelivery(run_id)([record, later])  # a new process: the first again
    history = tracking.client().get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.4), (3, 0.3)]

    monkeypatch.setenv("FLOWRL_MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens
    with pytest.raises(Retryable):
        tracking.MlflowDelivery(run_id)([later])
