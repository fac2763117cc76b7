"""Time per RL step of the default job by stage: the rl_train flow vs plain function calls.

Orchestrated: the real flow (Prefect + Ray); stage times as it logs them to MLflow, the reward
stage's time and the one-off costs from its task runs in the Prefect API. Plain: the same steps
from the same cached warm model with ``task.fn`` and in-process workers (no Prefect, no Ray).
Same seeds, so both sample the same tokens: the difference is orchestration.

    python benchmarks/step_time.py --steps 50 --out docs/benchmarks/step_time.md
    python benchmarks/step_time.py --steps 20 --size large --out docs/benchmarks/step_time_3m.md

``--size``: the default job (``tiny``) or ``benchmarks/trl_compare.py``'s ~3M-parameter one
(``large``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

Series = dict[str, list[float]]
NEVER = "1000000"  # eval and checkpoint intervals that keep both out of the measured steps


def set_environment(home: Path) -> None:
    """Engines read these at import time: call before importing prefect, ray, mlflow or flows."""
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        os.environ.pop(name, None)  # always the embedded engines, under the fresh home
    os.environ.update(
        FLOWRL_HOME=str(home / "flowrl"),
        PREFECT_HOME=str(home / "prefect"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        RAY_USAGE_STATS_ENABLED="0",
        PREFECT_LOGGING_LEVEL="WARNING",
    )


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def start_engines() -> dict[str, float]:
    """Start the ephemeral Prefect API and the MLflow store before the flow, each timed alone."""
    from prefect.client.orchestration import get_client

    from flowrl.infra import tracking
    from flowrl.infra.settings import get_settings

    def hello() -> None:
        with get_client(sync_client=True) as client:  # starts the ephemeral server
            client.hello()

    get_settings().apply_to_environment()
    _, prefect_s = timed(hello)
    _, mlflow_s = timed(lambda: tracking.client().search_experiments())
    return {"Prefect API start (ephemeral, fresh DB)": prefect_s, "MLflow store init": mlflow_s}


def task_runs(flow_run_id: Any, expected: int) -> tuple[Any, dict[str, list[Any]]]:
    """The flow run and its task runs by task name, in start order, once all are recorded."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        for _ in range(120):  # the API records task-run events asynchronously
            runs, page = [], [None]
            while page:  # at most 200 per call
                page = client.read_task_runs(
                    flow_run_filter=flow_filter, offset=len(runs), limit=200
                )
                runs += page
            if len(runs) >= expected and all(r.end_time for r in runs):
                break
            time.sleep(0.5)
        flow = client.read_flow_run(flow_run_id)
    by_name: dict[str, list[Any]] = {}
    for r in sorted(runs, key=lambda r: r.start_time):
        by_name.setdefault(r.name.rsplit("-", 1)[0], []).append(r)
    return flow, by_name


def run_orchestrated(config: Any) -> tuple[Series, dict[str, float]]:
    """Per-step stage times (s) of the real flow, and its one-off costs."""
    from flowrl.flows.rl import rl_train
    from flowrl.infra import tracking

    state, call_s = timed(lambda: rl_train(config, return_state=True))
    run_id = state.result().mlflow_run_id
    flow, runs = task_runs(state.state_details.flow_run_id, 3 * config.schedule.steps + 7)

    def metric(key: str) -> list[float]:
        history = tracking.client().get_metric_history(run_id, key)
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    def seconds(name: str) -> list[float]:
        return [r.total_run_time.total_seconds() for r in runs[name]]

    trios = zip(runs["rollout"], runs["reward"], runs["update"], strict=True)
    steps = {
        "step": metric("time/step_s"),
        "rollout": metric("time/rollout_s"),
        "reward": seconds("reward"),
        "update": metric("time/update_s"),
        "reward/mean": metric("reward/mean"),
        # Pending -> Running of a step's three task runs: Prefect's engine before each body.
        "task start": [
            sum((r.start_time - r.expected_start_time).total_seconds() for r in t) for t in trios
        ],
    }
    first, warm, restore = runs["prepare-model"][0], runs["warmup"][0], runs["restore"][0]
    t0, last = flow.start_time, runs["update"][-1]
    costs = {
        "Ray start + job open (flow start → first task)": first.expected_start_time - t0,
        "tiny base model build": first.total_run_time,
        "warm-up SFT": warm.total_run_time,
        "policy workers start: 2 Ray actors": restore.expected_start_time - warm.end_time,
        "first eval": runs["eval"][0].total_run_time,
        "after the last step (checkpoint, eval, register)": flow.end_time - last.end_time,
    }
    costs = {k: v.total_seconds() for k, v in costs.items()}
    costs["whole flow call (all of the above + steps)"] = call_s
    return steps, costs


