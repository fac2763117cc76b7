"""LoRA tenants on one base model against each on its own: memory, throughput, join time.

    python benchmarks/shared_lora.py --out docs/benchmarks/shared_lora.md

Four LoRA tenants (``TinkerModel``, rank 16, different seeds) train with the same SL steps
(``cross_entropy`` + AdamW, 8 datums of 32 tokens each, round-robin) in one process, two ways:

- **shared**: one ``SharedBase`` (the base weights once; each tenant its adapter and AdamW);
- **apart**: each tenant a base of its own (what one model per job holds today).

Each setup runs in a fresh child process (so its memory is its own) at the TRL benchmark's
sizes and a wider one where the base weights dominate; reported: the process's PSS after the
tenants joined and after training, aggregate datums per second, and the fourth tenant's join
time (from its request to a model ready to train, the base already loaded for ``shared``).
This is the tenants' half; ``benchmarks/shared_jobs.py`` measures the ``rl-train`` jobs' half
(a shared worker across flow runs, jobs with workers of their own, and TRL) into the same file,
whose "rl-train jobs" section this script keeps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "intermediate_size": 256},
    "large": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 688},
    "wide": {"hidden_size": 1024, "num_layers": 8, "intermediate_size": 2816},
}
TENANTS = 4
STEPS = 10
JOBS_SECTION = "## rl-train jobs"  # benchmarks/shared_jobs.py writes it


def child(size: str, setup: str, home: str) -> dict:
    """One setup in this (fresh) process; its measurements."""
    import numpy as np
    import psutil
    import torch

    from flowrl.backends.engines.tinker.model import SharedBase, TinkerModel
    from flowrl.backends.engines.tinker.types import Datum, tinker_lora
    from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model

    torch.set_num_threads(1)
    spec = TinyModelSpec(**SIZES[size], max_position_embeddings=64)
    folder = f"{home}/{size}"
    if not Path(folder, "config.json").exists():
        build_tiny_model(spec, folder)
    me = psutil.Process()
    start_pss = me.memory_full_info().pss
    shared = SharedBase(folder) if setup == "shared" else None
    tenants, join_s = [], []
    for i in range(TENANTS):
        began = time.perf_counter()
        base = shared if shared is not None else folder
        tenants.append(TinkerModel(base, tinker_lora(rank=16), seed=i, name=f"t{i}"))
        join_s.append(time.perf_counter() - began)
    joined_pss = me.memory_full_info().pss
    rng = np.random.default_rng(0)
    data = []
    for _ in range(8):
        tokens = rng.integers(5, 100, size=33).tolist()
        data.append(Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:])}))
    began = time.perf_counter()
    for _ in range(STEPS):
        for tenant in tenants:
            tenant.forward_backward(data, "cross_entropy")
            tenant.optim_step(learning_rate=1e-3)
    seconds = time.perf_counter() - began
    base = (shared or tenants[0].base).base
    params = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    return {
        "params": params,
        "pss_joined_mb": (joined_pss - start_pss) / 2**20,
        "pss_trained_mb": (me.memory_full_info().pss - start_pss) / 2**20,
        "datums_per_s": TENANTS * STEPS * len(data) / seconds,
        "join_fourth_ms": join_s[-1] * 1000,
        "join_first_ms": join_s[0] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--child", nargs=3, metavar=("SIZE", "SETUP", "HOME"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for size in SIZES:
            for setup in ("shared", "apart"):
                cmd = [sys.executable, __file__, "--child", size, setup, home]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows.append(
                    {"size": size, "setup": setup, **json.loads(out.stdout.splitlines()[-1])}
                )
                print(rows[-1], file=sys.stderr)
    lines = [
        "# LoRA tenants on one base model vs each on its own",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/shared_lora.py "
        "--out docs/benchmarks/shared_lora.md`",
        "- machine: 2 CPU cores, no GPU; one torch thread; fp32",
        f"- {TENANTS} tenants (`TinkerModel`, LoRA rank 16 on every linear layer and lm_head), "
        f"{STEPS} SL steps each, round-robin; a step = `forward_backward` (8 datums × 32 "
        "tokens, `cross_entropy`) + `optim_step`; each setup in a fresh process",
        "- PSS: the process's growth over its start (torch and flowrl imported), in MB",
        "",
        "| size | base params | setup | PSS, 4 tenants joined | PSS after training | "
        "datums/s (aggregate) | 1st tenant ready | 4th tenant ready |",
        "|---|--:|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.2f}M | {r['setup']} | {r['pss_joined_mb']:.1f} "
            f"| {r['pss_trained_mb']:.1f} | {r['datums_per_s']:.0f} | {r['join_first_ms']:.0f} ms "
            f"| {r['join_fourth_ms']:.0f} ms |"
        )
    by = {(r["size"], r["setup"]): r for r in rows}
    lines += ["", "Shared against apart, per size:", ""]
    for size in SIZES:
        s, a = by[(size, "shared")], by[(size, "apart")]
        lines.append(
            f"- {size}: PSS after training {s['pss_trained_mb'] / a['pss_trained_mb']:.0%} of "
            f"apart; throughput {s['datums_per_s'] / a['datums_per_s']:.2f}×; the 4th tenant "
            f"ready in {s['join_fourth_ms']:.0f} ms against {a['join_fourth_ms']:.0f} ms"
        )
    lines += [
        "",
        "What this shows, and what it does not: in one process, four bases loaded from the same "
        "safetensors file cost little more memory than one, because the weights are memory-mapped "
        "and never written (the page cache holds them once; PSS counts them once) — so on CPU the "
        "shared base saves the per-tenant load and join time, not the weights' memory. The memory "
        "a shared worker saves is per process (a torch runtime and a Ray worker per job: "
        "`docs/benchmarks/footprint.md`) and, on GPUs, the device copy of the base per process; "
        "the rl-train jobs' half below (one worker across flow runs) measures them. "
        "Throughput: switching the active adapter on every call "
        "(`set_adapter`) costs a fixed time per call, visible at the tiny size only.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        jobs = out.read_text().partition(JOBS_SECTION) if out.exists() else ("", "", "")
        kept = f"\n{jobs[1]}{jobs[2]}" if jobs[1] else ""
        out.write_text(text + kept)


if __name__ == "__main__":
    main()
