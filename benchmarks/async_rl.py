"""RL with a long-tailed tool, by staleness bound (issue 43): samples/s, the trainer's idle
share, held-out accuracy and peak memory of ``flowrl train configs/tool-math.yaml`` whose tool
calls wait a log-normal time (median 0.05 s, p99 2 s: ``tool_math``'s ``tool_latency_*``).

    python benchmarks/async_rl.py --steps 40 --out docs/benchmarks/async.md
    python benchmarks/async_rl.py --steps 20 --size large --out docs/benchmarks/async.md

``--size``: the tiny model (the config's) or ``large``, ``benchmarks/trl_compare.py``'s ~3M
(Llama hidden 256 × 4 layers, MLP 688: ``MODEL_SIZES``).

One fresh home; the first run also fills the SFT warm-up cache (to held-out accuracy 0.2, so
RL has room), which the others reuse (its time is in no figure below). Per staleness bound
``k`` (``schedule.max_staleness``), one ``flowrl train`` of ``--steps`` RL steps (more for
the faster bounds: ``LONGER``) with a held-out evaluation (50 rows) every 10, its process
tree's PSS sampled every 0.5 s. From the run's MLflow metrics: RL wall time (from the
evaluation before RL to the last step's end), samples/s (episodes trained per second of it),
the trainer's idle share (1 - update time / RL wall time), held-out accuracy before and after
RL, and held-out accuracy at equal wall time: each run's last evaluation within the k = 0
run's RL wall time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from footprint import train_watched

REPO = Path(__file__).resolve().parents[1]
FLOWRL = str(Path(sys.executable).with_name("flowrl"))
BOUNDS = (0, 1, 2, 4, 8)
LONGER = {0: 1.0, 1: 1.25, 2: 2.0, 4: 2.5, 8: 2.5}
"""Steps of each bound, times ``--steps``: the faster runs train longer, so that each has
evaluations up to the on-policy run's RL wall time (the equal wall time of the table)."""
LATENCY = ["env.params.tool_latency_median_s=0.05", "env.params.tool_latency_p99_s=2.0"]
EVAL_EVERY = 10
MODEL_SIZES = {
    "tiny": ("tiny model", []),
    "large": (
        "~3M model (hidden 256 × 4 layers)",
        [
            "model.tiny.hidden_size=256",
            "model.tiny.num_layers=4",
            "model.tiny.intermediate_size=688",
        ],
    ),
}


def run(home: Path, k: int, steps: int, size: str = "tiny") -> dict[str, float]:
    """One job at staleness bound ``k``: its figures."""
    name = f"async-k{k}-{int(time.time())}"  # a new job (one of a reused home would resume)
    overrides = [
        f"name={name}",
        f"schedule.steps={steps}",
        f"schedule.eval_every={EVAL_EVERY}",
        f"schedule.checkpoint_every={steps}",
        f"schedule.max_staleness={k}",
        "env.params.eval_size=50",
        "warmup.target_accuracy=0.2",
        "warmup.eval_every=10",
        *LATENCY,
        *MODEL_SIZES[size][1],
    ]
    cmd = [FLOWRL, "train", "configs/tool-math.yaml"]
    cmd += [arg for o in overrides for arg in ("--set", o)]
    run_id, wall, peak = train_watched(home, name, cmd)
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")

    def history(metric: str) -> list[tuple[int, float, float]]:
        points = sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)
        return [(m.step, m.timestamp / 1000, m.value) for m in points]

    steps_s = history("time/step_s")
    accuracy = history("eval/accuracy") + history("final/accuracy")
    began = accuracy[0][1]  # the evaluation before RL is logged as RL begins
    rl_s = steps_s[-1][1] - began
    update_s = sum(v for _, _, v in history("time/update_s"))
    params = client.get_run(run_id).data.params
    episodes = steps * int(params["rollout.prompts_per_step"]) * int(params["rollout.group_size"])
    dropped = sum(v for _, _, v in history("train/dropped_batches"))
    return {
        "k": k,
        "steps": steps,
        "rl_s": rl_s,
        "samples_per_s": episodes / rl_s,
        "idle": 1.0 - update_s / rl_s,
        "curve": [(t - began, v) for _, t, v in accuracy],
        "dropped": dropped,
        "staleness": [v for _, _, v in history("train/staleness")],
        "peak_pss_mb": peak.pss,
        "wall_s": wall,
    }


def report(rows: list[dict], steps: int, label: str, size: str = "tiny") -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    budget = rows[0]["rl_s"]  # the first bound's (k = 0's) RL wall time
    base = rows[0]["samples_per_s"]
    lines = [
        f"## {label} — {when}",
        "",
        f"`python benchmarks/async_rl.py --steps {steps} --size {size}` "
        f"({MODEL_SIZES[size][0]}, configs/tool-math.yaml, "
        f"16 prompts × 8 a step, tool waits median 0.05 s / p99 2 s; steps: k = 0 "
        f"{steps}, the others more (`LONGER`); equal wall time = {budget:.0f} s of RL, the "
        "first run's)",
        "",
        "| k | steps | RL wall s | samples/s | vs k = 0 | trainer idle | held-out accuracy | "
        "at equal wall time | staleness mean | dropped batches | peak PSS MB |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        curve = r["curve"]
        at_budget = [v for t, v in curve if t <= budget + 1e-6][-1]
        stale = sum(r["staleness"]) / max(len(r["staleness"]), 1)
        lines.append(
            f"| {r['k']} | {r['steps']} | {r['rl_s']:.1f} | {r['samples_per_s']:.1f} | "
            f"{r['samples_per_s'] / base:.2f}× | {r['idle']:.0%} | "
            f"{curve[0][1]:.2f} → {curve[-1][1]:.2f} | {at_budget:.2f} | {stale:.2f} | "
            f"{r['dropped']:.0f} | {r['peak_pss_mb']:.0f} |"
        )
    lines += ["", "Held-out accuracy by seconds of RL (every evaluation):", ""]
    for r in rows:
        points = ", ".join(f"{t:.0f} s {v:.2f}" for t, v in r["curve"])
        lines.append(f"- k = {r['k']}: {points}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bounds", default=",".join(map(str, BOUNDS)), help="k values")
    parser.add_argument("--size", choices=tuple(MODEL_SIZES), default="tiny")
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", help="append the table to this markdown file")
    parser.add_argument("--home", help="FLOWRL_HOME to use (its warm-up cache kept); default new")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowrl-async-") as fresh:
        home = Path(args.home or fresh)
        bounds = [int(k) for k in args.bounds.split(",")]
        rows = [run(home, k, round(args.steps * LONGER.get(k, 1.0)), args.size) for k in bounds]
    text = report(rows, args.steps, args.label, args.size)
    print(text)
    if args.out:
        with open(args.out, "a") as out:
            out.write("\n" + text)


if __name__ == "__main__":
    main()
