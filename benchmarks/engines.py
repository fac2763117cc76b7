"""The two sampler engines, HF ``generate`` (``resources.sampler_backend: hf``) and vLLM
(``vllm``, its own venv), on this machine's CPU at three model sizes: time to the first sample,
sampling throughput, and how far each engine's log-probs are from the trainer's.

    python benchmarks/engines.py --out docs/benchmarks/engines.md
    python benchmarks/engines.py --sizes tiny      # a subset

Each size is a random-weight Llama built offline (``build_tiny_model``): ``tiny`` (the default
job's), ``3m`` (``benchmarks/trl_compare.py``'s ``large``) and ``100m`` (hidden 768 × 12
layers). For each size and engine, on one private local Ray started here, one policy
(``start_policy``: a sampler actor of the engine and a torch trainer actor, both
``WorkerSpec(torch_threads=2, dtype="float32")``) is started, measured and stopped before the
next:

- time to first sample: from calling ``start_policy`` to the return of the first ``sample``
  call (one prompt, the size's token count): actor processes, imports, weights, engine start;
- throughput: one warm-up call, then ``--repeats`` timed calls of the size's batch (B distinct
  chat prompts of the arithmetic environment, ~20 tokens) × its new-token count at temperature
  1.0, seed 0 (each call samples the same tokens); samples/s and sampled tokens/s at the
  median call time (a row stops early when it samples the stop token, so tokens are counted,
  not assumed);
- mismatch-KL per token (fp32): the trainer's recomputation (``compute_logprobs``) of the last
  timed call's tokens against the log-probs the engine returned, by ``algorithms.mismatch_kl``
  (the k3 estimate the trainer reports as ``train/mismatch_kl``) over the sampled tokens; and
  the largest absolute log-prob difference of one token.

A size or engine that fails is reported as a row with its error, not left out.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("hf", "vllm")
SEED = 0
THREADS = 2
VLLM_CPU_MAX_SEQS = 256  # vLLM's default max_num_seqs for LLM on CPU; the sampler keeps it


@dataclass(frozen=True)
class Size:
    """A model shape (``TinyModelSpec`` fields) and the batch one timed call samples."""

    model: dict[str, int]
    batch: int
    new_tokens: int
    about: str


SIZES = {
    "tiny": Size({}, 512, 64, "the default job's Llama: hidden 128 × 2 layers, MLP 256"),
    "3m": Size(
        {"hidden_size": 256, "num_layers": 4, "intermediate_size": 688},
        256,
        64,
        "`benchmarks/trl_compare.py`'s `large`: hidden 256 × 4 layers, MLP 688",
    ),
    "100m": Size(
        {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 2560},
        32,
        32,
        "hidden 768 × 12 layers (12 heads), MLP 2560",
    ),
}


@dataclass
class Result:
    """One engine at one size; ``error`` set (and the figures missing) when it failed."""

    size: str
    engine: str
    params: int
    batch: int
    new_tokens: int
    start_s: float | None = None
    first_sample_s: float | None = None
    call_s: list[float] = field(default_factory=list)
    tokens_per_call: int = 0
    mismatch_kl: float | None = None
    max_abs_diff: float | None = None
    sync_s: list[float] = field(default_factory=list)
    error: str | None = None


def set_environment() -> None:
    """Before importing Ray: no usage stats; one thread for this driver, which only waits."""
    os.environ.update(
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )


def build_model(size: str, home: Path) -> tuple[str, int]:
    """The size's random-weight model folder and its parameter count (tied embeddings once)."""
    from safetensors import safe_open

    from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model

    folder = build_tiny_model(TinyModelSpec(**SIZES[size].model), str(home / size))
    params = 0
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return folder, params


