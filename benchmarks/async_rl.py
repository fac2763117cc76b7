"""RL with a long-tailed tool, by staleness bound (issue 43): samples/s, the trainer's idle
share, held-out accuracy and peak memory of ``flowrl train configs/tool-math.yaml`` whose tool
calls wait a log-normal time (median 0.05 s, p99 2 s: ``tool_math``'s ``tool_latency_*``).

    python benchmarks/async_rl.py --steps 20 --out docs/benchmarks/async.md

One fresh home; the first run also fills the SFT warm-up cache, which the others reuse (its
time is not in any figure below). Per staleness bound ``k``, one ``flowrl train`` of
``--steps`` RL steps, its process tree's PSS sampled every 0.5 s. From the run's MLflow
metrics: RL wall time (the sum of ``time/step_s``), samples/s (episodes trained per second of
it), the trainer's idle share (1 - update time / RL wall time) and held-out accuracy before
and after RL (``eval/accuracy`` at step 0 and at the end).

Staleness bounds run today: 0 (on-policy: rollout, update, sync in turn) and 1 (the next
step's rollout sampled while this step's update runs: ``schedule.off_policy_steps: 1``).
Bounds of 2 and more are the rest of issue 43 and are listed as not built.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from footprint import TreePeak, watch

REPO = Path(__file__).resolve().parents[1]
FLOWRL = str(Path(sys.executable).with_name("flowrl"))
BUILT = (0, 1)
LATENCY = ["env.params.tool_latency_median_s=0.05", "env.params.tool_latency_p99_s=2.0"]


def run(home: Path, k: int, steps: int) -> dict[str, float]:
    """One job at staleness bound ``k``: its figures."""
    name = f"async-k{k}"
    overrides = [
        f"name={name}",
        f"schedule.steps={steps}",
        f"schedule.eval_every={steps}",
        f"schedule.checkpoint_every={steps}",
        f"schedule.off_policy_steps={k}",
        *LATENCY,
    ]
    cmd = [FLOWRL, "train", "configs/tool-math.yaml"]
    cmd += [arg for o in overrides for arg in ("--set", o)]
    env = {**os.environ, "FLOWRL_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    peak, stop = TreePeak(), threading.Event()
    began = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watcher = threading.Thread(target=watch, args=(proc.pid, peak, stop), daemon=True)
    watcher.start()
    output, _ = proc.communicate()
    wall = time.time() - began
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{output[-3000:]}")
    run_id = next(x for x in output.splitlines() if x.startswith("MLflow run")).split()[-1]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")

    def history(metric: str) -> list[float]:
        points = sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)
        return [m.value for m in points]

    rl_s = sum(history("time/step_s"))
    update_s = sum(history("time/update_s"))
    params = client.get_run(run_id).data.params
    episodes = steps * int(params["rollout.prompts_per_step"]) * int(params["rollout.group_size"])
    accuracy = history("eval/accuracy")
    return {
        "k": k,
        "rl_s": rl_s,
        "samples_per_s": episodes / rl_s,
        "idle": 1.0 - update_s / rl_s,
        "acc_start": accuracy[0],
        "acc_end": accuracy[-1],
        "peak_pss_mb": peak.pss,
        "wall_s": wall,
    }


def report(rows: list[dict[str, float]], steps: int, label: str) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## {label} — {when}",
        "",
        f"`python benchmarks/async_rl.py --steps {steps}` (tiny model, "
        f"configs/tool-math.yaml, 16 prompts × 8 a step, tool waits median 0.05 s / p99 2 s)",
        "",
        "| k (staleness bound) | RL wall s | samples/s | trainer idle | held-out accuracy | "
        "peak PSS MB |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']:.0f} | {r['rl_s']:.1f} | {r['samples_per_s']:.1f} | {r['idle']:.0%} | "
            f"{r['acc_start']:.3f} → {r['acc_end']:.3f} | {r['peak_pss_mb']:.0f} |"
        )
    for k in (2, 4, 8):
        lines.append(f"| {k} | not built yet | | | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", help="append the table to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowrl-async-") as home:
        rows = [run(Path(home), k, args.steps) for k in BUILT]
    text = report(rows, args.steps, args.label)
    print(text)
    if args.out:
        with open(args.out, "a") as out:
            out.write("\n" + text)


if __name__ == "__main__":
    main()
