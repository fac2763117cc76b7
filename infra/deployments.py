"""The deployments declared in ``prefect.yaml``, applied through Prefect's own deploy API.

``apply_deployments`` registers each flow from this checkout (``Flow.from_source`` on the repo
folder: a process worker runs it in place) on the work queue the file names; every queue must
exist in the scheduler declaration, so a typo fails at ``flowrl infra up``, not at run time.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import yaml

from flowrl.infra.scheduler import SchedulerSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT_YAML = Path(__file__).resolve().parent / "prefect.yaml"  # also ./prefect.yaml (a link)


def load_deployments(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The ``deployments:`` list of ``prefect.yaml``."""
    data = yaml.safe_load(Path(path or PREFECT_YAML).read_text())
    return list(data.get("deployments") or [])


def check_deployments(deployments: list[dict[str, Any]], spec: SchedulerSpec) -> None:
    """Every deployment targets the declared pool and one of its queues."""
    for d in deployments:
        pool = d.get("work_pool") or {}
        if pool.get("name") != spec.pool.name:
            raise ValueError(f"deployment {d['name']}: work pool must be {spec.pool.name!r}")
        spec.queue(pool.get("work_queue_name", ""))  # KeyError names the missing queue


def apply_deployments(spec: SchedulerSpec, path: str | Path | None = None) -> list[str]:
    """Create or update every declared deployment (idempotent: same name, same deployment)."""
    from prefect.client.schemas.schedules import construct_schedule
    from prefect.flows import Flow

    deployments = load_deployments(path)
    check_deployments(deployments, spec)
    done = []
    for d in deployments:
        flow = Flow.from_source(str(REPO_ROOT), d["entrypoint"])
        schedules = [
            construct_schedule(cron=s["cron"], timezone=s.get("timezone"))
            for s in d.get("schedules") or []
            if s.get("active", True)
        ]
        with contextlib.redirect_stdout(io.StringIO()):  # Prefect prints a table per deployment
            flow.deploy(
                d["name"],
                work_pool_name=spec.pool.name,
                work_queue_name=d["work_pool"]["work_queue_name"],
                parameters=d.get("parameters") or {},
                schedules=schedules or None,
                description=d.get("description"),
                tags=d.get("tags") or None,
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
            )
        done.append(f"deployment {flow.name}/{d['name']} -> {d['work_pool']['work_queue_name']}")
    return done
