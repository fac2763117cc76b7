"""Supervised learning through the Tinker API: a thin client of any Tinker service (flowrl's own,
``flowrl serve tinker``), with nothing of flowrl imported.

It trains a LoRA adapter on short arithmetic lines ("12+7=19", from a seeded RNG) with
``cross_entropy`` and, every few steps, measures the mean negative log-likelihood per token of a
fixed held-out batch with ``training_client.forward`` (no gradients).

    export TINKER_BASE_URL=http://127.0.0.1:8790 TINKER_API_KEY=tml-...
    flowrl tinker tokenizer flowrl/tiny --out /tmp/tiny-tok
    python examples/tinker/sl_loop.py --tokenizer /tmp/tiny-tok --steps 60 [--json]

The SDK reads ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` itself. Losses are sums over tokens
(Tinker's semantics), so the mean per token is computed here from the returned log-probs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer


def arithmetic_line(rng: random.Random, high: int) -> str:
    """One line "a+b=c" with a, b drawn from 0..high-1."""
    a, b = rng.randrange(high), rng.randrange(high)
    return f"{a}+{b}={a + b}"


def make_datum(tokenizer, line: str) -> types.Datum:
    """A next-token datum of the whole line followed by the end-of-sequence token: input
    tokens[:-1], targets tokens[1:], every target weighted 1."""
    tokens = tokenizer.encode(line, add_special_tokens=False) + [tokenizer.eos_token_id]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [1.0] * (len(tokens) - 1),
        },
    )


def mean_nll(output: types.ForwardBackwardOutput, batch: list[types.Datum]) -> float:
    """Mean negative log-likelihood per weighted target token of ``batch``."""
    total, count = 0.0, 0.0
    for out, datum in zip(output.loss_fn_outputs, batch, strict=True):
        logprobs = np.asarray(out["logprobs"].tolist(), dtype=np.float64)
        weights = np.asarray(datum.loss_fn_inputs["weights"].tolist(), dtype=np.float64)
        total -= float((logprobs * weights).sum())
        count += float(weights.sum())
    return total / count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="tokenizer folder of the base model")
    p.add_argument("--base-model", default="flowrl/tiny")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-operand", type=int, default=20, help="operands are 0..N-1")
    p.add_argument("--json", action="store_true", help="print the curve as one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = random.Random(args.seed)
    heldout_lines = sorted({arithmetic_line(rng, args.max_operand) for _ in range(args.eval_size)})
    heldout = [make_datum(tokenizer, line) for line in heldout_lines]

    def train_line() -> str:  # never a held-out line
        while (line := arithmetic_line(rng, args.max_operand)) in heldout_lines:
            pass
        return line

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(
        args.base_model, rank=args.rank, seed=args.seed
    ).result()
    adam = types.AdamParams(learning_rate=args.learning_rate)

    curve: list[dict] = []
    started = time.monotonic()

    def evaluate(step: int) -> None:
        nll = mean_nll(training.forward(heldout, "cross_entropy").result(), heldout)
        curve.append({"step": step, "heldout_nll": nll})
        say(f"step {step:4d}  held-out NLL/token {nll:.4f}  ({time.monotonic() - started:.1f} s)")

    evaluate(0)
    for step in range(1, args.steps + 1):
        batch = [make_datum(tokenizer, train_line()) for _ in range(args.batch_size)]
        # Submit both, then wait: the service runs them in order on the model's worker.
        fb = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(adam)
        fb.result()
        opt.result()
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)

    first, last = curve[0]["heldout_nll"], curve[-1]["heldout_nll"]
    best = min(c["heldout_nll"] for c in curve)
    summary = {
        "example": "sl_loop",
        "base_model": args.base_model,
        "seed": args.seed,
        "steps": args.steps,
        "curve": curve,
        "first": first,
        "last": last,
        "best": best,
        "drop": 1.0 - last / first,
        "seconds": round(time.monotonic() - started, 2),
    }
    say(f"held-out NLL/token {first:.4f} -> {last:.4f} ({summary['drop']:.1%} lower)")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