def chat_prompts(folder: str, count: int) -> list[list[int]]:
    """``count`` distinct chat prompts of the arithmetic environment (system prompt + one
    3-digit problem: ~20 tokens)."""
    from flowrl.backends.models.chat import HFChatFormat
    from flowrl.environments.arithmetic import ArithmeticTask

    chat = HFChatFormat.from_folder(folder)
    task = ArithmeticTask(
        max_operand=999, max_operand2=999, operators=["+", "-", "*"], system_prompt="Solve it."
    )
    env = task.make_env()
    prompts: dict[tuple[int, ...], None] = {}
    i = 0
    while len(prompts) < count:
        env.reset(**task.problem(i))
        messages = [
            {"role": "system", "content": env.get_system_prompt()},
            {"role": "user", "content": env.get_initial_user_message()},
        ]
        prompts[tuple(chat.encode_prompt(messages))] = None
        i += 1
    return [list(p) for p in prompts]


def mismatch(ref: Any, prompts: list[list[int]], results: list[Any]) -> tuple[float, float]:
    """(mismatch-KL per sampled token, max |trainer − engine| log-prob) of one call's samples."""
    import torch

    from flowrl.backends.engines.algorithms import mismatch_kl
    from flowrl.backends.policy.actors import trainer
    from flowrl.backends.types import Datum

    data = [
        Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens))
        for p, r in zip(prompts, results, strict=True)
    ]
    rows = trainer(ref).compute_logprobs(data, 1.0)
    width = max(len(r.tokens) for r in results)
    trainer_B_T = torch.zeros(len(results), width, dtype=torch.float64)
    sampler_B_T = torch.zeros_like(trainer_B_T)
    mask_B_T = torch.zeros_like(trainer_B_T)
    for i, (p, r, row) in enumerate(zip(prompts, results, rows, strict=True)):
        n = len(r.tokens)
        trainer_B_T[i, :n] = torch.tensor(row[len(p) :], dtype=torch.float64)
        sampler_B_T[i, :n] = torch.tensor(r.logprobs, dtype=torch.float64)
        mask_B_T[i, :n] = 1.0
    kl = float(mismatch_kl(trainer_B_T, sampler_B_T, mask_B_T))
    diff = float(((trainer_B_T - sampler_B_T).abs() * mask_B_T).max())
    return kl, diff


def measure(result: Result, folder: str, prompts: list[list[int]], repeats: int) -> None:
    """Start one policy of ``result``'s engine, fill in ``result``'s figures, stop it."""
    from flowrl.backends.policy.actors import sampler, start_policy, stop_policy, sync_weights
    from flowrl.backends.types import WorkerSpec

    spec = WorkerSpec(
        model_uri=folder,
        cache_dir=str(Path(folder).parent / "cache"),
        seed=SEED,
        torch_threads=THREADS,
        dtype="float32",
    )
    n = result.new_tokens
    start = time.perf_counter()
    name = f"engines-{result.size}-{result.engine}"
    ref = start_policy(name, spec, sampler_backend=result.engine)
    result.start_s = time.perf_counter() - start
    try:
        sampler(ref).sample(prompts[:1], n, 1.0, seed=SEED)
        result.first_sample_s = time.perf_counter() - start
        sampler(ref).sample(prompts, n, 1.0, seed=SEED)  # warm-up
        for _ in range(repeats):
            call_start = time.perf_counter()
            results = sampler(ref).sample(prompts, n, 1.0, seed=SEED)
            result.call_s.append(time.perf_counter() - call_start)
        result.tokens_per_call = sum(len(r.tokens) for r in results)
        result.mismatch_kl, result.max_abs_diff = mismatch(ref, prompts, results)
        for _ in range(3):  # the trainer's full weights into the engine, in place
            sync_start = time.perf_counter()
            sync_weights(ref)
            result.sync_s.append(time.perf_counter() - sync_start)
    finally:
        stop_policy(ref)


