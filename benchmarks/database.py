"""Ten concurrent job submissions on the local stack, with the Prefect server on PostgreSQL (the
stack's database) and then on SQLite (Prefect's default): "database is locked" and other
errors in every log of the stack, jobs completed.

    python benchmarks/database.py [--jobs 10] [--seconds 10] [--out docs/benchmarks/database.md]

Each run is a fresh ``stack up`` (no Tinker API; its own home), then ``--jobs`` runs of the
``gpu-probe`` flow (each holds one of the pool's 2 GPU slots for ``--seconds``, as a training
job's admission does) submitted at once; it waits for all of them, counts, and takes the stack
down. The SQLite run sets ``FLOWRL_STACK_PREFECT_DB=sqlite`` (``infra/stack_programs.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKED = re.compile(r"database is locked")
TRACEBACK = re.compile(r"^Traceback", re.MULTILINE)


def one_run(database: str, jobs: int, seconds: float) -> dict:
    from prefect.deployments import run_deployment
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flowrl.infra import stack
    from flowrl.infra.client import JobClient
    from flowrl.infra.scheduler import load_scheduler
    from flowrl.infra.stack_programs import PREFECT_DB_VARIABLE

    home = Path(tempfile.mkdtemp(prefix=f"flowrl-db-{database}-"))
    os.environ.update({"FLOWRL_HOME": str(home), "FLOWRL_CONFIG_DIR": str(home / "config")})
    for key in ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "FLOWRL_MLFLOW_TRACKING_URI"):
        os.environ.pop(key, None)
    if database == "sqlite":
        os.environ[PREFECT_DB_VARIABLE] = "sqlite"
    else:
        os.environ.pop(PREFECT_DB_VARIABLE, None)
    state = stack.stack_up(deploy=False, ray=False)
    try:
        os.environ.update(state.env)
        pool = load_scheduler().pool.name
        with temporary_settings(updates={PREFECT_API_URL: state.env["PREFECT_API_URL"]}):
            Flow.from_source(str(REPO), "flowrl.flows.probe.gpu_probe").deploy(
                "gpu-probe",
                work_pool_name=pool,
                work_queue_name="eval",
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
            )
            began = time.monotonic()
            ids = [
                str(
                    run_deployment(
                        "gpu-probe/gpu-probe",
                        parameters={"seconds": seconds, "gpus": 1},
                        timeout=0,
                    ).id
                )
                for _ in range(jobs)
            ]
            client = JobClient()
            finals = [client.wait(run_id, timeout=900) for run_id in ids]
            took = time.monotonic() - began
    finally:
        stack.stack_down()
    counts = {"locked": 0, "tracebacks": 0}
    for log in sorted((home / "stack").glob("*.log")):
        text = log.read_text(errors="replace")
        counts["locked"] += len(LOCKED.findall(text))
        counts["tracebacks"] += len(TRACEBACK.findall(text))
    completed = sum(f.state == "COMPLETED" for f in finals)
    return {"database": database, "completed": completed, "took": took, **counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [one_run(db, args.jobs, args.seconds) for db in ("postgresql", "sqlite")]
    lines = [
        f"{args.jobs} `gpu-probe` jobs submitted at once (each holds 1 of 2 GPU slots for "
        f"{args.seconds:g} s), on a fresh `stack up` each:",
        "",
        '| Prefect database | jobs completed | "database is locked" in the stack\'s logs '
        "| tracebacks in the stack's logs | all done after |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['database']} | {r['completed']} / {args.jobs} | {r['locked']} "
            f"| {r['tracebacks']} | {r['took']:.0f} s |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text("# Prefect's database under concurrent submissions\n\n" + report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
