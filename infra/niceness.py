"""Who gets the CPU on a small machine: a job's policy workers (the processes that learn), not
the daemons around them.

Ray starts its workers at niceness 15 by default, so on a 2-core machine the workers lost the CPU
to every daemon of the job's tree (Prefect's API server, Ray's GCS, dashboard, agents and
monitors). flowrl starts Ray's workers at 0 (``RAY_WORKER_NICENESS``), and raises the niceness of
Ray's helper daemons, which no call of a job waits on (the dashboard head and agent, the
runtime-env agent, the log and autoscaler monitors), to ``FLOWRL_RAY_DAEMON_NICENESS`` (default
10; 0 leaves them as they are). The servers that answer a job's calls stay at 0: Ray's GCS and
raylet, the Prefect API, MLflow, S3. (Tried: with the Prefect API at 10, a busy tenant of a
shared worker at 0 starved it and a second job's flow run failed on the stack.) The raylet's
niceness is also the base of its workers': they start at it plus Ray's ``worker_niceness``.
"""

from __future__ import annotations

import contextlib

import psutil

RAY_WORKER_NICENESS = 0
"""Ray's ``worker_niceness`` for the Rays flowrl starts (Ray's default: 15)."""

RAY_SYSTEM_CONFIG = {
    "worker_niceness": RAY_WORKER_NICENESS,
    # Workers start when a task or actor asks for one, one at a time: none sits idle beside
    # the job. Ray's default starts a worker for its first driver, more for a backlog, and up
    # to num_cpus at once for one lease (one job's one-off task started two, one never used:
    # ~1.3 CPU s and a process that did nothing, benchmarks/cpu_tax.py).
    "prestart_worker_first_driver": False,
    "enable_worker_prestart": False,
    "worker_maximum_startup_concurrency": 1,
}
"""The system config of a job's local Ray (the stack's head takes only its niceness)."""

_RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
_RAY_HELPER_SCRIPTS = ("/dashboard/dashboard.py", "/log_monitor.py", "/monitor.py")


def yield_cpu_to_workers(roots: list[int], niceness: int) -> None:
    """Raise the niceness of Ray's helper daemons among ``roots`` and their descendants to
    ``niceness`` (module docstring: which)."""
    if niceness <= 0:
        return
    for root in roots:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(root)
            for proc in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):  # gone is fine; never lowered
                    if _is_helper_daemon(proc) and proc.nice() < niceness:
                        proc.nice(niceness)


def _is_helper_daemon(proc: psutil.Process) -> bool:
    cmd = " ".join(proc.cmdline()[:4])
    if cmd.startswith("ray::"):  # a worker (the policy's, a stage's), or one of raylet's agents
        return cmd.startswith(_RAY_AGENTS)
    return "/ray/" in cmd and any(script in cmd for script in _RAY_HELPER_SCRIPTS)
