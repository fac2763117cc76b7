"""The default job's footprint: start-up (command to the first RL step, warm-up cached) and the
peak memory of its whole process tree, by process kind.

    python benchmarks/footprint.py --out docs/benchmarks/footprint.md

One warm-up run fills the SFT warm-up cache in a fresh home (not counted); then ``--runs`` runs
of ``flowrl train configs/arithmetic.yaml`` with ``--steps`` RL steps, each a new job name in
the same home (cached warm-up, no resume). Memory is the process tree's summed PSS (each shared
page split among its users) sampled every 0.5 s; the per-kind split is taken at the peak.
Start-up is the time from starting the command to the MLflow timestamp of the first
``reward/mean`` (logged when RL step 1 ends).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
FLOWRL = str(Path(sys.executable).with_name("flowrl"))


def kind(proc: psutil.Process) -> str:
    """A short name for what a process of the job's tree is."""
    try:
        name, cmd = proc.name(), " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    if name in ("raylet", "gcs_server"):  # their command lines name other Ray programs
        return {"raylet": "Ray raylet", "gcs_server": "Ray GCS"}[name]
    if name.startswith("ray::"):  # ray::SamplerWorker, ray::TrainerWorker, ray::IDLE, ...
        # A busy actor is named after its method (ray::Actor.call), a starting named one
        # after its name too (ray::job-sampler:Actor).
        return "ray::" + name[5:].split(".")[0].rsplit(":", 1)[-1]
    for pattern, label in (
        (r"flowrl train", "flowrl train (driver: flow, Prefect client and temporary API)"),
        (r"trl_compare\.py .*--side flowrl", "driver (flow, Prefect client and temporary API)"),
        (r"trl_compare\.py .*--side trl", "TRL (GRPOTrainer)"),
        (r"uvicorn .*prefect", "Prefect API (ephemeral)"),
        (r"prefect\.engine|flow-run execute", "flow-run process (flow, Prefect client)"),
        (r"prefect server start", "Prefect API server"),
        (r"prefect worker start", "Prefect worker"),
        (r"mlflow server|mlflow\.server|gunicorn", "MLflow server"),
        (r"serve tinker", "Tinker API"),
        (r"moto_server", "S3 (moto)"),
        (r"dashboard\.py", "Ray dashboard (head)"),
        (r"log_monitor\.py", "Ray log monitor"),
        (r"monitor\.py", "Ray autoscaler monitor"),
        (r"gcs_server", "Ray GCS"),
        (r"default_worker\.py", "ray::IDLE"),  # a worker still starting (names its raylet)
        (r"raylet", "Ray raylet"),
    ):
        if re.search(pattern, cmd):
            return label
    return name


@dataclass
class TreePeak:
    """Peak summed PSS/RSS (MB) of a process tree, with the per-kind split at the peak."""

    pss: float = 0.0
    rss: float = 0.0
    processes: int = 0
    split: dict[str, tuple[int, float]] = field(default_factory=dict)


def watch(pid: int, peak: TreePeak, stop: threading.Event) -> None:
    root = psutil.Process(pid)
    while not stop.wait(0.5):
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        pss = rss = 0.0
        split: dict[str, tuple[int, float]] = {}
        for proc in tree:
            try:
                info = proc.memory_full_info()
            except psutil.Error:
                continue
            mb = info.pss / 2**20
            pss, rss = pss + mb, rss + info.rss / 2**20
            n, total = split.get(kind(proc), (0, 0.0))
            split[kind(proc)] = (n + 1, total + mb)
        if pss > peak.pss:
            peak.pss, peak.rss, peak.processes, peak.split = pss, rss, len(tree), split


