"""An agent through the OpenAI endpoint vs the built-in environment loop: time per RL step.

The same task (``tool_math``: a product to compute with a calculator tool), the same model,
warm-up, seeds and rollout budgets; one side plays it with the built-in agent loop
(``env.name: tool_math``), the other with ``examples/agents/calculator_agent.py``, a plain
openai-SDK agent that calls the job's rollout-session endpoint over HTTP
(``env.name: agent:calculator_agent:run``). Both are the ``rl_train`` flow in a child process
of their own, its stage times read back from MLflow; the warm-up is cached, so both start from
the same weights.

    python benchmarks/agent_path.py --sizes tiny large --steps 8 --out docs/benchmarks/agent_path.md

Sizes: ``tiny`` (the example's model, 0.34M parameters) and ``large`` (~3M, as
``benchmarks/trl_compare.py``'s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from step_time import set_environment  # same folder: the benchmark scripts share them
from trl_compare import run_child

NEVER = "1000000"
SKIP = 2  # first steps left out of the steady state (worker processes start in them)
ROOT = Path(__file__).resolve().parent.parent
TASK = {
    "forms": ["a*b"],
    "min_operand": 10,
    "max_operand": 99,
    "max_tool_calls": 2,
    "format_reward": 0.0,
    "eval_size": 20,
}
SIZES = {
    "tiny": (),
    "large": (
        "model.tiny.hidden_size=256",
        "model.tiny.num_layers=4",
        "model.tiny.intermediate_size=688",
        "warmup.learning_rate=0.001",  # at the example's 3e-3 the warm-up reached 0 in 600 steps
    ),
}
EVAL_SIZE = 50  # held-out rows of the warm-up's checks
SIDES = {
    "built-in": {"name": "tool_math", "params": TASK, "eval_size": EVAL_SIZE},
    "agent": {
        "name": "agent:calculator_agent:run",
        "params": {"task": "tool_math", "task_params": TASK, "timeout_s": 60},
        "eval_size": EVAL_SIZE,
    },
}


def job(size: str, side: str, steps: int) -> Any:
    """The job: examples/agents/calculator-agent.yaml's, at ``size``, for ``side``."""
    from flowrl.infra.configfile import read_mapping, validate_config
    from flowrl.tasks.schemas import RLJobConfig

    data = read_mapping(
        ROOT / "examples/agents/calculator-agent.yaml",
        [
            f"name=agent-path-{size}-{side}-{os.getpid()}",  # a fresh job (the warm-up is shared)
            f"schedule.steps={steps}",
            f"schedule.eval_every={NEVER}",
            f"schedule.checkpoint_every={NEVER}",
            *SIZES[size],
        ],
    )
    return validate_config(data | {"env": SIDES[side]}, RLJobConfig)


def child(size: str, side: str, steps: int) -> dict[str, Any]:
    """One side's ``rl_train`` in this process; its per-step metrics from MLflow."""
    from prefect.client.orchestration import get_client

    from flowrl.flows.rl import rl_train
    from flowrl.infra import tracking
    from flowrl.infra.settings import get_settings

    sys.path.insert(0, str(ROOT / "examples" / "agents"))  # the agent's module, as PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "examples" / "agents"), os.environ.get("PYTHONPATH")) if p
    )
    config = job(size, side, steps)
    get_settings().apply_to_environment()
    with get_client(sync_client=True) as client:  # the ephemeral Prefect API
        client.hello()
    result = rl_train(config, return_state=True).result()

    def series(key: str) -> list[float]:
        history = tracking.client().get_metric_history(result.mlflow_run_id, key)
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    return {
        "step_s": series("time/step_s"),
        "rollout_s": series("time/rollout_s"),
        "update_s": series("time/update_s"),
        "reward": series("reward/mean"),
        "tokens": series("rollout/sampled_tokens"),
        "samples": config.rollout.prompts_per_step * config.rollout.group_size,
    }


def steady(values: list[float]) -> float:
    return statistics.median(values[SKIP:]) if values[SKIP:] else float("nan")


def report(runs: dict[tuple[str, str], dict[str, Any]], steps: int) -> str:
    lines = [
        "# The agent path vs the built-in loop",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; `python benchmarks/agent_path.py --steps {steps}`. "
        "Task tool_math (a*b, two-digit operands, a calculator tool, ≤ 3 requests an episode); "
        "16 prompts × 8 samples a step; warm-up SFT to 0.2 (cached, shared by both sides); "
        f"medians of steps {SKIP + 1}..{steps}; reward: the mean over all steps. The two sides "
        "sample the same distribution from different random streams (the built-in loop plays "
        "in the policy's worker with per-episode seeds, the agent's requests are sampled in "
        "lockstep batches), so their rewards agree in mean, not token for token.",
        "",
        "| size | side | s/step | rollout s | update s | tokens/step | reward | agent ÷ built-in |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for size in dict.fromkeys(s for s, _ in runs):
        base = runs.get((size, "built-in"))
        for side in SIDES:
            r = runs.get((size, side))
            if r is None:
                continue
            ratio = steady(r["step_s"]) / steady(base["step_s"]) if base else float("nan")
            reward = statistics.fmean(r["reward"])
            lines.append(
                f"| {size} | {side} | {steady(r['step_s']):.2f} | {steady(r['rollout_s']):.2f} | "
                f"{steady(r['update_s']):.2f} | {steady(r['tokens']):.0f} | {reward:.3f} | "
                f"{'' if side == 'built-in' else f'{ratio:.2f}×'} |"
            )
    lines += ["", "Rewards per step:", ""]
    for (size, side), r in runs.items():
        lines.append(f"- {size} {side}: {', '.join(f'{x:.3f}' for x in r['reward'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "large"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child
        set_environment(args.home)
        args.result.write_text(json.dumps(child(args.size, args.side, args.steps)))
        return
    home = Path(tempfile.mkdtemp(prefix="flowrl-agent-path-"))
    runs = {}
    for size in args.sizes:
        for side in SIDES:
            argv = ["--side", side, "--size", size, "--steps", str(args.steps)]
            runs[size, side] = run_child(f"{size}-{side}", argv, home, script=__file__)
    text = report(runs, args.steps)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
