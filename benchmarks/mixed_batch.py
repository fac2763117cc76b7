"""Sampling calls of four tenants of one shared worker: one call at a time against one batch.

    python benchmarks/mixed_batch.py --out docs/benchmarks/mixed_batch.md
    python benchmarks/mixed_batch.py --sizes large,medium,wide --out docs/benchmarks/mixed_gpu.md

A ``SharedWorker`` in this process (no Ray) holds four LoRA tenants (rank 16, different seeds,
adapters trained apart so that they differ); each asks for 32 rows (8 prompts x 4 samples, as a
GRPO group asks) of 24 new tokens at temperature 1. Timed, median of 6 rounds after a warm-up:
the four calls one after another (what the worker does when calls arrive apart), the same four
as one batch (``_sample_rows``: what it does when they arrive together), and one tenant's call
with all 128 rows (the cost of the batch without the per-adapter work). Also checked: greedy
rows of the batch equal each tenant's own call (the share of rows with the same tokens, and the
largest log-prob difference on those).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "intermediate_size": 256},
    "large": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 688},
    # Only for a GPU: sizes where one more row costs the device little.
    "medium": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "intermediate_size": 2816},
    "wide": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "intermediate_size": 5632},
}
TENANTS, PROMPTS, GROUP, TOKENS, ROUNDS = 4, 8, 4, 24, 6


def measure(size: str, folder: str) -> dict[str, float]:
    from flowrl.backends.engines.shared_batches import SamplingCall
    from flowrl.backends.engines.shared_worker import SharedWorker
    from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model
    from flowrl.backends.types import Datum, JobTenancy, LoraSettings, WorkerSpec

    path = build_tiny_model(TinyModelSpec(**SIZES[size]), f"{folder}/{size}")
    spec = WorkerSpec(
        model_uri=path, cache_dir=folder, lora=LoraSettings(enabled=True, r=16), seed=1
    )
    worker = SharedWorker(spec)
    names = [f"t{i}" for i in range(TENANTS)]
    data = [Datum(tokens=list(range(5, 17)), loss_mask=[0] * 4 + [1] * 8, advantage=1.0)]
    for i, name in enumerate(names):
        own = spec.model_copy(update={"seed": i + 1})
        worker.join(name, JobTenancy({"sampler": own, "trainer": own}))
        for _ in range(i):  # adapters that differ
            worker.call_as(name, "trainer", "forward_backward", data, "cross_entropy")
            worker.call_as(name, "trainer", "optim_step")
        worker.sync(name)
    rnd = random.Random(0)
    prompts = [
        [rnd.randrange(5, 100) for _ in range(rnd.randrange(20, 40))] for _ in range(PROMPTS)
    ]
    rows = [p for p in prompts for _ in range(GROUP)]

    def apart(temperature: float) -> list:
        return [
            worker.call_as(n, "sampler", "sample", rows, TOKENS, temperature, 100 + i)
            for i, n in enumerate(names)
        ]

    def together(temperature: float) -> list:
        calls = [SamplingCall(n, rows, TOKENS, temperature, 100 + i) for i, n in enumerate(names)]
        return worker.batches._sample_rows(calls)

    def one() -> list:
        return worker.call_as(names[0], "sampler", "sample", rows * TENANTS, TOKENS, 1.0, 7)

    greedy_apart, greedy_together = apart(0.0), together(0.0)
    pairs = [
        (a, b)
        for x, y in zip(greedy_apart, greedy_together, strict=True)
        for a, b in zip(x, y, strict=True)
        if a.tokens
    ]
    same = [a.tokens == b.tokens for a, b in pairs]
    drift = max(
        (
            abs(p - q)
            for a, b in pairs
            if a.tokens == b.tokens
            for p, q in zip(a.logprobs, b.logprobs, strict=True)
        ),
        default=float("nan"),
    )
    times: dict[str, list[float]] = {"apart": [], "together": [], "one": []}
    for _ in range(ROUNDS + 1):
        for key, fn in (
            ("apart", lambda: apart(1.0)),
            ("together", lambda: together(1.0)),
            ("one", one),
        ):
            began = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - began)
    out = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round warms up
    return out | {"greedy_equal": sum(same) / max(len(same), 1), "drift": drift}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sizes", default="tiny,large", help=f"comma-separated, of {list(SIZES)}")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    if unknown := set(sizes) - set(SIZES):
        parser.error(f"unknown sizes {sorted(unknown)}; known: {list(SIZES)}")
    import torch

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name()}, bfloat16"
    else:
        where = f"{os.cpu_count()} CPU cores, one torch thread, fp32"
    command = shlex.join(["python", "benchmarks/mixed_batch.py", *sys.argv[1:]])
    lines = [
        "# Sampling calls of several tenants: one at a time against one batch",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `{command}`; {where}",
        f"- {TENANTS} LoRA tenants (rank 16) of one in-process shared worker, each calling for "
        f"{PROMPTS * GROUP} rows ({PROMPTS} prompts x {GROUP}), {TOKENS} new tokens, "
        f"temperature 1; median of {ROUNDS} rounds",
        "",
        "| size | 4 calls one at a time | the 4 as one batch | speed-up | one call of all "
        "the rows (one adapter) | greedy rows equal each tenant's own | largest log-prob "
        "difference |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for size in sizes:
            r = measure(size, folder)
            equal = r["greedy_equal"]  # bfloat16 on a GPU: batch shape changes the rounding
            lines.append(
                f"| {size} | {r['apart']:.3f} s | {r['together']:.3f} s | "
                f"{r['apart'] / r['together']:.2f}× | {r['one']:.3f} s | "
                f"{equal:.0%} | {r['drift']:.1e} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
