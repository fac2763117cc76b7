"""Hung environment calls: what k hung calls in a round cost a job (``env.step_timeout_s``).

    python benchmarks/hung_env.py --out docs/benchmarks/hung_env.md

Each row is one ``rl-train`` job (in this process, on the ephemeral Prefect API and a local
Ray) of ``tests.hangs:Hanging``, a one-turn environment whose ``step`` hangs for an hour on
chosen rows: with ``--timeout`` 5 s, 2 RL steps of 8 prompts × 2 (training: one episode in 16
hangs, ``hang_every=16``) and 200 held-out episodes, of which the ones whose seed is 1 modulo
``eval_hang_every`` hang. It reports the two evaluations' seconds and failed episodes (MLflow's
``eval/*`` and ``final/*``) and the steps' seconds, against the same job with nothing hung.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from step_time import set_environment  # same folder: the benchmark scripts share it

REPO = Path(__file__).resolve().parents[1]
EVERY = {0: 0, 1: 1000, 13: 16, 50: 4}
"""Hung held-out episodes of 200 → ``eval_hang_every`` (seeds 1, 17, 33, ... hang)."""


def run(home: Path, hung: int, timeout_s: float, claims: Path) -> dict[str, float]:
    from flowrl.flows.rl import rl_train
    from flowrl.infra.tracking import client
    from flowrl.tasks.schemas import load_job

    config = load_job(
        None,
        [
            f"name=hung-{hung}",
            "env.name=tests.hangs:Hanging",
            f"env.params.eval_hang_every={EVERY[hung]}",
            "env.params.hang_every=16",
            f"env.params.claims={claims}",
            f"env.step_timeout_s={timeout_s}",
            "env.eval_size=200",
            "warmup.enabled=false",
            "rollout.prompts_per_step=8",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "schedule.steps=2",
            "schedule.eval_every=100",
            "schedule.checkpoint_every=100",
        ],
    )
    start = time.perf_counter()
    result = rl_train(config)
    wall = time.perf_counter() - start
    c = client()

    def last(key: str) -> float:
        return c.get_metric_history(result.mlflow_run_id, key)[-1].value

    steps = [m.value for m in c.get_metric_history(result.mlflow_run_id, "time/step_s")]
    failed = [
        m.value for m in c.get_metric_history(result.mlflow_run_id, "rollout/failed_episodes")
    ]
    return {
        "eval_s": last("eval/seconds"),
        "eval_failed": last("eval/failed"),
        "final_s": last("final/seconds"),
        "final_failed": last("final/failed"),
        "steps_s": sum(steps),
        "step_failed": sum(failed),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="env.step_timeout_s")
    parser.add_argument("--hung", type=int, nargs="+", default=sorted(EVERY), choices=EVERY)
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="flowrl-hung-"))
    set_environment(home)
    sys.path.insert(0, str(REPO))  # tests.hangs, by name, in this process
    rows = [
        "| hung per evaluation (of 200) | evaluation before RL: s (failed) | final: s (failed) | "
        "2 steps: s (failed episodes) | job wall s |",
        "|--:|--:|--:|--:|--:|",
    ]
    for hung in args.hung:
        claims = home / f"claims-{hung}"
        claims.mkdir()
        r = run(home, hung, args.timeout, claims)
        rows.append(
            f"| {hung} | {r['eval_s']:.1f} ({r['eval_failed']:.0f}) | "
            f"{r['final_s']:.1f} ({r['final_failed']:.0f}) | {r['steps_s']:.1f} "
            f"({r['step_failed']:.0f}) | {r['wall']:.0f} |"
        )
        print(rows[-1], flush=True)
    command = shlex.join(["python", "benchmarks/hung_env.py", *sys.argv[1:]])
    text = (
        f"## Hung environment calls, {args.timeout:g} s timeout — "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n\n`{command}`\n\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if args.out:
        old = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(old + ("\n" if old else "") + text)


if __name__ == "__main__":
    main()