def run(sizes: list[str], repeats: int, home: Path) -> list[Result]:
    """Every engine at every size, one policy at a time, on one private local Ray."""
    import ray

    from flowrl.infra.settings import RAY_NAMESPACE

    ray.init(
        address="local",  # a fresh private instance, never a running cluster
        include_dashboard=False,
        num_cpus=4,
        namespace=RAY_NAMESPACE,
        log_to_driver=False,
        _system_config={"prestart_worker_first_driver": False},
    )
    results = []
    try:
        for size in sizes:
            folder, params = build_model(size, home)
            s = SIZES[size]
            prompts = chat_prompts(folder, s.batch)
            print(f"{size}: {params / 1e6:.2f}M parameters", file=sys.stderr)
            for engine in ENGINES:
                result = Result(size, engine, params, s.batch, s.new_tokens)
                try:
                    measure(result, folder, prompts, repeats)
                except Exception as error:  # reported in the table, not hidden
                    traceback.print_exc()
                    result.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                print(f"  {engine}: {row(result)}", file=sys.stderr)
                results.append(result)
    finally:
        ray.shutdown()
    return results


def row(r: Result) -> str:
    """The table row of one result."""
    head = f"| {r.size} | {r.params / 1e6:.2f}M | {r.engine} | {r.batch} × {r.new_tokens} |"
    if r.error is not None or not r.call_s:
        start = f" {r.start_s:.1f} |" if r.start_s is not None else " – |"
        return head + start + f" failed: {r.error} | | | | | | | |"
    call = statistics.median(r.call_s)
    return head + (
        f" {r.start_s:.1f} | {r.first_sample_s:.1f} | {call:.2f} | {r.batch / call:.0f} | "
        f"{r.tokens_per_call / call:.0f} | {r.tokens_per_call / r.batch:.1f} | "
        f"{r.mismatch_kl:.1e} | {r.max_abs_diff:.1e} | {statistics.median(r.sync_s):.3f} |"
    )


