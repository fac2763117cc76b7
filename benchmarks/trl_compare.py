"""flowrl's GRPO (the real ``rl_train`` flow on Prefect + Ray) against TRL's ``GRPOTrainer``
(no vLLM) on this CPU: same model, prompts, group size, generation length, loss, optimiser and
threads, at two sizes; seconds per step, samples/s, peak memory, held-out accuracy after the
same training wall time, and where flowrl's time goes.

    python benchmarks/trl_compare.py --out docs/benchmarks.md

Each side runs in its own child process, one after the other (the parent samples the memory
of the child's whole process tree: Prefect server, Ray and its actors included). Per size:
flowrl one-step-off (``schedule.off_policy_steps=1``) for ``--steps``; TRL for the same
training wall time (its callback stops it); flowrl on-policy for the same steps; TRL with two
threads when asked (``--trl-threads 1 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from footprint import TreePeak, watch  # same folder: the benchmark scripts share them
from step_time import set_environment

NEVER = "1000000"  # eval and checkpoint intervals that keep both out of the measured steps
PICKED_TAGS = (
    *("sampler_backend", "sampler_backend.why", "torch_threads", "torch_threads.why"),
    *("dtype", "dtype.why"),
)
SKIP = 2  # first steps left out of the steady state (worker processes start in them)


@dataclass(frozen=True)
class Size:
    overrides: tuple[str, ...]
    steps: int
    about: str


SIZES = {
    "tiny": Size(
        (),
        30,
        "the default job: Llama hidden 128 × 2 layers (0.34M parameters), 64 prompts × 8 "
        "samples, ≤ 8 new tokens (answers are 1-3 digits + the stop token)",
    ),
    "large": Size(
        (
            "model.tiny.hidden_size=256",
            "model.tiny.num_layers=4",
            "model.tiny.intermediate_size=688",
            "env.params.answer_width=32",  # answers padded to 32 characters: ~33 tokens each
            "rollout.max_new_tokens=40",
            "rollout.prompts_per_step=16",
            # Padded answers dilute the SFT loss: warm up slower, to a lower start.
            "warmup.learning_rate=0.001",
            "warmup.target_accuracy=0.15",
            "warmup.eval_every=50",
            "algorithm.learning_rate=0.0001",  # 3e-4 shortened the answers within 12 steps
        ),
        30,
        "Llama hidden 256 × 4 layers, MLP 688 (3.19M parameters); SFT answers right-padded with "
        "spaces to 32 characters (`env.params.answer_width=32`; the reward strips them), so "
        "every sample generates ~33 tokens; 16 prompts × 8 samples, ≤ 40 new tokens; RL lr "
        "1e-4; warm-up SFT lr 1e-3 to 15% (padding dilutes its loss)",
    ),
    "huge": Size(
        (
            "model.tiny.hidden_size=768",
            "model.tiny.num_layers=12",
            "model.tiny.num_heads=12",
            "model.tiny.intermediate_size=2560",
            # No warm-up: SFT to any accuracy takes hours at this size on 2 cores. The reward
            # is then 0 for every sample, and so is every advantage: flowrl would skip them all
            # (algorithm.skip_zero_advantage). Both sides run every sample through the loss.
            "warmup.enabled=false",
            "algorithm.skip_zero_advantage=false",
            "env.eval_size=20",
            "rollout.prompts_per_step=4",
            "rollout.max_new_tokens=24",
            "algorithm.learning_rate=0.0001",
        ),
        6,
        "Llama hidden 768 × 12 layers (12 heads), MLP 2560 (99.19M parameters), random "
        "weights (no warm-up: reward 0, advantages 0; every sample still through the loss: "
        "`algorithm.skip_zero_advantage=false`); "
        "4 prompts × 8 samples, ≤ 24 new tokens; 20 held-out problems",
    ),
}
DEFAULT_SIZES = ("tiny", "large")


def job_config(size: str, overrides: list[str]) -> Any:
    from flowrl.tasks.schemas import load_job

    return load_job(None, [*SIZES[size].overrides, *overrides])


# --------------------------------------------------------------------------- flowrl side


def flowrl_side(size: str, steps: int, ahead: int, extra: list[str]) -> dict[str, Any]:
    """The ``rl_train`` flow in this process, its engines booted as ``flowrl train`` boots
    them (``flows.engines.start_engines``: Prefect's temporary API in a thread of this
    process, Ray beside it, while the flow imports); stage times from its MLflow metrics."""
    started = time.perf_counter()
    from flowrl.infra.settings import get_settings

    get_settings().apply_to_environment()
    from flowrl.flows.engines import start_engines

    engines_ready = start_engines()
    from flowrl.flows.rl import rl_train
    from flowrl.infra import tracking
    from flowrl.tasks.model import prepare_model, warmup
    from flowrl.tasks.types import JobContext

    name = f"bench-{size}-{'off' if ahead else 'on'}"
    config = job_config(
        size,
        [f"name={name}", f"schedule.steps={steps}"]
        + [
            f"schedule.off_policy_steps={ahead}",
            f"schedule.eval_every={NEVER}",
            f"schedule.checkpoint_every={NEVER}",
            *extra,
        ],
    )
    s = get_settings()
    imported = time.perf_counter()
    engines_ready()
    api_up = time.perf_counter()
    state = rl_train(config, return_state=True)
    flow_s = time.perf_counter() - api_up
    result = state.result()
    start_up = startup_split(state.state_details.flow_run_id)

    def series(key: str) -> list[float]:
        history = tracking.client().get_metric_history(result.mlflow_run_id, key)
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    keys = ("step", "rollout", "reward", "train", "update", "sync", "rollout_ahead", "overhead")
    times = {k: series(f"time/{k}_s") for k in keys}
    ctx = JobContext(config.name, s.storage_root, s.model_cache_dir, "bench")
    warm = warmup.fn(config, ctx, prepare_model.fn(config, ctx))  # cached: a lookup
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    profile = {k: statistics.fmean(v[SKIP:]) for k, v in times.items() if v[SKIP:]}
    # The first steps start Ray worker processes (a second one once two stages overlap): a
    # one-off cost, left out of the training time TRL is given.
    cold_s = max(0.0, sum(times["step"][:SKIP]) - SKIP * profile["step"])
    tags = tracking.client().get_run(result.mlflow_run_id).data.tags
    before_step = (imported - started) + (api_up - imported) + sum(start_up.values())
    return {
        "picked": {k: tags.get(k, "") for k in PICKED_TAGS},
        "first_step_s": before_step + times["step"][0],
        "steps": steps,
        "step_s": times["step"],
        "loop_s": sum(times["step"]),
        "train_s": sum(times["step"]) - cold_s,
        "profile": profile,
        "tokens_per_sample": statistics.fmean(series("rollout/sampled_tokens")[SKIP:]) / samples,
        "reward": series("reward/mean"),
        "zero_advantage_rows": series("train/zero_advantage_rows"),
        "staleness": series("train/staleness"),
        "accuracy_start": result.accuracy_start,
        "accuracy_end": result.accuracy_end,
        "one_off": {
            "imports": imported - started,
            "engines up (Prefect API, Ray, MLflow store)": api_up - imported,
            **start_up,
            "rest of the flow outside the steps (final eval, register, finish)": flow_s
            - sum(times["step"])
            - sum(start_up.values()),
            f"first {SKIP} steps beyond the steady state": cold_s,
        },
        "warm_model": warm.model_uri,
    }


def startup_split(flow_run_id: Any) -> dict[str, float]:
    """Seconds from the flow run's start to its first RL step, by phase, from the task runs
    Prefect recorded: Ray and the MLflow run (before the first task), model and warm-up
    (cached: a lookup), the policy's actors starting (warm-up end → restore), restore and the
    first eval."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        runs = client.read_task_runs(  # the first ones: start-up and the first step
            flow_run_filter=flow_filter, sort=TaskRunSort.EXPECTED_START_TIME_ASC, limit=50
        )
    runs = sorted((r for r in runs if r.start_time and r.end_time), key=lambda r: r.start_time)

    def first(prefix: str) -> Any:
        return next(r for r in runs if r.name.startswith(prefix))

    prepare, warm, restore = first("prepare-model"), first("warmup"), first("restore")
    evaluation, rollout = first("eval"), first("rollout")
    return {
        "flow start → first task (Ray start, MLflow run, GPU slots)": (
            prepare.start_time - flow_run.start_time
        ).total_seconds(),
        "prepare-model + warm-up (SFT, or its cache)": (
            warm.end_time - prepare.start_time
        ).total_seconds(),
        "policy actors start": (restore.start_time - warm.end_time).total_seconds(),
        "restore + first eval": (evaluation.end_time - restore.start_time).total_seconds(),
        "first eval → first rollout starts": (
            rollout.start_time - evaluation.end_time
        ).total_seconds(),
    }