def run_plain(config: Any) -> tuple[Series, dict[str, float]]:
    """The same steps with the stages' plain functions and in-process workers (s)."""
    from flowrl.backends.policy.actors import start_policy, stop_policy
    from flowrl.backends.types import WorkerSpec
    from flowrl.infra.settings import get_settings
    from flowrl.tasks.model import prepare_model, warmup
    from flowrl.tasks.rl import evaluate, rollout, score, update
    from flowrl.tasks.types import JobContext

    s, c = get_settings(), config
    ctx = JobContext(c.name, s.storage_root, s.model_cache_dir, f"{c.name}-plain")
    warm = warmup.fn(c, ctx, prepare_model.fn(c, ctx))
    if not warm.cached:
        raise RuntimeError("the flow's warm-up should have been cached and reused")
    uri = warm.model_uri
    spec = WorkerSpec(
        model_uri=uri,
        cache_dir=ctx.cache_dir,
        lora=c.model.lora,
        learning_rate=c.algorithm.learning_rate,
        seed=c.seed,
        max_grad_norm=c.algorithm.max_grad_norm,
        torch_threads=c.resources.torch_threads,
    )
    policy, start_s = timed(lambda: start_policy(ctx.run_name, spec, local=True))
    evaluate.fn(c, ctx, uri, policy)  # as the flow does before step 1
    steps: Series = {k: [] for k in ("rollout", "reward", "update", "step", "reward/mean")}
    cursor = None
    for step in range(c.schedule.steps):
        start = time.perf_counter()
        batch, rollout_s = timed(rollout.fn, c, ctx, uri, policy, step, cursor)
        scored, reward_s = timed(score.fn, c, ctx, policy, batch)
        _, update_s = timed(update.fn, c, ctx, policy, scored)
        cursor = batch.cursor
        steps["rollout"].append(rollout_s)
        steps["reward"].append(reward_s)
        steps["update"].append(update_s)
        steps["step"].append(time.perf_counter() - start)
        steps["reward/mean"].append(scored.metrics["reward/mean"])
    stop_policy(policy)
    return steps, {"policy workers start: in-process": start_s}


def ms_cells(values: list[float]) -> list[float]:
    """[mean, p50, p90] in ms."""
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return [1000 * v for v in (statistics.fmean(values), deciles[4], deciles[8])]


def step_table(plain: Series, orch: Series) -> str:
    for s in (plain, orch):
        in_stages = zip(s["rollout"], s["reward"], s["update"], strict=True)
        s["between"] = [t - sum(x) for t, x in zip(s["step"], in_stages, strict=True)]
    rows = [
        "| ms per step | plain mean | p50 | p90 | Prefect+Ray mean | p50 | p90 | difference |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for key, label in (
        ("rollout", "rollout"),
        ("reward", "reward (score)"),
        ("update", "update (incl. weight sync)"),
        ("between", "between stages"),
        ("step", "**whole step**"),
    ):
        p, o = ms_cells(plain[key]), ms_cells(orch[key])
        rows.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in (*p, *o, o[0] - p[0])) + " |")
    o = ms_cells(orch["task start"])
    rows.append(
        "| ↳ in Prefect task start, Pending→Running (3 tasks) | | | | "
        f"{o[0]:.1f} | {o[1]:.1f} | {o[2]:.1f} | |"
    )
    p_mean, o_mean = statistics.fmean(plain["step"]), statistics.fmean(orch["step"])
    same = sum(a == b for a, b in zip(plain["reward/mean"], orch["reward/mean"], strict=True))
    return "\n".join(rows) + (
        f"\n\n**Overhead ratio (Prefect+Ray step / plain step, means): {o_mean / p_mean:.2f}×; "
        f"absolute overhead {1000 * (o_mean - p_mean):.0f} ms per step.** Same work in both: "
        f"mean reward identical at {same} of {len(plain['step'])} steps.\n"
    )


