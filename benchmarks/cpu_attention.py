"""Attention kernels on a CPU: transformers' default (SDPA, torch's fused attention) against
``eager`` (matmul, float32 softmax, matmul), in float32 and bfloat16, at the benchmark's sizes.

    python benchmarks/cpu_attention.py --out docs/benchmarks/cpu_attention.md

What ``backends.models.precision.attention_kernels`` picks rests on this table. Per size
(``trl_compare.SIZES``, random weights): the sampler's batch (the size's prompts × group size,
the arithmetic environment's chat prompts) sampled by ``HFSampler`` at temperature 1, and one
training pass (forward and backward over those sequences, float32 master weights, bf16
autocast where bf16) as ``TorchTrainer`` runs it, both with the benchmark's 2 torch threads.
Seconds: median of ``--repeats`` calls after one warm-up call, the two kernels taking turns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sampler_cache import step_prompts  # same folder
from trl_compare import SIZES

KERNELS = ("sdpa", "eager")
DTYPES = ("float32", "bfloat16")


def measure(size: str, dtype: str, repeats: int, home: Path) -> dict[str, Any]:
    import torch

    from flowrl.backends.engines.hf_sampler import HFSampler
    from flowrl.backends.models.precision import forward_autocast
    from flowrl.backends.models.tiny_model import build_tiny_model
    from flowrl.backends.types import WorkerSpec
    from flowrl.tasks.schemas import load_job

    cfg = load_job(None, list(SIZES[size].overrides))
    folder = home / size
    if not (folder / "config.json").exists():
        build_tiny_model(cfg.model.tiny, str(folder))
    spec = WorkerSpec(
        model_uri=str(folder), cache_dir=str(home / "cache"), dtype=dtype, torch_threads=2
    )
    sampler = HFSampler(spec)
    trained = HFSampler(spec.model_copy(update={"dtype": "float32"})).model.train()
    prompts = step_prompts(cfg, sampler.tokenizer)
    samples = sampler.sample(prompts, cfg.rollout.max_new_tokens, 1.0, seed=0)
    rows = [p + s.tokens for p, s in zip(prompts, samples, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    device = torch.device("cpu")

    def sample(i: int) -> None:
        sampler.sample(prompts, cfg.rollout.max_new_tokens, 1.0, seed=i)

    def train(i: int) -> None:
        with forward_autocast(sampler.dtype, device):
            logits = trained(input_ids=ids, attention_mask=mask).logits
        torch.log_softmax(logits.float(), dim=-1)[..., 1].mean().backward()
        trained.zero_grad(set_to_none=True)

    seconds: dict[str, dict[str, list[float]]] = {}
    for what, fn in (("sample", sample), ("train", train)):
        times: dict[str, list[float]] = {k: [] for k in KERNELS}
        for i in range(repeats + 1):
            for kernel in KERNELS:
                sampler.model.set_attn_implementation(kernel)
                trained.set_attn_implementation(kernel)
                start = time.perf_counter()
                fn(i)
                if i:  # the first call of each is a warm-up
                    times[kernel].append(time.perf_counter() - start)
        seconds[what] = times
    params = sum(p.numel() for p in trained.parameters())
    return {"rows": len(rows), "width": width, "params": params, "seconds": seconds}


def report(results: dict[str, dict[str, Any]], repeats: int, took: float) -> str:
    import torch
    import transformers

    lines = [
        "# Attention kernels on a CPU: SDPA against eager",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/cpu_attention.py "
        f"--out docs/benchmarks/cpu_attention.md` ({took / 60:.1f} min)",
        f"- software: torch {torch.__version__}, transformers {transformers.__version__}; "
        "2 torch threads",
        "- sampling: `HFSampler.sample` of the size's batch (prompts × group size) at "
        "temperature 1; training: one forward and backward pass over the sampled sequences, "
        "float32 master weights (bf16 autocast where bf16), as `TorchTrainer` runs it",
        f"- seconds: median of {repeats} calls after a warm-up, the kernels taking turns; "
        "random weights (`trl_compare.SIZES`)",
        "",
        "| size | dtype | rows × tokens | sample: SDPA s | eager s | eager ÷ SDPA "
        "| train: SDPA s | eager s | eager ÷ SDPA |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for key, r in results.items():
        size, dtype = key.split("/")
        cells = [f"{size} ({r['params'] / 1e6:.2f}M)", dtype, f"{r['rows']} × {r['width']}"]
        for what in ("sample", "train"):
            sdpa, eager = (statistics.median(r["seconds"][what][k]) for k in KERNELS)
            cells += [f"{sdpa:.3f}", f"{eager:.3f}", f"**{eager / sdpa:.2f}×**"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "`attention_kernels` picks eager for a worker computing in bfloat16 on a CPU, and "
        "leaves transformers' default (SDPA) elsewhere: on a CPU in float32, and on CUDA.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "large", "huge"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flowrl-attention-") as home:
        results = {
            f"{size}/{dtype}": measure(size, dtype, args.repeats, Path(home))
            for size in args.sizes
            for dtype in DTYPES
        }
    text = report(results, args.repeats, time.perf_counter() - start)
    print(text)
    if args.out:
        args.out.write_text(text)
    else:
        print("(no --out: nothing written)", file=sys.stderr)


if __name__ == "__main__":
    main()
