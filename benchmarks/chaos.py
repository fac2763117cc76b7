"""Chaos and soak benchmark of the local stack: a mixed load while every component is killed once.

On a fresh ``flowrl stack up`` (its own FLOWRL_HOME, a temp folder), it runs for a bounded time:
- jobs: three ``rl-train`` in two namespaces (alpha: two, beta: one), an ``sft-train``, a
  ``self-play``, a ``batch-inference``;
- a Tinker SDK loop (``examples/tinker/sl_loop.py`` in the thin client venv, ``.venv-client``);
- OpenAI-endpoint traffic (a chat completion a second, the official ``openai`` client);
and a fault schedule (seeded) SIGKILLs, each once, at a random moment: MLflow, the Prefect
server, the worker, the Ray head's GCS, S3, one job's flow-run process, PostgreSQL, the Tinker
API and the OpenAI endpoint. It then prints, and writes as Markdown, a table of: jobs
submitted / completed / resumed by themselves / lost; checkpoints written vs readable; metric
steps expected vs present (and duplicated); registered versions whose artifacts load; each
component's time to recover; client requests failed vs retried; "database is locked" and
tracebacks in every log.

    python benchmarks/chaos.py [--seed 0] [--minutes 15] [--out docs/benchmarks/chaos.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("mlflow", "prefect", "worker", "ray", "s3", "job", "postgres", "tinker", "openai")
RL_STEPS = 80


def rl_job(name: str) -> dict:
    return {
        "name": name,
        "warmup": {"enabled": False},
        "rollout": {"prompts_per_step": 8, "group_size": 4},
        "schedule": {"steps": RL_STEPS, "eval_every": 1000, "checkpoint_every": 10},
    }


def submit(deployment: str, config: dict, namespace: str | None = None) -> str:
    from prefect.deployments import run_deployment

    from flowrl.infra.client import JobClient

    name = JobClient().deployment_name(deployment)
    env = {"FLOWRL_NAMESPACE": namespace} if namespace else {}
    run = run_deployment(
        name,
        parameters={"config": config},
        timeout=0,
        flow_run_name=config.get("name"),
        job_variables={"env": env} if env else None,
    )
    return str(run.id)


class Traffic(threading.Thread):
    """A chat completion a second on the stack's OpenAI endpoint; a failed request is tried
    again up to 5 times, a second apart."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=30)
        self.counts = {"requests": 0, "ok first time": 0, "ok after retries": 0, "failed": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.counts["requests"] += 1
            for attempt in range(6):
                try:
                    self.client.chat.completions.create(
                        model="flowrl/tiny",
                        messages=[{"role": "user", "content": "1+1="}],
                        max_tokens=4,
                    )
                    self.counts["ok first time" if attempt == 0 else "ok after retries"] += 1
                    break
                except Exception:  # noqa: BLE001 - counted
                    time.sleep(1.0)
            else:
                self.counts["failed"] += 1


def tinker_loop(env: dict[str, str], home: Path) -> subprocess.Popen:
    client = REPO / ".venv-client" / "bin" / "python"
    tok = home / "tiny-tokenizer"
    flowrl = Path(sys.executable).with_name("flowrl")
    subprocess.run(
        [str(flowrl), "tinker", "tokenizer", "flowrl/tiny", "--out", str(tok)],
        env=env,
        check=True,
        capture_output=True,
    )
    log = open(home / "tinker-loop.log", "w")  # noqa: SIM115 - closed with the process
    cmd = [str(client), str(REPO / "examples/tinker/sl_loop.py"), "--tokenizer", str(tok)]
    cmd += ["--steps", "60", "--json"]
    return subprocess.Popen(
        cmd, env=env | {"TINKER_API_KEY": "tml-chaos"}, stdout=log, stderr=subprocess.STDOUT
    )


def kill(state, name: str, jobs: dict[str, str]) -> tuple[str, dict | None]:
    """SIGKILL what ``name`` names; returns what was killed and the component's status before."""
    from flowrl.infra import stack
    from flowrl.infra.client import JobClient

    if name == "job":  # the first job found RUNNING (waiting up to 3 minutes for one)
        from uuid import UUID

        from prefect import get_client

        client = JobClient()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for run_id in jobs.values():
                if client.status(run_id).state != "RUNNING":
                    continue
                with get_client(sync_client=True) as c:
                    infra = c.read_flow_run(UUID(run_id)).infrastructure_pid
                if infra:
                    pid = str(infra).rsplit(":", 1)[-1]
                    os.kill(int(pid), signal.SIGKILL)
                    return f"job {run_id[:8]} (pid {pid})", None
            time.sleep(2.0)
        return "job (none running)", None
    before = stack.component_status(state)[name]
    pid = before["pid"]
    if name == "ray":
        found = subprocess.run(
            ["pgrep", "-f", "gcs_server", "-g", str(pid)], capture_output=True, text=True
        ).stdout.split()
        pid = int(found[0]) if found else pid
    os.kill(pid, signal.SIGKILL)
    return f"{name} (pid {pid})", before


def recovered(state, name: str, before: dict, timeout: float = 300.0) -> float | None:
    from flowrl.infra import stack

    began = time.monotonic()
    while time.monotonic() - began < timeout:
        now = stack.component_status(state)[name]
        if now["restarts"] > before["restarts"] and now["state"] == "RUNNING":
            try:
                stack.check_component(state, name, timeout=5)
                return time.monotonic() - began
            except stack.ComponentDownError:
                pass
        time.sleep(0.5)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=15.0, help="Bound on the whole run.")
    parser.add_argument("--out", default=None, help="Write the tables as Markdown here.")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="flowrl-chaos-"))
    os.environ.update({"FLOWRL_HOME": str(home), "FLOWRL_CONFIG_DIR": str(home / "config")})
    for key in ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "FLOWRL_MLFLOW_TRACKING_URI"):
        os.environ.pop(key, None)
    from flowrl.infra import stack

    began = time.monotonic()
    deadline = began + args.minutes * 60
    state = stack.stack_up(progress=True)
    up_s = time.monotonic() - began
    os.environ.update(state.env)
    try:
        return run(args, state, home, up_s, deadline)
    finally:
        stack.stack_down()


