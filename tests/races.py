"""Processes racing at one instant: each a fresh Python (no fork of the test process, whose
threads and servers a child would inherit), started, waiting until all are ready, then let go
together."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_READY_THEN_WAIT = """
import os, sys, time
ready, go = sys.argv[1], sys.argv[2]
open(os.path.join(ready, str(os.getpid())), "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
"""


def race(
    code: str, racers: int, folder: Path, args: tuple[str, ...] = (), timeout: float = 120
) -> list[str]:
    """Run ``code`` (with ``sys.argv[3:]`` = ``args``) in ``racers`` processes at once: the
    stdout of each; an error naming the first that failed, with its stderr."""
    ready, go = folder / "ready", folder / "go"
    ready.mkdir(parents=True)
    command = [sys.executable, "-c", _READY_THEN_WAIT + code, str(ready), str(go), *args]
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(racers)
    ]
    deadline = time.monotonic() + timeout
    while len(list(ready.iterdir())) < racers and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise AssertionError(f"a racer failed ({proc.returncode}): {err[-2000:]}")
        outs.append(out)
    return outs