def train_watched(home: Path, name: str, cmd: list[str]) -> tuple[str, float, TreePeak]:
    """Run ``cmd`` (a ``flowrl train``) in the home ``home`` from the repository, its process
    tree's PSS watched: (its MLflow run id, wall seconds, peak); its output on failure."""
    env = {**os.environ, "FLOWRL_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    peak, stop = TreePeak(), threading.Event()
    start = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watcher = threading.Thread(target=watch, args=(proc.pid, peak, stop), daemon=True)
    watcher.start()
    output, _ = proc.communicate()
    wall = time.time() - start
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{output[-3000:]}")
    run_id = next(x for x in output.splitlines() if x.startswith("MLflow run")).split()[-1]
    return run_id, wall, peak


def run_job(home: Path, name: str, steps: int) -> tuple[float, float, TreePeak]:
    """One ``flowrl train`` of the default job: (seconds to the first RL step, wall, peak)."""
    overrides = [f"name={name}", f"schedule.steps={steps}", f"schedule.eval_every={steps}"]
    overrides.append(f"schedule.checkpoint_every={steps}")
    cmd = [FLOWRL, "train", "configs/arithmetic.yaml"]
    cmd += [arg for o in overrides for arg in ("--set", o)]
    start = time.time()
    run_id, wall, peak = train_watched(home, name, cmd)
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    first = min(m.timestamp for m in client.get_metric_history(run_id, "reward/mean"))
    return first / 1000 - start, wall, peak


def report(runs: list[tuple[float, float, TreePeak]], steps: int, loads: list[str]) -> str:
    import mlflow
    import prefect
    import ray
    import torch

    first = [r[0] for r in runs]
    peaks = [r[2] for r in runs]
    worst = max(peaks, key=lambda p: p.pss)
    lines = [
        "# The default job's footprint: start-up and memory",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/footprint.py "
        f"--runs {len(runs)} --steps {steps}`",
        f"- machine: {os.cpu_count()} CPUs, no GPU; load average (1/5/15 min) at the start "
        f"{loads[0]}, at the end {loads[1]}; shared with other work: compare within this file",
        f"- software: torch {torch.__version__}, prefect {prefect.__version__}, ray "
        f"{ray.__version__}, mlflow {mlflow.__version__}",
        "- job: `flowrl train configs/arithmetic.yaml` (64 prompts × 8 samples, on-policy) "
        f"with {steps} RL steps, warm-up cached, a fresh job name per run; embedded engines "
        "(Prefect's temporary API in the job's process, local Ray, MLflow on SQLite)",
        "",
        "| figure | median | min | max |",
        "|---|--:|--:|--:|",
        "| command → first RL step done, s | "
        f"{statistics.median(first):.1f} | {min(first):.1f} | {max(first):.1f} |",
        "| whole command, s | "
        + " | ".join(f"{f([r[1] for r in runs]):.1f}" for f in (statistics.median, min, max))
        + " |",
        "| peak PSS of the process tree, MB | "
        + " | ".join(f"{f([p.pss for p in peaks]):.0f}" for f in (statistics.median, min, max))
        + " |",
        "| peak RSS of the process tree (summed), MB | "
        + " | ".join(f"{f([p.rss for p in peaks]):.0f}" for f in (statistics.median, min, max))
        + " |",
        "",
        f"At the highest peak ({worst.pss:.0f} MB PSS, {worst.processes} processes), by kind:",
        "",
        "| process | count | PSS, MB |",
        "|---|--:|--:|",
    ]
    for name, (n, mb) in sorted(worst.split.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n} | {mb:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="Counted runs (default 3).")
    parser.add_argument("--steps", type=int, default=5, help="RL steps per run (default 5).")
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="flowrl-footprint-"))
    loads = [" / ".join(f"{x:.1f}" for x in os.getloadavg())]
    print(f"warm-up run in {home} (fills the warm-up cache; not counted)", file=sys.stderr)
    run_job(home, "footprint-warm", 1)
    runs = []
    for i in range(args.runs):
        runs.append(run_job(home, f"footprint-{i}", args.steps))
        print(f"run {i}: first step {runs[-1][0]:.1f} s, peak PSS {runs[-1][2].pss:.0f} MB")
    loads.append(" / ".join(f"{x:.1f}" for x in os.getloadavg()))
    text = report(runs, args.steps, loads)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
