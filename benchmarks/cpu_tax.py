"""The orchestration tax: where a job's CPU goes, summed over its whole process tree.

    python benchmarks/cpu_tax.py --steps 20 --out docs/benchmarks/cpu_tax.md
    python benchmarks/cpu_tax.py --steps 20 --paths stack

Each path runs ``configs/arithmetic.yaml`` for ``--steps`` RL steps in a fresh home, cold (the
SFT warm-up included, as a user's first job pays it):
- ``local``: ``flowrl train`` (Prefect's embedded API, a local Ray, all children of the command);
- ``stack``: ``flowrl stack up``, then ``flowrl jobs submit`` and waiting for the run; the CPU of
  the stack's process trees (Prefect server and worker, flow-run process, Ray head and workers,
  MLflow server) is counted from submission to the run's end.

Every 0.5 s the script reads each process's user + system CPU seconds from /proc (psutil), keyed
by pid and start time, keeping the last value seen of processes that have since exited. A
process is labelled by the most specific name it had (a Ray worker that became an actor is that
actor, not ``ray::IDLE``). The share that matters is the policy's workers': the Ray actors that
sample and train (``SamplerWorker``, ``TrainerWorker``, ``ColocatedWorker``, ``SharedHost``);
a second share adds the one-off Ray tasks that build the model and run the SFT warm-up
(``ray::_located``), which are the policy's work too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
from footprint import kind  # same folder: the benchmark scripts share it

REPO = Path(__file__).resolve().parents[1]
FLOWRL = str(Path(sys.executable).with_name("flowrl"))
POLICY_KINDS = ("ray::SamplerWorker", "ray::TrainerWorker", "ray::ColocatedWorker")
POLICY_KINDS += ("ray::SharedHost", "ray::SharedWorker")
ONE_OFF_KINDS = ("ray::_located",)  # one-off Ray tasks: the tiny model's build, the SFT warm-up
VAGUE = ("ray::IDLE", "gone", "python", "python3")


@dataclass
class TreeCPU:
    """CPU seconds of every process seen in some process trees, by (pid, start time)."""

    seconds: dict[tuple[int, float], float] = field(default_factory=dict)
    labels: dict[tuple[int, float], str] = field(default_factory=dict)
    base: dict[tuple[int, float], float] = field(default_factory=dict)
    marks: dict[str, dict[tuple[int, float], float]] = field(default_factory=dict)

    def sample(self, roots: list[int]) -> None:
        for proc in _trees(roots):
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    label = kind(proc)
            except psutil.Error:
                continue
            self.seconds[key] = times.user + times.system
            if key not in self.labels or _specific(label) > _specific(self.labels[key]):
                self.labels[key] = label

    def start_window(self) -> None:
        """Count only CPU spent from now on (long-lived processes' earlier work left out)."""
        self.base = dict(self.seconds)

    def mark(self, name: str) -> None:
        """Remember every process's CPU seconds now, for ``by_kind(between=...)``."""
        self.marks[name] = dict(self.seconds)

    def by_kind(self, between: tuple[str, str] | None = None) -> dict[str, tuple[int, float]]:
        """CPU seconds by process kind: of the whole window, or between two marks."""
        start, end = (self.base, self.seconds)
        if between is not None:
            start, end = self.marks[between[0]], self.marks[between[1]]
        split: dict[str, tuple[int, float]] = {}
        for key, total in end.items():
            label = self.labels[key]
            n, cpu = split.get(label, (0, 0.0))
            split[label] = (n + 1, cpu + total - start.get(key, 0.0))
        return split


def _specific(label: str) -> int:
    """How much a label says: a Ray actor's name beats a worker still starting (whose command
    line names its raylet), which beats an idle worker or a bare interpreter."""
    if label.startswith("ray::") and label not in VAGUE:
        return 2
    return 0 if label in VAGUE or label.startswith("Ray raylet") else 1


def _trees(roots: list[int]) -> list[psutil.Process]:
    procs: list[psutil.Process] = []
    for pid in roots:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    return procs


def _sampler(tree: TreeCPU, roots: list[int], stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            tree.sample(roots)
            stop.wait(0.5)
        tree.sample(roots)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _overrides(steps: int) -> list[str]:
    sets = [f"schedule.steps={steps}", f"schedule.eval_every={steps}"]
    sets.append(f"schedule.checkpoint_every={steps}")
    return [arg for s in sets for arg in ("--set", s)]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.pop("FLOWRL_RAY_ADDRESS", None)
    return env | {"FLOWRL_HOME": str(home / "flowrl"), "PREFECT_HOME": str(home / "prefect")}


def run_local(home: Path, steps: int) -> tuple[float, TreeCPU]:
    """``flowrl train``: the command and every process it starts."""
    tree, stop = TreeCPU(), threading.Event()
    start = time.time()
    cmd = [FLOWRL, "train", "configs/arithmetic.yaml", *_overrides(steps)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    sampler = _sampler(tree, [proc.pid], stop)
    output = _follow_steps(proc, tree, steps)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"flowrl train failed ({proc.returncode}):\n{output[-3000:]}")
    return time.time() - start, tree


def _follow_steps(proc: subprocess.Popen, tree: TreeCPU, steps: int) -> str:
    """Read the job's output as it comes; mark the tree when its progress bar shows step 1
    done and when it shows the last, so the RL steps' own split can be told apart."""
    seen, marks = "", {f" 1/{steps} ": "rl-start", f" {steps}/{steps} ": "rl-end"}
    assert proc.stdout is not None
    while chunk := proc.stdout.read(256):
        seen += chunk
        for text, name in list(marks.items()):
            if text in seen[-2000:]:
                tree.sample([proc.pid])
                tree.mark(name)
                del marks[text]
    proc.wait()
    return seen


def run_stack(home: Path, steps: int) -> tuple[float, TreeCPU]:
    """``flowrl stack up``, one submitted job, ``flowrl stack down``."""
    env = _env(home) | {"FLOWRL_CONFIG_DIR": str(home / "config")}
    up = subprocess.run([FLOWRL, "stack", "up"], cwd=REPO, env=env, capture_output=True, text=True)
    if up.returncode != 0:
        raise RuntimeError(f"flowrl stack up failed:\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
    try:
        roots = _stack_pids(home / "flowrl" / "stack" / "state.json")
        tree, stop = TreeCPU(), threading.Event()
        tree.sample(roots)
        tree.start_window()
        sampler = _sampler(tree, roots, stop)
        start = time.time()
        cmd = [FLOWRL, "jobs", "submit", "rl-train", "configs/arithmetic.yaml", *_overrides(steps)]
        job = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
        run_id = job.stdout.split()[-1]
        wait = [FLOWRL, "jobs", "wait", run_id]
        job = subprocess.run(wait, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.time() - start
        stop.set()
        sampler.join()
        if job.returncode != 0:
            raise RuntimeError(f"job failed:\n{job.stdout[-3000:]}{job.stderr[-3000:]}")
        return wall, tree
    finally:
        subprocess.run([FLOWRL, "stack", "down"], cwd=REPO, env=env, capture_output=True)


def _stack_pids(state_file: Path) -> list[int]:
    state = json.loads(state_file.read_text())
    return [int(c["pid"]) for c in state["components"].values()]


def table(title: str, split: dict[str, tuple[int, float]]) -> str:
    total = sum(cpu for _, cpu in split.values())
    policy = sum(cpu for label, (_, cpu) in split.items() if label in POLICY_KINDS)
    one_off = sum(cpu for label, (_, cpu) in split.items() if label in ONE_OFF_KINDS)
    with_one_off = (
        f", with the one-off model build and warm-up {100 * (policy + one_off) / total:.0f} %"
    )
    lines = [
        f"{title}: {total:.1f} CPU s; the policy's workers: **{100 * policy / total:.0f} %**"
        + (with_one_off if one_off else ""),
        "",
        "| process kind | processes | CPU s | share |",
        "|---|--:|--:|--:|",
    ]
    for label, (n, cpu) in sorted(split.items(), key=lambda kv: -kv[1][1]):
        if cpu >= 0.05:
            lines.append(f"| {label} | {n} | {cpu:.1f} | {100 * cpu / total:.1f} % |")
    return "\n".join(lines)


def report(path: str, wall: float, tree: TreeCPU) -> str:
    cores = os.cpu_count() or 1
    parts = [f"### {path}: {wall:.0f} s wall ({cores * wall:.0f} CPU s available on {cores})"]
    parts.append(table("The whole job (start-up, warm-up, steps, registration)", tree.by_kind()))
    if {"rl-start", "rl-end"} <= tree.marks.keys():
        steps = table("RL steps 2 to the last", tree.by_kind(between=("rl-start", "rl-end")))
        parts.append(steps)
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps of the job.")
    parser.add_argument("--paths", nargs="+", default=["local", "stack"])
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    parser.add_argument("--label", default="", help="A heading for this run (e.g. the commit).")
    args = parser.parse_args()
    runners = {"local": run_local, "stack": run_stack}
    sections = []
    for path in args.paths:
        with tempfile.TemporaryDirectory(prefix="flowrl-cpu-tax-") as tmp:
            wall, tree = runners[path](Path(tmp), args.steps)
        text = report(path, wall, tree)
        print(text, "\n", flush=True)
        sections.append(text)
    command = shlex.join(["python", "benchmarks/cpu_tax.py", *sys.argv[1:]])
    head = f"## {args.label or 'cpu_tax'} — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    text = f"{head}\n\n`{command}`\n\n" + "\n\n".join(sections) + "\n"
    if args.out:
        old = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(old + ("\n" if old else "") + text)


if __name__ == "__main__":
    main()
