"""The work the Tinker engine leaves out (``backends/engines/tinker/model.py``), each against
doing it:

- ``forward_backward`` on GRPO batches where some groups' samples all scored the same (their
  advantages all 0): those data run forward only (``losses.rows_without_gradient``), against
  every datum through forward and backward in one pass;
- ``forward_backward`` on GRPO batches whose data repeat their group's prompt: the prompt run
  once (``forward._batch_logprobs``), against every datum run whole;
- ``sample`` of ``n`` samples of a text prompt: the prompt run once and its KV cache copied to
  the ``n`` rows (``_prefill_rows``), against the prompt run in every row.

    python benchmarks/tinker_engine.py --out docs/benchmarks/tinker_engine.md

A random-weight model of the TRL benchmark's ~3M size (``build_tiny_model``, a context of 1024)
with a rank-16 LoRA adapter (``TinkerModel``, as the Tinker service holds it), both CPU cores.
A training batch is 8 groups × 8 samples of a 12-token prompt and 33 sampled tokens (the ~3M
job's lengths), ``ppo``; a share of the groups has advantages of 0. Sampling: temperature 1,
random prompt tokens, no stop. Seconds per call: median of ``--repeats`` calls after one
warm-up call, the two options alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trl_compare import SIZES  # same folder

GROUPS, GROUP_SIZE, PROMPT, SAMPLED = 8, 8, 12, 33
SHARES = (0.0, 0.25, 0.5, 0.75)
PROMPTS = ((12, 33), (128, 32), (384, 32))
"""(prompt tokens, sampled tokens) of the GRPO batches whose prompts run once."""
SAMPLES = ((64, 8, 32), (256, 8, 32), (256, 16, 32), (512, 16, 64))
"""(prompt tokens, samples, max_tokens) of each sampling request."""


def batch(idle_groups: int, prompt_tokens: int = PROMPT, sampled: int = SAMPLED) -> list[Any]:
    """One GRPO batch of ``ppo`` data; its first ``idle_groups`` groups' advantages are 0."""
    import numpy as np

    from flowrl.backends.engines.tinker.types import Datum

    rng = np.random.default_rng(0)
    data = []
    for g in range(GROUPS):
        prompt = rng.integers(5, 100, size=prompt_tokens).tolist()
        for _ in range(GROUP_SIZE):
            tokens = prompt + rng.integers(5, 100, size=sampled).tolist()
            n = len(tokens)
            advantage = 0.0 if g < idle_groups else float(rng.normal())
            advantages = np.where(np.arange(n - 1) >= prompt_tokens - 1, advantage, 0.0)
            inputs = {
                "target_tokens": np.array(tokens[1:]),
                "logprobs": np.full(n - 1, -4.6, np.float32),
                "advantages": advantages.astype(np.float32),
            }
            data.append(Datum(tokens[:-1], inputs))
    return data