# ------------------------------------------------------------------------------ TRL side


def trl_side(
    size: str,
    seconds: float,
    threads: int,
    warm_model: str,
    overrides: list[str] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """TRL's GRPOTrainer from the same warm model for ``seconds`` of training (with
    ``model.lora.enabled`` among ``overrides``: a PEFT LoRA adapter of the job's shape)."""
    started = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.backends.models.cpu_kernels import cpu_bf16, pick_cpu_dtype
    from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer, weight_count
    from flowrl.backends.models.model_uri import resolve_model_uri
    from flowrl.backends.policy.actors import start_policy, stop_policy
    from flowrl.backends.types import WorkerSpec
    from flowrl.infra.settings import get_settings
    from flowrl.tasks.chat_formats import chat_format
    from flowrl.tasks.episodes import evaluate_policy

    config = job_config(size, overrides or [])
    if seed is not None:
        config = config.model_copy(update={"seed": seed})
    cache = get_settings().model_cache_dir
    path = resolve_model_uri(warm_model, cache)
    task, r, alg = config.env.task(), config.rollout, config.algorithm
    # The precision flowrl's job computes in (resources.dtype; a CPU job's auto picks bf16 for
    # a large model on a CPU with bf16 dot products): the same on both sides. TRL's own
    # default is bf16 autocast.
    dtype = config.resources.dtype
    if dtype == "auto":
        dtype = pick_cpu_dtype(weight_count(path), cpu_bf16())[0]
    # The flow's data stream in the flow's order: problem(0), problem(1), ...
    rows = [task.problem(i) for i in range(r.prompts_per_step * 400)]
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": x["question"]}], "answer": x["answer"]}
            for x in rows
        ]
    )

    def exact_match(completions: list, answer: list[str], **_: Any) -> list[float]:
        """The arithmetic environment's reward: 1 iff the stripped answer is exactly right."""
        return [
            float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)
        ]

    class WallBudget(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.last = now
            control.should_training_stop = now - self.begin >= seconds

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    out_dir = tempfile.mkdtemp(prefix="trl-")
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=r.prompts_per_step * r.group_size,  # one step = one batch
        gradient_accumulation_steps=1,
        num_generations=r.group_size,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        shuffle_dataset=False,
        learning_rate=alg.learning_rate,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused",  # TRL's default on torch >= 2.8, and flowrl's AdamW
        weight_decay=0.0,
        max_grad_norm=alg.max_grad_norm,
        beta=0.0,
        epsilon=alg.clip_eps,
        loss_type="dapo",  # = flowrl's token-mean
        scale_rewards="group",  # = flowrl's grpo advantages
        num_iterations=1,
        max_steps=400,
        use_cpu=True,
        bf16=dtype == "bfloat16",
        use_vllm=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=config.seed,
    )
    model = load_causal_lm(path).train()
    budget = WallBudget()
    lora = config.model.lora
    peft = None
    if lora.enabled:
        from peft import LoraConfig

        peft = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(path),
        callbacks=[budget],
        peft_config=peft,
    )
    generate_s: list[float] = []
    generate = trainer._generate_single_turn

    def timed_generate(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generate_s.append(time.perf_counter() - t0)

    trainer._generate_single_turn = timed_generate
    ready = time.perf_counter()
    trainer.train()
    trained = trainer.model.merge_and_unload() if peft is not None else trainer.model
    trained.save_pretrained(out_dir)
    trainer.processing_class.save_pretrained(out_dir)
    policy = start_policy("trl-eval", WorkerSpec(model_uri=out_dir, cache_dir=cache), local=True)
    try:  # the flow's own eval code on the flow's held-out set
        acc = evaluate_policy(
            task,
            policy,
            chat_format(out_dir, cache, config.model),
            config.rollout.limits(greedy=True),
        )
    finally:
        stop_policy(policy)
    steps = budget.step_s
    logs = [x for x in budget.logs if "reward" in x]
    return {
        "dtype": dtype,
        "steps": len(steps),
        "step_s": steps,
        "loop_s": sum(steps),
        "train_s": sum(steps),
        "profile": {
            "step": statistics.fmean(steps[SKIP:]),
            "generate": statistics.fmean(generate_s[SKIP : len(steps)]),
        },
        "tokens_per_sample": statistics.fmean(x["completions/mean_length"] for x in logs[SKIP:]),
        "reward": [x["reward"] for x in logs],
        "accuracy_end": acc.accuracy,
        "one_off": {"imports, model load, trainer init": ready - started},
        "first_step_s": ready - started + steps[0],
    }


# ------------------------------------------------------------------------- parent: runs


def run_child(label: str, argv: list[str], home: Path, script: str = __file__) -> dict[str, Any]:
    """``script`` (default: this one) as a child with ``argv``; its result and the peak
    memory of its whole process tree."""
    out = home / f"{label}.json"
    log = home / f"{label}.log"
    cmd = [sys.executable, script, *argv, "--home", str(home), "--result", str(out)]
    print(f"[{datetime.now():%H:%M:%S}] {label}: {shlex.join(cmd[1:])}", file=sys.stderr)
    start = time.perf_counter()
    peak, stop = TreePeak(), threading.Event()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=watch, args=(proc.pid, peak, stop), daemon=True)
        watcher.start()
        code = proc.wait()
        stop.set()
        watcher.join()
    if code != 0:
        raise RuntimeError(f"{label} failed with exit code {code}; see {log}")
    result = json.loads(out.read_text())
    result |= {"peak_pss_mb": peak.pss, "peak_rss_mb": peak.rss, "memory_split": peak.split}
    result |= {"processes": peak.processes, "wall_s": time.perf_counter() - start}
    print(f"    {label}: {json.dumps(_brief(result))}", file=sys.stderr)
    return result


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("steps", "loop_s", "accuracy_end", "peak_pss_mb", "wall_s")
    return {k: round(v, 3) if isinstance(v := result[k], float) else v for k in keys if k in result}