def run(args, state, home: Path, up_s: float, deadline: float) -> int:
    from flowrl.infra.client import JobClient

    rng = random.Random(args.seed)
    chat = home / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{a}+1="},
                {"role": "assistant", "content": str(a + 1)},
            ]
        }
        for a in range(40)
    ]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    jobs = {
        "alpha/chaos-rl-1": submit("rl-train", rl_job("chaos-rl-1"), "alpha"),
        "alpha/chaos-rl-2": submit("rl-train", rl_job("chaos-rl-2"), "alpha"),
        "beta/chaos-rl-3": submit("rl-train", rl_job("chaos-rl-3"), "beta"),
        "chaos-sft": submit(
            "sft-train",
            {
                "name": "chaos-sft",
                "data": {"train": str(chat), "eval_size": 8},
                "train": {"steps": 40, "eval_every": 20, "batch_size": 4},
            },
        ),
        "chaos-selfplay": submit(
            "self-play",
            {
                "name": "chaos-selfplay",
                "env": {"name": "gomoku", "params": {"size": 3, "win_length": 3, "eval_size": 4}},
                "warmup": {"enabled": False},
                "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                "schedule": {"steps": 20, "eval_every": 10, "checkpoint_every": 5},
            },
        ),
        "chaos-infer": submit(
            "batch-inference",
            {
                "name": "chaos-infer",
                "model": {"source": "tiny"},
                "num_prompts": 16,
                "env": {"params": {"eval_size": 16}},
            },
        ),
    }
    traffic = Traffic(state.env["OPENAI_BASE_URL"])
    traffic.start()
    tinker = tinker_loop({**os.environ}, home)

    faults = list(FAULTS)
    rng.shuffle(faults)
    window = max(60.0, (deadline - time.monotonic()) * 0.5)
    moments = sorted(rng.uniform(20.0, window) for _ in faults)
    start = time.monotonic()
    recovery: list[tuple[str, str, str]] = []
    for name, at in zip(faults, moments, strict=True):
        time.sleep(max(0.0, start + at - time.monotonic()))
        what, before = kill(state, name, jobs)
        took = None if before is None else recovered(state, name, before)
        shown = "-" if before is None else ("NOT BACK" if took is None else f"{took:.1f} s")
        recovery.append((name, what, shown))
        print(f"  killed {what} at {time.monotonic() - start:5.0f} s; back: {shown}", flush=True)

    client = JobClient()
    finals = {}
    for label, run_id in jobs.items():
        left = max(10.0, deadline - time.monotonic())
        try:
            finals[label] = client.wait(run_id, timeout=left)
        except TimeoutError:
            finals[label] = client.status(run_id)
    traffic.stop.set()
    try:
        tinker_rc = tinker.wait(timeout=max(10.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        tinker.kill()
        tinker_rc = "timed out"
    report = tables(state, home, jobs, finals, recovery, traffic.counts, tinker_rc, up_s)
    print(report)
    if args.out:
        Path(args.out).write_text(HEADER + report)
    return 0


def tables(state, home, jobs, finals, recovery, traffic, tinker_rc, up_s) -> str:
    from flowrl.backends.models.model_uri import resolve_model_uri
    from flowrl.infra import tracking
    from flowrl.infra.storage import Storage, load_latest_checkpoint

    storage = Storage(state.env["FLOWRL_STORAGE_URL"])
    completed = sum(s.state == "COMPLETED" for s in finals.values())
    resumed = sum(s.attempts > 1 for s in finals.values())
    lines = [f"stack up: {up_s:.0f} s", "", "| jobs | count |", "|---|---|"]
    lines += [
        f"| submitted | {len(jobs)} |",
        f"| completed | {completed} |",
        f"| resumed by themselves | {resumed} |",
        f"| lost | {len(jobs) - completed} |",
    ]
    lines += [
        "",
        "| job | state | attempts | checkpoint readable | steps expected / present "
        "/ duplicated | version loads |",
        "|---|---|---|---|---|---|",
    ]
    client = tracking.client()
    for label, status in finals.items():
        ns, _, name = label.rpartition("/")
        prefix = f"ns/{ns}/jobs/{name}" if ns else f"jobs/{name}"
        ckpt, steps, loads = "-", "-", "-"
        if "rl-" in name or "selfplay" in name:
            # A self-play job checkpoints each agent under its own prefix (agent-<name>/).
            agents = [
                f"{prefix}/{entry.rstrip('/').rsplit('/', 1)[-1]}/checkpoints"
                for entry in (storage.list(prefix) if storage.exists(prefix) else [])
                if entry.rstrip("/").rsplit("/", 1)[-1].startswith("agent-")
            ]
            try:
                found = [
                    load_latest_checkpoint(storage, p) for p in agents or [f"{prefix}/checkpoints"]
                ]
                ckpt = "yes" if all(found) else "none"
            except Exception as err:  # noqa: BLE001 - reported
                ckpt = f"NO ({type(err).__name__})"
        result = (
            storage.read_json(f"{prefix}/result.json")
            if storage.exists(f"{prefix}/result.json")
            else None
        )
        if result and "rl-" in name:
            history = client.get_metric_history(result["mlflow_run_id"], "reward/mean")
            got = [m.step for m in history]
            steps = f"{RL_STEPS} / {len(set(got))} / {len(got) - len(set(got))}"
        if result and result.get("model_uri"):
            try:
                from transformers import AutoModelForCausalLM

                folder = resolve_model_uri(result["model_uri"], str(home / "models"))
                AutoModelForCausalLM.from_pretrained(folder)
                loads = "yes"
            except Exception as err:  # noqa: BLE001 - reported
                loads = f"NO ({type(err).__name__})"
        lines.append(
            f"| {label} | {status.state} | {status.attempts} | {ckpt} | {steps} | {loads} |"
        )
    lines += ["", "| fault (SIGKILL) | what | time to recover |", "|---|---|---|"]
    lines += [f"| {n} | {w} | {t} |" for n, w, t in recovery]
    lines += ["", "| clients | count |", "|---|---|"]
    lines += [f"| OpenAI requests {k} | {v} |" for k, v in traffic.items()]
    lines += [f"| Tinker SDK loop (60 steps) exit | {tinker_rc} |"]
    lines += ["", "| log | database is locked | Traceback |", "|---|---|---|"]
    for log in sorted((home / "stack").glob("*.log")):
        text = log.read_text(errors="replace")
        lines.append(
            f"| {log.name} | {text.count('database is locked')} | {text.count('Traceback')} |"
        )
    return "\n".join(lines) + "\n"


HEADER = """# Chaos benchmark: the local stack under faults

`python benchmarks/chaos.py` (defaults: seed 0, at most 15 minutes) on a fresh `flowrl stack up`:
three `rl-train` jobs in two namespaces, an `sft-train`, a `self-play`, a `batch-inference`, a
Tinker SDK loop and OpenAI-endpoint traffic, while each component is SIGKILLed once at a seeded
random moment. Goal: 0 lost jobs, 0 lost or duplicated metric steps, 0 unreadable checkpoints or
versions, 0 "database is locked".

"""

if __name__ == "__main__":
    raise SystemExit(main())