def table(results: list[Result]) -> str:
    rows = [
        "| size | parameters | engine | batch × new tokens | start_policy s | first sample s | "
        "s per call (median) | samples/s | sampled tokens/s | tokens/sample | "
        "mismatch-KL per token | max \\|Δ log-prob\\| | weight sync s |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    return "\n".join(rows + [row(r) for r in results]) + "\n"


def findings(results: list[Result]) -> str:
    """What the figures say, computed from them: vLLM against HF, size by size."""
    lines = []
    by = {(r.size, r.engine): r for r in results}
    for size in dict.fromkeys(r.size for r in results):
        hf, vllm = by.get((size, "hf")), by.get((size, "vllm"))
        failed = [r for r in (hf, vllm) if r is None or r.error is not None or not r.call_s]
        if failed:
            names = ", ".join(r.engine for r in failed if r is not None)
            lines.append(f"- **{size}**: {names} failed; no comparison (see the table).")
            continue
        rate = {r.engine: r.tokens_per_call / statistics.median(r.call_s) for r in (hf, vllm)}
        ratio = rate["vllm"] / rate["hf"]
        faster = f"{ratio:.2f}× HF's" if ratio >= 1 else f"{1 / ratio:.2f}× slower than HF"
        lines.append(
            f"- **{size}**: vLLM samples {rate['vllm']:.0f} tokens/s, {faster} "
            f"({rate['hf']:.0f}); its first sample comes {vllm.first_sample_s:.1f} s after "
            f"`start_policy` against HF's {hf.first_sample_s:.1f} s. Mismatch-KL per token: "
            f"HF {hf.mismatch_kl:.1e}, vLLM {vllm.mismatch_kl:.1e} (largest token difference "
            f"{hf.max_abs_diff:.1e} and {vllm.max_abs_diff:.1e})."
        )
        if vllm.batch > VLLM_CPU_MAX_SEQS:
            lines[-1] += (
                f" vLLM runs at most {VLLM_CPU_MAX_SEQS} of the {vllm.batch} rows at once: the "
                "call is two or more waves, HF's one batch."
            )
    return "\n".join(lines) + "\n"


def vllm_version() -> str:
    """vLLM's distribution and version in its venv (without importing it there: seconds)."""
    from flowrl.infra.settings import get_settings

    python = get_settings().resolved_vllm_python
    code = (
        "from importlib.metadata import version as v\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try: print(d, v(d)); break\n"
        "    except Exception: pass\n"
    )
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "vLLM: not found"
    except OSError:
        return f"no vLLM venv at {python}"


def report(results: list[Result], sizes: list[str], repeats: int, wall_s: float, load: str) -> str:
    import ray
    import torch
    import transformers

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    end_load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    command = shlex.join(["python", *sys.argv])
    about = "; ".join(f"`{name}`: {SIZES[name].about}" for name in sizes)
    bullets = [
        f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; one run of `{command}` ({wall_s:.0f} s)",
        f"machine: {len(os.sched_getaffinity(0))} CPUs (nproc), {cpu}, no GPU; load average "
        f"(1/5/15 min) at the start {load}, at the end {end_load}. Shared with other work: "
        "compare numbers within this file, not with other runs.",
        f"software: torch {torch.__version__}, transformers {transformers.__version__}, ray "
        f"{ray.__version__}; vLLM venv: {vllm_version()} (CPU: eager, float32, KV cache of "
        "`FLOWRL_VLLM_CPU_KV_CACHE_MB`)",
        "workers: `start_policy(..., sampler_backend=hf|vllm)` on a private local Ray (4 "
        f"logical CPUs): a sampler actor and a torch trainer actor, `WorkerSpec(torch_threads="
        f'{THREADS}, dtype="float32")`: `OMP_NUM_THREADS={THREADS}` in each actor, which vLLM\'s '
        "CPU worker keeps for its torch threads. vLLM as flowrl configures it: at most "
        f"{VLLM_CPU_MAX_SEQS} sequences at once (vLLM's CPU default for `LLM`), no "
        "tcmalloc or Intel OpenMP preloaded (vLLM warns it would be faster with them)",
        f"sizes (random weights, the tiny model's character vocabulary, tied embeddings): {about}",
        "prompts: distinct chat prompts of the arithmetic environment (system prompt + a "
        f"3-digit problem, ~20 tokens); temperature 1.0, seed {SEED}; s per call: median of "
        f"{repeats} calls after a warm-up call; tokens counted as sampled (a row ends early "
        "when it samples the stop token)",
        "first sample: `start_policy` (actor processes, imports, weights, engine) + one "
        "1-prompt call. Mismatch-KL: `algorithms.mismatch_kl` (k3, mean over the sampled "
        "tokens) of the last timed call, the trainer's `compute_logprobs` against the "
        "engine's log-probs. Weight sync: `sync_weights` (the trainer's full state dict "
        "through Ray's object store, loaded in place; vLLM: `reload_weights`), median of 3",
    ]
    header = "# Sampler engines on CPU: HF generate vs vLLM\n\n"
    header += "\n".join(f"- {b}" for b in bullets) + "\n"
    closing = (
        "\nRandom weights end rows at random (tokens/sample under the budget), not as a "
        "trained policy does: its uneven lengths favour an engine that batches continuously "
        "(vLLM drops a finished row, HF `generate` carries it to the end of the batch) more "
        "than these do. On a GPU the comparison differs (CUDA graphs, paged-attention "
        "kernels, bfloat16): these are CPU figures.\n"
    )
    sections = [header, table(results), "## What the figures say\n", findings(results) + closing]
    return "\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="Timed calls per engine and size.")
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    start = time.perf_counter()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    set_environment()
    with tempfile.TemporaryDirectory(prefix="flowrl-engines-") as home:
        results = run(args.sizes, args.repeats, Path(home))
    text = report(results, args.sizes, args.repeats, time.perf_counter() - start, load)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