def run_size(
    size: str, steps: int, trl_threads: list[int], home: Path, flowrl_set: list[str]
) -> dict[str, Any]:
    extra = [a for o in flowrl_set for a in ("--flowrl-set", o)]
    runs = {
        "flowrl": run_child(
            f"{size}-flowrl",
            ["--side", "flowrl", "--size", size, "--steps", str(steps), *extra],
            home,
        )
    }
    budget, warm = runs["flowrl"]["train_s"], runs["flowrl"]["warm_model"]
    for threads in trl_threads:
        runs[f"trl-{threads}t"] = run_child(
            f"{size}-trl-{threads}t",
            [
                "--side",
                "trl",
                "--size",
                size,
                "--seconds",
                f"{budget:.3f}",
                "--threads",
                str(threads),
                "--warm-model",
                warm,
            ],
            home,
        )
    runs["flowrl-onpolicy"] = run_child(
        f"{size}-flowrl-onpolicy",
        ["--side", "flowrl-onpolicy", "--size", size, "--steps", str(steps)],
        home,
    )
    return runs


# ------------------------------------------------------------------------- parent: report


def samples_per_step(size: str) -> int:
    r = job_config(size, []).rollout
    return r.prompts_per_step * r.group_size


def steady(result: dict[str, Any]) -> float:
    return result["profile"]["step"]


