"""Who gets the CPU on a small machine: a job's policy workers (the processes that learn), not
the daemons around them.

Ray starts its workers at niceness 15 by default, so on a 2-core machine the workers lost the CPU
to every daemon of the job's tree (Prefect's API server, Ray's GCS, dashboard, agents and
monitors). flowrl starts Ray's workers at 0 (``RAY_WORKER_NICENESS``) and raises its own helper
daemons' niceness to ``FLOWRL_RAY_DAEMON_NICENESS`` (default 10; 0 leaves them as they are).
The raylet keeps its niceness: a worker starts at the raylet's niceness plus Ray's
``worker_niceness``.
"""

from __future__ import annotations

import contextlib

import psutil

RAY_WORKER_NICENESS = 0
"""Ray's ``worker_niceness`` for the Rays flowrl starts (Ray's default: 15)."""

_RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def renice(pid: int, niceness: int) -> None:
    """Raise process ``pid``'s niceness to ``niceness`` (never lower it; gone is fine)."""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.nice() < niceness:
            proc.nice(niceness)


def renice_tree(pid: int, niceness: int) -> None:
    """``renice`` process ``pid`` and all its descendants (a server and its workers)."""
    with contextlib.suppress(psutil.Error):
        for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            renice(proc.pid, niceness)


def yield_cpu_to_workers(root: int, niceness: int) -> None:
    """Raise the niceness of the helper daemons among ``root``'s descendants to ``niceness``:
    a Ray's GCS, dashboard, agents and monitors, and a Prefect API server run by uvicorn; not
    the raylet, nor any Ray worker."""
    if niceness <= 0:
        return
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if _is_helper_daemon(proc):
                    renice(proc.pid, niceness)


def _is_helper_daemon(proc: psutil.Process) -> bool:
    name, cmd = proc.name(), " ".join(proc.cmdline()[:4])
    if name == "raylet" or "default_worker.py" in cmd:
        return False
    if cmd.startswith("ray::"):  # a worker (the policy's, a stage's), or one of raylet's agents
        return cmd.startswith(_RAY_AGENTS)
    return name == "gcs_server" or "/ray/" in cmd or ("uvicorn" in cmd and "prefect" in cmd)