def one_off_table(costs: dict[str, float]) -> str:
    rows = ["| one-off cost | s |", "|---|--:|"]
    for name, seconds in costs.items():
        rows.append(f"| {name} | {seconds:.2f} |")
    return "\n".join(rows) + "\n"


def report(config: Any, overrides: list[str], tables: list[str], wall_s: float) -> str:
    import prefect
    import ray
    import torch
    import yaml

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    command = shlex.join(["python", *sys.argv])
    bullets = [
        f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; one run of `{command}` ({wall_s:.0f} s)",
        f"machine: {len(os.sched_getaffinity(0))} CPUs (nproc), {cpu}; load average at the end "
        f"{load}. Shared and noisy: compare numbers within this file, not with other runs.",
        f"software: torch {torch.__version__} ({torch.get_num_threads()} thread(s) in this "
        f"process, `resources.torch_threads={config.resources.torch_threads}` per worker), "
        f"prefect {prefect.__version__}, ray {ray.__version__}",
        f"job: the default job with `{' '.join(overrides)}` (full config below)",
        "plain: `rollout.fn`, `score.fn`, `update.fn` in a loop with in-process workers, timed "
        "with `perf_counter`. Prefect+Ray: the `rl_train` flow's `time/*` metrics in MLflow "
        "(reward: its task run's duration in the Prefect API). "
        "Between stages = whole step − the three stages.",
    ]
    title = f"# Time per RL step: plain calls vs Prefect + Ray ({config.schedule.steps} steps)\n\n"
    header = title + "\n".join(f"- {b}" for b in bullets) + "\n"
    config_yaml = yaml.safe_dump(config.model_dump(), sort_keys=False)
    details = f"<details><summary>config</summary>\n\n```yaml\n{config_yaml}```\n</details>\n"
    return "\n".join([header, *tables, details])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="RL steps in each of the two runs.")
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    parser.add_argument("--home", type=Path, help="Empty folder for all state (default: new temp).")
    parser.add_argument("--size", choices=("tiny", "large"), default="tiny")
    args = parser.parse_args()
    start = time.perf_counter()
    home = args.home or Path(tempfile.mkdtemp(prefix="flowrl-bench-"))
    if args.steps < 2:
        parser.error("--steps must be at least 2 (for percentiles)")
    if home.exists() and any(home.iterdir()):
        parser.error(f"--home {home} is not empty: the one-off costs need a cold start")
    set_environment(home)
    from trl_compare import SIZES  # same folder; it imports this module, so only here

    from flowrl.tasks.schemas import load_job

    overrides = [
        *SIZES[args.size].overrides,
        f"schedule.steps={args.steps}",
        f"schedule.eval_every={NEVER}",
        f"schedule.checkpoint_every={NEVER}",
    ]
    config = load_job(None, overrides)
    costs = start_engines()
    orch, flow_costs = run_orchestrated(config)
    plain, plain_costs = run_plain(config)
    tables = [step_table(plain, orch), one_off_table(costs | flow_costs | plain_costs)]
    text = report(config, overrides, tables, time.perf_counter() - start)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(f"state kept in {home}", file=sys.stderr)


if __name__ == "__main__":
    main()