def results_table(all_runs: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| size | side | steps (training time) | s/step | samples/s | tokens/sample | tokens/s | "
        "peak memory PSS (RSS), MB | processes | held-out accuracy: start → end | one-off, s |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size, runs in all_runs.items():
        n = samples_per_step(size)
        start = runs["flowrl"]["accuracy_start"]
        for side, r in runs.items():
            one_off = sum(r["one_off"].values())
            rows.append(
                f"| {size} | {side} | {r['steps']} ({r['train_s']:.0f} s) | {steady(r):.2f} | "
                f"{n / steady(r):.0f} | {r['tokens_per_sample']:.1f} | "
                f"{n * r['tokens_per_sample'] / steady(r):.0f} | {r['peak_pss_mb']:.0f} "
                f"({r['peak_rss_mb']:.0f}) | {r['processes']} | {start:.3f} → "
                f"{r['accuracy_end']:.3f} | {one_off:.1f} |"
            )
    return "\n".join(rows) + "\n"


def ratio_lines(all_runs: dict[str, dict[str, Any]]) -> str:
    lines = []
    for size, runs in all_runs.items():
        ours = runs["flowrl"]
        parts = [
            f"{steady(r) / steady(ours):.2f}× TRL with {side.split('-')[1][:-1]} thread(s)"
            f" (tokens/s: {_tokens_ratio(ours, r):.2f}×)"
            for side, r in runs.items()
            if side.startswith("trl-")
        ]
        on = runs["flowrl-onpolicy"]
        lines.append(
            f"- **{size}: flowrl (one-step-off) samples/s = {', '.join(parts)}**; "
            f"{steady(on) / steady(ours):.2f}× flowrl on-policy (tokens/s: "
            f"{_tokens_ratio(ours, on):.2f}×)."
        )
    return "\n".join(lines) + "\n"


def _tokens_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Sampled tokens/s of ``a`` over ``b``: samples/s corrected for answer length."""
    return (a["tokens_per_sample"] / steady(a)) / (b["tokens_per_sample"] / steady(b))


def profile_table(all_runs: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| size | flowrl | step | rollout | reward | update | ↳ train (fwd+bwd+AdamW) | ↳ sync "
        "| critical path | orchestration (step − critical path) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size, runs in all_runs.items():
        for side in ("flowrl", "flowrl-onpolicy"):
            p = runs[side]["profile"]
            if side == "flowrl":  # the next rollout runs alongside reward + update
                path = max(p["rollout_ahead"], p["reward"] + p["update"]) + p["sync"]
            else:
                path = p["rollout"] + p["reward"] + p["update"]
            cells = [p[k] for k in ("step", "rollout", "reward", "update", "train", "sync")]
            cells += [path, p["step"] - path]
            name = "one-step-off" if side == "flowrl" else "on-policy"
            share = f" ({(p['step'] - path) / p['step']:.0%} of the step)"
            rows.append(
                f"| {size} | {name} | " + " | ".join(f"{c:.3f}" for c in cells) + share + " |"
            )
    return "\n".join(rows) + "\n"


def trl_profile_lines(all_runs: dict[str, dict[str, Any]]) -> str:
    lines = []
    for size, runs in all_runs.items():
        for side, r in runs.items():
            if not side.startswith("trl-"):
                continue
            step, gen = r["profile"]["step"], r["profile"]["generate"]
            bound = step / max(gen, step - gen)
            lines.append(
                f"- {size}, {side}: {step:.3f} s/step = generate {gen:.3f} s + the rest (reward, "
                f"log-probs, loss, backward, AdamW) {step - gen:.3f} s. Two stages on two cores "
                f"overlap to at best max(generate, rest): **{bound:.2f}×** this step."
            )
    return "\n".join(lines) + "\n"


def _critical_path(p: dict[str, float]) -> float:
    return max(p["rollout_ahead"], p["reward"] + p["update"]) + p["sync"]


def analysis(all_runs: dict[str, dict[str, Any]]) -> str:
    """The numbers behind the verdict, as sentences (the same run's numbers)."""
    out = []
    for size, runs in all_runs.items():
        off, on = runs["flowrl"], runs["flowrl-onpolicy"]
        side = "trl-2t" if "trl-2t" in runs else next(s for s in runs if s.startswith("trl-"))
        trl = runs[side]
        p, q, t = off["profile"], on["profile"], trl["profile"]
        ratio = steady(trl) / steady(off)
        gen, rest = t["generate"], t["step"] - t["generate"]
        path = _critical_path(p)
        verdict = "met" if ratio >= 1 else "**not met**"
        out.append(
            f"**{size}**: flowrl one-step-off makes {ratio:.2f}× the samples/s of {side} "
            f"(target 1.0× TRL with 2 threads: {verdict}).\n\n"
            f"- {side}'s step: generate {gen:.2f} s + the rest {rest:.2f} s "
            f"(reward, log-probs, loss, backward, AdamW), one after the other on both cores.\n"
            f"- flowrl's step, {p['step']:.2f} s = critical path {path:.2f} s (max(rollout "
            f"sampled ahead {p['rollout_ahead']:.2f}, reward {p['reward']:.2f} + update "
            f"{p['update']:.2f}) + sync {p['sync']:.2f}) + orchestration "
            f"{p['step'] - path:.2f} s (task runs, actor calls, metrics).\n"
            f"- The rollout and the update overlap on the two cores: the rollout took "
            f"{p['rollout_ahead']:.2f} s sampled ahead against {q['rollout']:.2f} s alone "
            f"(on-policy), training {p['train']:.2f} s against {q['train']:.2f} s.\n"
            f"- Against flowrl on-policy ({q['step']:.2f} s/step) one-step-off is "
            f"{q['step'] / p['step']:.2f}× faster; on-policy flowrl against {side}: "
            f"{steady(trl) / q['step']:.2f}×.\n"
        )
    return "\n".join(out)


def memory_table(all_runs: dict[str, dict[str, Any]]) -> str:
    """Each side's peak PSS split by process kind (at the peak sample)."""
    rows = ["| size | side | process | count | PSS, MB |", "|---|---|---|--:|--:|"]
    for size, runs in all_runs.items():
        for side, r in runs.items():
            split = sorted(r["memory_split"].items(), key=lambda kv: -kv[1][1])
            for name, (count, mb) in split:
                rows.append(f"| {size} | {side} | {name} | {count} | {mb:.0f} |")
    return "\n".join(rows) + "\n"


def one_off_table(all_runs: dict[str, dict[str, Any]]) -> str:
    rows = ["| size | side | one-off cost | s |", "|---|---|---|--:|"]
    for size, runs in all_runs.items():
        for side, r in runs.items():
            for name, seconds in r["one_off"].items():
                rows.append(f"| {size} | {side} | {name} | {seconds:.1f} |")
    return "\n".join(rows) + "\n"


def report(
    all_runs: dict[str, dict[str, Any]], wall_s: float, loads: list[str], flowrl_set: list[str]
) -> str:
    import torch
    import transformers
    import trl

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    versions = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    )
    import prefect
    import ray

    versions += f", prefect {prefect.__version__}, ray {ray.__version__}"
    command = shlex.join(["python", *sys.argv])
    sizes = "\n".join(f"  - {name}: {SIZES[name].about}" for name in all_runs)
    flowrl_options = ", ".join(f"`{o}`" for o in flowrl_set) or "the defaults"
    return f"""# flowrl against TRL's GRPOTrainer on CPU

- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; one run of `{command}` ({wall_s / 60:.1f} min)
- machine: {len(os.sched_getaffinity(0))} CPUs (nproc), {cpu}, no GPU; load average (1/5/15
  min) at the start {loads[0]}, at the end {loads[1]}. Shared with other engineers' jobs: compare
  numbers within this file, not with other runs.
- software: {versions}
- sizes:
{sizes}
- both sides: the same warm model (flowrl's cached SFT warm-up, to 30% held-out accuracy at the
  tiny size, 15% at the large), the same training prompts in the same order
  (`ArithmeticTask.problem(0), (1), …`), 8 samples per prompt, temperature 1, the same
  exact-match reward, GRPO advantages (group std, unbiased), PPO-clip ε = 0.2 with token-mean
  aggregation (TRL `loss_type="dapo"`), no KL, AdamW (TRL: fused, its default; flowrl: fused
  from 10M parameters; constant lr: 3e-4 tiny, 1e-4 large),
  grad-norm clip 1.0, one optimiser step per batch. torch threads: TRL 1 or 2 (both cores) as
  listed; flowrl's sampler actor 1, its trainer actor `resources.trainer_threads` (default: 1).
- flowrl one-step-off's options for this run: {flowrl_options}; flowrl on-policy runs the
  size's job as it is (at the tiny size: the default job). flowrl's trainer runs a prompt its rows
  repeat (a GRPO group's) once and copies its KV cache to the rows: the same loss and
  gradients (`tests/test_workers.py`) from fewer tokens, and leaves rows of advantage 0 (a group
  whose samples all scored the same) out of its passes (`algorithm.skip_zero_advantage`: their
  gradient is 0); TRL runs every row in full.
- flowrl: the real `rl_train` flow (Prefect task runs in the flow process calling the Ray
  actors that hold the weights, MLflow),
  `schedule.off_policy_steps=1` unless marked on-policy. s/step: mean of the flow's
  `time/step_s` after the first {SKIP} steps (its Ray workers start there). TRL: `GRPOTrainer`
  (`use_cpu=True, use_vllm=False`), s/step between `on_step_end` callbacks, same warm-up skip.
- "same wall time": TRL trains (its callback stops it) for as long as flowrl one-step-off took
  for its steps, less the cold start of its first steps (Ray worker processes starting: listed
  with the one-off costs, as TRL's set-up is); flowrl on-policy runs the same number of steps
  as one-step-off, in its own time. The steps column gives each side's steps and training
  time. Held-out accuracy: greedy exact match on the environment's 200 held-out
  problems, by the flow's eval code for every side (TRL's model saved and loaded into it).
- peak memory: summed over the side's whole process tree (flowrl: driver, Prefect API server,
  Ray's processes and actors), sampled every 0.5 s; PSS counts shared pages once.

## Results

{results_table(all_runs)}
{ratio_lines(all_runs)}
## Where flowrl's time goes (s per step, steady state)

Stage times are the task bodies as the flow logs them (`time/rollout_s`, `time/reward_s`,
`time/update_s`, `time/train_s`, `time/sync_s`); one-step-off's rollout column is the batch's own
rollout, which ran during the previous step, and its critical path is
max(rollout sampled ahead, reward + update) + sync. Orchestration is the rest: Prefect task
run start/finish, actor calls, result passing, MLflow logging in the flow.

{profile_table(all_runs)}
TRL's step, split by timing its generation call:

{trl_profile_lines(all_runs)}
## Analysis

{analysis(all_runs)}
Held-out accuracy is measured once per side on 200 problems (one binomial standard error is
about ±3 points at these accuracies), after a few dozen steps: differences of a few points are
noise, not a verdict on the algorithms.

## Peak memory by process (PSS at each side's peak)

{memory_table(all_runs)}
## One-off costs (not in s/step)

flowrl's start-up is split by the task runs Prefect recorded for the flow run.

{one_off_table(all_runs)}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), choices=list(SIZES))
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        help="flowrl steps per size (default: "
        + ", ".join(f"{k} {SIZES[k].steps}" for k in DEFAULT_SIZES)
        + ")",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="TRL's torch threads, one run each (default 1 and 2: 2 uses both cores).",
    )
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    parser.add_argument("--home", type=Path, help="Folder for all state (default: new temp).")
    parser.add_argument(
        "--flowrl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for flowrl's one-step-off side (its best mode), after the "
        "size's own (repeatable); the on-policy side runs the size's job as it is.",
    )
    # Child-process arguments (one side of one size), set by the parent:
    parser.add_argument("--side", choices=["flowrl", "flowrl-onpolicy", "trl"])
    parser.add_argument("--size", choices=list(SIZES))
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warm-model")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--trl-seed", type=int, help="the TRL side's seed (default: the job's)")
    parser.add_argument("--result", type=Path)
    args = parser.parse_args()
    if args.side is None and args.home is not None:
        # Every run measures fresh steps: a used home would resume its finished jobs and
        # report their old figures as new.
        if args.home.exists() and any(args.home.iterdir()):
            parser.error(f"--home {args.home} is not empty: give a new or empty folder")
        args.home.mkdir(parents=True, exist_ok=True)
    home = args.home or Path(tempfile.mkdtemp(prefix="flowrl-trl-"))
    set_environment(home)
    # A busy machine can take longer than Prefect's default 20 s to start its ephemeral API.
    os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    if args.side is not None:
        steps = (args.steps or [SIZES[args.size].steps])[0]
        if args.side == "trl":
            result = trl_side(
                args.size,
                args.seconds,
                args.threads,
                args.warm_model,
                args.trl_set,
                args.trl_seed,
            )
        else:
            result = flowrl_side(
                args.size, steps, ahead=int(args.side == "flowrl"), extra=args.flowrl_set
            )
        args.result.write_text(json.dumps(result))
        return
    start = time.perf_counter()
    loads = [" / ".join(f"{x:.1f}" for x in os.getloadavg())]
    steps = args.steps or [SIZES[s].steps for s in args.sizes]
    if len(steps) != len(args.sizes):
        parser.error("--steps needs one value per size")
    args.trl_threads = sorted(set(args.trl_threads))
    all_runs = {
        s: run_size(s, n, args.trl_threads, home, args.flowrl_set)
        for s, n in zip(args.sizes, steps, strict=True)
    }
    (home / "results.json").write_text(json.dumps(all_runs))
    loads.append(" / ".join(f"{x:.1f}" for x in os.getloadavg()))
    text = report(all_runs, time.perf_counter() - start, loads, args.flowrl_set)
    print(text)
    if args.out:
        args.out.write_text(text)
    print(f"state kept in {home}", file=sys.stderr)


if __name__ == "__main__":
    main()