def timed(options: dict[str, Callable[[], Any]], call: Callable[[], Any], repeats: int) -> dict:
    """Median seconds of ``call`` under each option (a function that sets it up)."""
    times: dict[str, list[float]] = {name: [] for name in options}
    for i in range(repeats + 1):
        for name, setup in options.items():
            setup()
            start = time.perf_counter()
            call()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(repeats: int, home: Path) -> dict[str, dict[Any, dict[str, float]]]:
    from flowrl.backends.engines.tinker import forward
    from flowrl.backends.engines.tinker import model as tinker_model
    from flowrl.backends.engines.tinker.types import SampleParams, tinker_lora
    from flowrl.backends.models.tiny_model import build_tiny_model
    from flowrl.tasks.schemas import load_job

    overrides = [*SIZES["large"].overrides, "model.tiny.max_position_embeddings=1024"]
    cfg = load_job(None, overrides)
    folder = build_tiny_model(cfg.model.tiny, str(home / "large"))
    model = tinker_model.TinkerModel(folder, tinker_lora(rank=16), seed=0)
    skip, rows = tinker_model.rows_without_gradient, tinker_model._prefill_rows
    prompts_of = forward._prompt_lengths

    def choose(name: str, value: Any, module: Any = tinker_model) -> Callable[[], None]:
        return lambda: setattr(module, name, value)

    training = {}
    for idle in SHARES:
        data = batch(round(idle * GROUPS))

        def update(data: list[Any] = data) -> None:
            model.forward_backward(data, "ppo", {})
            model.optimizer.zero_grad(set_to_none=True)

        options = {
            "flowrl": choose("rows_without_gradient", skip),
            "every": choose("rows_without_gradient", lambda *_: set()),
        }
        training[idle] = timed(options, update, repeats)
    prompts = {}
    for prompt_tokens, sampled in PROMPTS:
        data = batch(0, prompt_tokens, sampled)

        def update_once(data: list[Any] = data) -> None:
            model.forward_backward(data, "ppo", {})
            model.optimizer.zero_grad(set_to_none=True)

        options = {
            "flowrl": choose("_prompt_lengths", prompts_of, forward),
            "every": choose("_prompt_lengths", lambda *_: None, forward),
        }
        prompts[(prompt_tokens, sampled)] = timed(options, update_once, repeats)
    forward._prompt_lengths = prompts_of
    sampling = {}
    for prompt_tokens, n, max_tokens in SAMPLES:
        prompt = [5 + i % 95 for i in range(prompt_tokens)]
        params = SampleParams(max_tokens=max_tokens, temperature=1.0, seed=1)
        options = {
            "flowrl": choose("_prefill_rows", rows),
            "every": choose("_prefill_rows", lambda n, _images: n),
        }
        call = lambda p=prompt, n=n, params=params: model.sample(p, n, params, "live")  # noqa: E731
        sampling[(prompt_tokens, n, max_tokens)] = timed(options, call, repeats)
    tinker_model.rows_without_gradient, tinker_model._prefill_rows = skip, rows
    return {"training": training, "prompts": prompts, "sampling": sampling}


def _table(header: str, results: dict[str, dict[str, float]]) -> list[str]:
    """A markdown table: ``header``, then per row its key's cells, the two options' seconds
    and their ratio."""
    lines = [header, "|" + "--:|" * (header.count("|") - 1)]
    for cells, r in results.items():
        ours, every = r["flowrl"], r["every"]
        lines.append(f"| {cells} | {ours:.3f} | {every:.3f} | {ours / every:.2f}× |")
    return lines


def report(results: dict[str, dict[Any, dict[str, float]]], repeats: int) -> str:
    import torch

    train = _table(
        "| groups with advantage 0 | forward only (flowrl), s | every datum backward, s | ratio |",
        {f"{idle:.0%}": r for idle, r in results["training"].items()},
    )
    once = _table(
        "| prompt tokens | sampled tokens | prompt once (flowrl), s | every datum whole, s"
        " | ratio |",
        {" | ".join(map(str, key)): r for key, r in results["prompts"].items()},
    )
    sample = _table(
        "| prompt tokens | samples | max_tokens | prompt once (flowrl), s | prompt in every row, s"
        " | ratio |",
        {" | ".join(map(str, key)): r for key, r in results["sampling"].items()},
    )
    command = " ".join(["python", *sys.argv])
    return f"""# The work the Tinker engine leaves out

- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `{command}`; median of {repeats} calls
- software: torch {torch.__version__}, {torch.get_num_threads()} torch threads
- model: the ~3M model (random weights) with a rank-16 LoRA adapter

## forward_backward: data without a gradient run forward only

{GROUPS} groups × {GROUP_SIZE} samples, {PROMPT}-token prompt + {SAMPLED} sampled tokens, `ppo`.

{chr(10).join(train)}

At 0% both options run the same single pass: their difference there is this machine's noise.

## forward_backward: a group's prompt run once

{GROUPS} groups × {GROUP_SIZE} samples, `ppo`, every group's advantages nonzero.

{chr(10).join(once)}

## sample: a text prompt run once for its samples

{chr(10).join(sample)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = report(measure(args.repeats, Path(tmp)), args.repeats)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
