"""The sampler's KV cache options on the benchmark's sizes: HF ``generate`` with its dynamic cache,
with the static cache (``cache_implementation="static"``), and flowrl's default (a GRPO group's
shared prompt prefilled once into a dynamic cache, copied to the group's rows). Also the
padding the left-padded prompt batch carries, which length buckets would remove.

    python benchmarks/sampler_cache.py --out docs/benchmarks/sampler_cache.md

Random-weight models (``build_tiny_model``) of the TRL benchmark's sizes sample the size's
batch (its prompts × group size, the arithmetic environment's chat prompts) at temperature 1
with one torch thread; every option samples the same prompts with the same seeds. Seconds
per batch: median of ``--repeats`` calls after one warm-up call.
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

from trl_compare import SIZES  # same folder


def step_prompts(cfg: Any, tokenizer: Any) -> list[list[int]]:
    """One RL step's sampler batch of job ``cfg``: its environment's first prompts (system and
    user message, chat-encoded by ``tokenizer``), each ``rollout.group_size`` times."""
    from flowrl.backends.models.chat import HFChatFormat

    chat = HFChatFormat(tokenizer)
    task = cfg.env.task(cfg.seed)
    env = task.make_env()
    prompts = []
    for row in task.train_source().next_batch(cfg.rollout.prompts_per_step):
        env.reset(**row)
        messages = [
            {"role": "system", "content": env.get_system_prompt()},
            {"role": "user", "content": env.get_initial_user_message()},
        ]
        prompts += [chat.encode_prompt(messages)] * cfg.rollout.group_size
    return prompts


def measure(size: str, repeats: int, home: Path) -> dict[str, Any]:
    import torch

    from flowrl.backends.engines import hf_sampler
    from flowrl.backends.models.tiny_model import build_tiny_model
    from flowrl.backends.types import WorkerSpec
    from flowrl.tasks.schemas import load_job

    torch.set_num_threads(1)
    cfg = load_job(None, list(SIZES[size].overrides))
    folder = build_tiny_model(cfg.model.tiny, str(home / size))
    sampler = hf_sampler.HFSampler(WorkerSpec(model_uri=folder, cache_dir=str(home / "cache")))
    prompts = step_prompts(cfg, sampler.tokenizer)
    width = max(len(p) for p in prompts)
    padding = 1 - sum(len(p) for p in prompts) / (width * len(prompts))
    generate, shared = sampler.model.generate, hf_sampler._shared_prompt_cache
    options = {
        "dynamic cache, shared prompt prefilled once (flowrl)": (generate, shared),
        "dynamic cache (HF default)": (generate, lambda *a: {}),
        "static cache": (
            lambda **kw: generate(**kw, cache_implementation="static"),
            lambda *a: {},
        ),
    }
    seconds = {}
    for name, (gen, prefill) in options.items():
        sampler.model.generate, hf_sampler._shared_prompt_cache = gen, prefill
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            sampler.sample(prompts, cfg.rollout.max_new_tokens, 1.0, seed=i)
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times[1:])
    sampler.model.generate, hf_sampler._shared_prompt_cache = generate, shared
    return {"rows": len(prompts), "width": width, "padding": padding, "seconds": seconds}


def report(results: dict[str, dict[str, Any]], repeats: int) -> str:
    import torch
    import transformers

    rows = ["| size | rows | option | s per batch | vs flowrl |", "|---|--:|---|--:|--:|"]
    for size, r in results.items():
        base = next(iter(r["seconds"].values()))
        for name, s in r["seconds"].items():
            rows.append(f"| {size} | {r['rows']} | {name} | {s:.3f} | {s / base:.2f}× |")
    pads = "; ".join(
        f"{size}: {r['padding']:.1%} of a {r['width']}-token row" for size, r in results.items()
    )
    command = " ".join(["python", *sys.argv])
    return f"""# Sampler KV cache options

- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `{command}`; median of {repeats} calls
- software: torch {torch.__version__}, transformers {transformers.__version__}; 1 torch thread
- sizes: those of `docs/benchmarks.md`, random weights (rows stop unlike a trained policy's)

{chr(10).join(rows)}

Padding in the left-padded prompt batch (what length buckets would remove): {pads}.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {size: measure(size, args.repeats, Path(tmp)) for size in SIZES}
    text = report(results, args.repeats)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
