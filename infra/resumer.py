"""The stack's resumer: what the resume automation misses, done by a loop that keeps no state.

Prefect's automations (``infra/scheduler.py``) resume a crashed job within seconds, but their
triggers live in the Prefect server's memory: a crash the server did not see through (it was
killed inside the trigger's window, or a job's process died while the server was down, so no
heartbeat went missing *while it watched*) is never acted on. Every ``PASS_SECONDS`` this loop
asks the Prefect API, as a user would:

- a flow run tagged ``RESUME_TAG`` that is RUNNING or PENDING while its process (the
  worker's ``infrastructure_pid``, on this machine) is gone, or PENDING for
  ``PENDING_SECONDS`` with none (its worker was killed as it started it), on two passes in a
  row in the same state, is marked CRASHED (a run scheduled again between the passes is PENDING
  in a new state, still showing its last attempt's dead pid until the worker writes the new
  one: a first look);
- a flow run tagged ``RESUME_TAG`` that has been CRASHED for ``GRACE_SECONDS`` (the automation
  had its chance) and has run fewer than ``max_attempts`` times is scheduled again
  (``AwaitingRetry``), exactly as the automation would have done.

It runs under the stack's supervisor (``flowrl stack up``); it talks to the API with ``httpx``
(no Prefect import).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from flowrl.infra.supervise import alive

PASS_SECONDS = 15.0
GRACE_SECONDS = 30.0
"""How long a run stays CRASHED before the resumer acts (the automation acts after 10 s)."""
PENDING_SECONDS = 180.0
"""A run PENDING this long with no process (its worker died as it started it) is stuck."""
WINDOW = timedelta(hours=24)
"""Crashes older than this are left alone (a person may have given up on them)."""

logger = logging.getLogger("flowrl.resumer")


def _age_s(state: dict[str, Any], now: datetime) -> float:
    stamp = datetime.fromisoformat(str(state["timestamp"]).replace("Z", "+00:00"))
    return (now - stamp).total_seconds()


def _process_gone(infrastructure_pid: Any) -> bool:
    """The worker's process id of a run names no process of this machine."""
    try:
        pid = int(str(infrastructure_pid).rsplit(":", 1)[-1])
    except (TypeError, ValueError):
        return False
    return pid > 0 and not alive(pid)


class Resumer:
    def __init__(self, api: httpx.Client, tag: str, max_attempts: int):
        self.api = api
        self.tag = tag
        self.max_attempts = max_attempts
        self._gone_once: set[tuple[str, str]] = set()  # (run, state) seen gone on the last pass

    def runs(self, state_type: str) -> list[dict[str, Any]]:
        body = {
            "flow_runs": {
                "state": {"type": {"any_": [state_type]}},
                "tags": {"all_": [self.tag]},
            },
            "limit": 200,
        }
        response = self.api.post("/flow_runs/filter", json=body)
        response.raise_for_status()
        return list(response.json())

    def set_state(self, run_id: str, state: dict[str, Any]) -> None:
        response = self.api.post(
            f"/flow_runs/{run_id}/set_state", json={"state": state, "force": True}
        )
        response.raise_for_status()

    def one_pass(self, now: datetime | None = None) -> list[str]:
        """One look at the API; what was done, one line each."""
        now = now or datetime.now(UTC)
        done = []
        gone_now = set()
        for run in self.runs("RUNNING") + self.runs("PENDING"):
            kind = run["state"]["type"]
            pid = run.get("infrastructure_pid")
            if pid:
                gone = _process_gone(pid)
            else:  # a worker killed as it started the run: it never got a process
                gone = kind == "PENDING" and _age_s(run["state"], now) > PENDING_SECONDS
            if not gone:
                continue
            seen = (run["id"], str(run["state"].get("id")))
            gone_now.add(seen)
            if seen in self._gone_once:  # gone in this state on the pass before too: no race
                what = f"pid {pid}" if pid else f"none after {PENDING_SECONDS:.0f} s"
                message = (
                    f"flowrl: the job's process ({what}) is gone (seen by the stack's resumer)"
                )
                crashed = {"type": "CRASHED", "name": "Crashed", "message": message}
                self.set_state(run["id"], crashed)
                done.append(f"{run['name']}: {kind} with its process gone -> CRASHED")
        self._gone_once = gone_now
        for run in self.runs("CRASHED"):
            age = _age_s(run["state"], now)
            if age < GRACE_SECONDS or age > WINDOW.total_seconds():
                continue
            attempts = int(run.get("run_count") or 0)
            if attempts >= self.max_attempts:
                continue
            message = (
                f"flowrl: resumed by the stack's resumer, {age:.0f} s after its crash "
                f"(attempt {attempts + 1} of {self.max_attempts})"
            )
            self.set_state(
                run["id"], {"type": "SCHEDULED", "name": "AwaitingRetry", "message": message}
            )
            done.append(f"{run['name']}: CRASHED {age:.0f} s -> scheduled again")
        return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api", required=True, help="the Prefect API URL (…/api)")
    p.add_argument("--tag", required=True)
    p.add_argument("--max-attempts", type=int, required=True)
    p.add_argument("--every", type=float, default=PASS_SECONDS)
    args = p.parse_args(argv)
    logging.basicConfig(
        stream=sys.stdout, level=logging.INFO, format="%(asctime)s resumer: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.max_attempts <= 1:
        logger.info("max_attempts %d: nothing is resumed; the resumer idles", args.max_attempts)
    with httpx.Client(base_url=args.api.rstrip("/"), timeout=30, trust_env=False) as api:
        resumer = Resumer(api, args.tag, args.max_attempts)
        while True:
            if args.max_attempts > 1:
                try:
                    for line in resumer.one_pass():
                        logger.info(line)
                except (httpx.HTTPError, ValueError, KeyError) as err:
                    # The Prefect server is down or restarting: its supervisor brings it back.
                    logger.info("no answer from the Prefect API (%s); next pass", err)
            time.sleep(args.every)


if __name__ == "__main__":
    raise SystemExit(main())
