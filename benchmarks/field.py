"""The field in one run: flowrl with its defaults, flowrl on each sampler engine and one step
off, and TRL's ``GRPOTrainer`` with 2 threads, at three sizes; then an agent through the OpenAI
endpoint against the built-in environment loop. Samples/s, ratios, peak PSS of each side's
whole process tree and first-step latency, on this machine, in one process tree.

    python benchmarks/field.py --out docs/benchmarks/field.md     # = make bench

Every side is a child process of this one (``trl_compare.run_child``: its tree's peak memory
sampled from here), one after the other. Per size (``trl_compare.SIZES``: tiny, large ~3M,
huge ~100M):

- ``flowrl defaults``: the size's job as it is: on-policy, ``resources.sampler_backend: auto``,
  ``resources.torch_threads: auto`` (what they picked is in the table);
- ``flowrl <engine>``: the same job on the engine auto did not pick;
- ``flowrl one-step-off``: the defaults with ``schedule.off_policy_steps=1``;
- ``trl-2t``: TRL (2 torch threads: both cores), for the defaults' training wall time, from
  the same warm model.

Then ``benchmarks/agent_path.py``'s two sides (built-in loop, openai-SDK agent) at tiny and ~3M.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import agent_path  # same folder: the benchmark scripts share them
import trl_compare
from step_time import set_environment

HERE = Path(__file__).resolve().parent
SIZE_NAMES = {"tiny": "tiny (0.34M)", "large": "~3M (3.19M)", "huge": "~100M (99.19M)"}
AGENT_SIZES = {"tiny": "tiny", "large": "large"}  # agent_path's names for the same models
TRL_THREADS = 2


def flowrl(size: str, label: str, steps: int, home: Path, sets: list[str], ahead: bool) -> dict:
    side = "flowrl" if ahead else "flowrl-onpolicy"
    argv = ["--side", side, "--size", size, "--steps", str(steps)]
    sets = [f"name=field-{size}-{label}", *sets]  # one home: each side a job of its own
    argv += [a for o in sets for a in ("--flowrl-set", o)]
    return trl_compare.run_child(f"{size}-{label}", argv, home)


def run_size(size: str, steps: int, home: Path, vllm: bool) -> dict[str, dict[str, Any]]:
    """The four sides of one size (three where vLLM's venv is missing: the engine auto did not
    pick is then hf's other, which cannot run)."""
    # The model's build and its warm-up SFT, cached for every side after it: not in any
    # side's first-step latency.
    flowrl(size, "prepare", trl_compare.SKIP + 1, home, [], ahead=False)
    runs = {"flowrl defaults": flowrl(size, "defaults", steps, home, [], ahead=False)}
    picked = runs["flowrl defaults"]["picked"]["sampler_backend"]
    other = "vllm" if picked == "hf" else "hf"
    if other == "hf" or vllm:
        runs[f"flowrl {other}"] = flowrl(
            size, other, steps, home, [f"resources.sampler_backend={other}"], ahead=False
        )
        runs[f"flowrl {other}"]["picked"]["sampler_backend"] = other  # set, not picked
    runs["flowrl one-step-off"] = flowrl(size, "one-step-off", steps, home, [], ahead=True)
    defaults = runs["flowrl defaults"]
    argv = ["--side", "trl", "--size", size, "--seconds", f"{defaults['train_s']:.3f}"]
    argv += ["--threads", str(TRL_THREADS), "--warm-model", defaults["warm_model"]]
    runs[f"trl-{TRL_THREADS}t"] = trl_compare.run_child(f"{size}-trl", argv, home)
    return runs


def run_agents(size: str, steps: int, home: Path) -> dict[str, dict[str, Any]]:
    script = str(HERE / "agent_path.py")
    runs = {}
    for side in agent_path.SIDES:
        argv = ["--side", side, "--size", AGENT_SIZES[size], "--steps", str(steps)]
        runs[side] = trl_compare.run_child(f"agent-{size}-{side}", argv, home, script=script)
    return runs


# ------------------------------------------------------------------------------- report


def samples_per_s(size: str, run: dict[str, Any]) -> float:
    return trl_compare.samples_per_step(size) / run["profile"]["step"]


def field_table(sizes: dict[str, dict[str, dict[str, Any]]]) -> str:
    rows = [
        "| size | side | sampler, dtype, threads (sampler/trainer) | s/step | samples/s "
        "| tokens/sample | ÷ TRL-2t samples/s | peak PSS, MB | ÷ TRL-2t PSS | first step done, s |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size, runs in sizes.items():
        trl = runs[f"trl-{TRL_THREADS}t"]
        for side, r in runs.items():
            picked = r.get("picked")
            how = f"torch, {r.get('dtype', '?')}, 2 threads" if picked is None else _picked(picked)
            rows.append(
                f"| {SIZE_NAMES[size]} | {side} | {how} | {r['profile']['step']:.2f} | "
                f"{samples_per_s(size, r):.1f} | {r['tokens_per_sample']:.1f} | "
                f"**{samples_per_s(size, r) / samples_per_s(size, trl):.2f}×** | "
                f"{r['peak_pss_mb']:.0f} | {r['peak_pss_mb'] / trl['peak_pss_mb']:.2f}× | "
                f"{r['first_step_s']:.1f} |"
            )
    return "\n".join(rows) + "\n"


def _picked(picked: dict[str, str]) -> str:
    threads = picked["torch_threads"].replace("sampler ", "").replace(", trainer ", "/")
    return f"{picked['sampler_backend']}, {picked.get('dtype') or '?'}, {threads or '?'}"


def split_lines(sizes: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Where each flowrl side's step goes (the flow's own stage times) and TRL's."""
    lines = []
    for size, runs in sizes.items():
        for side, r in runs.items():
            p = r["profile"]
            if side.startswith("trl"):
                gen = p["generate"]
                lines.append(
                    f"- {SIZE_NAMES[size]}, {side}: {p['step']:.2f} s = generate {gen:.2f} + "
                    f"the rest (log-probs, loss, backward, AdamW) {p['step'] - gen:.2f}"
                )
                continue
            rollout = p["rollout_ahead"] if "rollout_ahead" in p else p["rollout"]
            zero = r.get("zero_advantage_rows", [])[trl_compare.SKIP :]
            skipped = (
                f"; rows of advantage 0, not run: {statistics.fmean(zero):.0%}" if zero else ""
            )
            lines.append(
                f"- {SIZE_NAMES[size]}, {side}: {p['step']:.2f} s; rollout {rollout:.2f}"
                f"{' (sampled during the previous update)' if 'one-step' in side else ''}, "
                f"reward {p['reward']:.2f}, update {p['update']:.2f} (of it fwd+bwd+AdamW "
                f"{p['train']:.2f}, weight sync {p['sync']:.2f}{skipped})"
            )
    return "\n".join(lines) + "\n"


def memory_lines(sizes: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = []
    for size, runs in sizes.items():
        for side, r in runs.items():
            split = sorted(r["memory_split"].items(), key=lambda kv: -kv[1][1])
            parts = ", ".join(f"{name} {mb:.0f}" for name, (_, mb) in split if mb >= 20)
            lines.append(f"- {SIZE_NAMES[size]}, {side} ({r['peak_pss_mb']:.0f} MB): {parts}")
    return "\n".join(lines) + "\n"


def why_lines(sizes: dict[str, dict[str, dict[str, Any]]]) -> str:
    seen = {}
    for size, runs in sizes.items():
        picked = runs["flowrl defaults"]["picked"]
        seen[size] = (
            f"- {SIZE_NAMES[size]}: sampler {picked['sampler_backend']} "
            f"({picked['sampler_backend.why']}); threads {picked['torch_threads']} "
            f"({picked['torch_threads.why']}); dtype {picked.get('dtype')} "
            f"({picked.get('dtype.why')})"
        )
    return "\n".join(seen.values()) + "\n"


def agent_table(agents: dict[str, dict[str, dict[str, Any]]]) -> str:
    steady = agent_path.steady
    rows = [
        "| size | side | s/step | rollout s | update s | reward (mean of all steps) | "
        "agent ÷ built-in s/step | peak PSS, MB |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for size, runs in agents.items():
        base = steady(runs["built-in"]["step_s"])
        for side, r in runs.items():
            ratio = "" if side == "built-in" else f"**{steady(r['step_s']) / base:.2f}×**"
            rows.append(
                f"| {SIZE_NAMES[size]} | {side} | {steady(r['step_s']):.2f} | "
                f"{steady(r['rollout_s']):.2f} | {steady(r['update_s']):.2f} | "
                f"{statistics.fmean(r['reward']):.3f} | {ratio} | {r['peak_pss_mb']:.0f} |"
            )
    return "\n".join(rows) + "\n"


def report(
    sizes: dict[str, dict[str, dict[str, Any]]],
    agents: dict[str, dict[str, dict[str, Any]]],
    wall_s: float,
    loads: list[str],
    agent_steps: int,
) -> str:
    import torch
    import transformers
    import trl

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    about = "\n".join(f"  - {SIZE_NAMES[s]}: {trl_compare.SIZES[s].about}" for s in sizes)
    steps = ", ".join(
        f"{SIZE_NAMES[s]} {runs['flowrl defaults']['steps']}" for s, runs in sizes.items()
    )
    return f"""# The field: flowrl with its defaults against TRL, and the agent path

- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; one run of `{shlex.join(["python", *sys.argv])}`
  ({wall_s / 60:.1f} min), every side a child process of it, one after the other
- machine: {len(os.sched_getaffinity(0))} CPUs, {cpu}, no GPU; load average (1/5/15 min) at the
  start {loads[0]}, at the end {loads[1]}. Compare numbers within this file, not across runs.
- software: torch {torch.__version__}, transformers {transformers.__version__}, trl
  {trl.__version__}; vLLM from `.venv-vllm` (`make setup-vllm`, which `make bench` runs)
- sizes (the arithmetic environment, `benchmarks/trl_compare.py`'s jobs):
{about}
- sides: `flowrl defaults` is the size's job with nothing added: on-policy,
  `resources.sampler_backend: auto`, `resources.torch_threads: auto`, `resources.dtype: auto`
  (bf16 autocast from 50M parameters on a CPU with bf16 dot products, else float32);
  `flowrl hf|vllm` the same
  job on the engine auto did not pick; `flowrl one-step-off` the defaults plus
  `schedule.off_policy_steps=1`; `trl-{TRL_THREADS}t` TRL's `GRPOTrainer` with {TRL_THREADS}
  torch threads (both cores, `use_vllm=False`) in the precision the defaults picked (`bf16=True`,
  TRL's own default, where they picked bf16), from the same warm model, the same prompts in the
  same order, the same loss (PPO-clip, token-mean, no KL) and AdamW (TRL's default, fused;
  flowrl's fused from 10M parameters), trained for the defaults' training wall time. flowrl's
  trainer leaves rows of advantage 0 (a group whose
  samples all scored the same) out of its forward and backward passes
  (`algorithm.skip_zero_advantage`, on by default: their gradient is 0, the update is the same);
  TRL runs every row. The share left out is in the step split below. flowrl steps: {steps};
  s/step: mean after the first {trl_compare.SKIP} steps (TRL: between its step callbacks, after
  as many).
- before each size's sides, one short run of its job builds the model and runs the warm-up SFT
  (cached from then on, as a second job on a machine finds them): no side's figures include them.
- peak PSS: the side's whole process tree (flowrl: the flow's process, the Prefect API, Ray and
  its workers; TRL: its one process), sampled every 0.5 s. First step done: from the side's
  entry (its imports) to the end of its first training step: flowrl's Prefect API start, Ray,
  model, warm-up (cached: a lookup), workers, first eval and step; TRL's imports, model load,
  trainer set-up and first step.

## flowrl against TRL's GRPOTrainer

{field_table(sizes)}
What `auto` picked for the defaults, and why (the job's MLflow tags):

{why_lines(sizes)}
Where each step goes (s per step, steady state; the flow's `time/*_s` metrics, TRL's generate
call timed):

{split_lines(sizes)}
Peak PSS by process (MB, processes of 20 MB or more):

{memory_lines(sizes)}
## The agent path against the built-in loop

`benchmarks/agent_path.py`'s job (tool_math: a product with a calculator tool, 16 prompts × 8
samples a step) with the built-in agent loop and with `examples/agents/calculator_agent.py`, a
plain openai-SDK agent calling the job's rollout endpoint; {agent_steps} steps each, medians
after the first {agent_path.SKIP}, the defaults otherwise.

{agent_table(agents)}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZE_NAMES), choices=list(SIZE_NAMES))
    parser.add_argument("--steps", type=int, nargs="+", help="flowrl steps per size")
    parser.add_argument("--agent-sizes", nargs="*", default=list(AGENT_SIZES))
    parser.add_argument("--agent-steps", type=int, default=8)
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    args = parser.parse_args()
    steps = args.steps or [trl_compare.SIZES[s].steps for s in args.sizes]
    if len(steps) != len(args.sizes):
        parser.error("--steps needs one value per size")
    home = Path(tempfile.mkdtemp(prefix="flowrl-field-"))
    set_environment(home)
    os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    from flowrl.infra.settings import get_settings

    vllm = get_settings().resolved_vllm_python.exists()
    start = time.perf_counter()
    loads = [" / ".join(f"{x:.1f}" for x in os.getloadavg())]
    sizes = {s: run_size(s, n, home, vllm) for s, n in zip(args.sizes, steps, strict=True)}
    (home / "field.json").write_text(json.dumps(sizes))
    agents = {s: run_agents(s, args.agent_steps, home) for s in args.agent_sizes}
    (home / "agents.json").write_text(json.dumps(agents))
    loads.append(" / ".join(f"{x:.1f}" for x in os.getloadavg()))
    text = report(sizes, agents, time.perf_counter() - start, loads, args.agent_steps)
    print(text)
    if args.out:
        args.out.write_text(text)
    print(f"state kept in {home}", file=sys.stderr)


if __name__ == "__main__":
    main()
