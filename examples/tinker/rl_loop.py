"""Reinforcement learning through the Tinker API: a thin client of any Tinker service (flowrl's
own, ``flowrl serve tinker``), with nothing of flowrl imported.

The task is arithmetic ("a+b=" -> "c"), the reward an exact match of the answer. The loop:

1. a short supervised warm-up through the same API (``cross_entropy`` on the answer tokens),
   until the model sometimes answers right;
2. iterations of: ``save_weights_and_get_sampling_client()``; a group of completions per prompt
   (temperature 1, stopping at the end-of-sequence token or a newline); rewards; advantages
   centred within each group; datums for ``importance_sampling`` (target tokens, the sampler's
   log-probs, the advantage on the sampled tokens and 0 on the prompt); ``forward_backward`` and
   ``optim_step``.

    export TINKER_BASE_URL=http://127.0.0.1:8790 TINKER_API_KEY=tml-...
    flowrl tinker tokenizer flowrl/tiny --out /tmp/tiny-tok
    python examples/tinker/rl_loop.py --tokenizer /tmp/tiny-tok --steps 40 [--json]
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


class Arithmetic:
    """Problems "a+b=" with a, b in 0..high-1; the answer is the decimal sum."""

    def __init__(self, tokenizer, high: int):
        self.tokenizer = tokenizer
        self.high = high

    def problem(self, rng: random.Random) -> tuple[list[int], str]:
        a, b = rng.randrange(self.high), rng.randrange(self.high)
        return self.encode(f"{a}+{b}="), str(a + b)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def reward(self, completion: list[int], answer: str) -> float:
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        return 1.0 if text.strip() == answer else 0.0


def sft_datum(prompt: list[int], answer_tokens: list[int]) -> types.Datum:
    """Next-token datum of prompt + answer; only the answer's targets are weighted."""
    tokens = prompt + answer_tokens
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer_tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(prompt: list[int], sampled: list[int], logprobs: list[float], adv: float):
    """An ``importance_sampling`` datum: targets are the next tokens; the sampler's log-probs
    and the advantage sit on the sampled tokens, 0 on the prompt."""
    tokens = prompt + sampled
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(logprobs),
            "advantages": [0.0] * n_prompt + [adv] * len(sampled),
        },
    )


def sample_groups(
    sampler,
    problems: list[tuple[list[int], str]],
    group: int,
    params: types.SamplingParams,
    rng: random.Random,
) -> list[list[types.SampledSequence]]:
    """``group`` completions of each problem (all requests in flight at once), each request
    with its own seed from ``rng`` (the run is repeatable)."""
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(prompt),
            group,
            params.model_copy(update={"seed": rng.randrange(2**31)}),
        )
        for prompt, _ in problems
    ]
    return [f.result().sequences for f in futures]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="tokenizer folder of the base model")
    p.add_argument("--base-model", default="flowrl/tiny")
    p.add_argument("--steps", type=int, default=40, help="RL iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=16, help="problems per iteration")
    p.add_argument("--group", type=int, default=8, help="samples per problem")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-3, help="RL learning rate")
    p.add_argument("--warmup-learning-rate", type=float, default=2e-3)
    p.add_argument("--warmup-batch", type=int, default=32)
    p.add_argument("--warmup-max-steps", type=int, default=120)
    p.add_argument("--warmup-target", type=float, default=0.2, help="stop at this reward")
    p.add_argument("--max-operand", type=int, default=5, help="operands are 0..N-1")
    p.add_argument("--json", action="store_true", help="print the curve as one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tokenizer.eos_token_id
    newline = Arithmetic(tokenizer, 1).encode("\n")
    task = Arithmetic(tokenizer, args.max_operand)
    rng = random.Random(args.seed)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[eos, *newline])
    started = time.monotonic()

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(
        args.base_model, rank=args.rank, seed=args.seed
    ).result()

    def mean_reward(sampler, problems) -> tuple[float, list[list[float]], list]:
        groups = sample_groups(sampler, problems, args.group, params, rng)
        rewards = [
            [task.reward(s.tokens, answer) for s in seqs]
            for seqs, (_, answer) in zip(groups, problems, strict=True)
        ]
        return float(np.mean(rewards)), rewards, groups

    # 1. Supervised warm-up, checked every 10 steps on fresh problems.
    warmup: list[dict] = []
    adam = types.AdamParams(learning_rate=args.warmup_learning_rate)
    for step in range(1, args.warmup_max_steps + 1):
        batch = []
        for _ in range(args.warmup_batch):
            prompt, answer = task.problem(rng)
            batch.append(sft_datum(prompt, task.encode(answer) + [eos]))
        fb, opt = training.forward_backward(batch, "cross_entropy"), training.optim_step(adam)
        fb.result()
        opt.result()
        if step % 10 == 0:
            sampler = training.save_weights_and_get_sampling_client().result()
            reward, _, _ = mean_reward(sampler, [task.problem(rng) for _ in range(args.prompts)])
            warmup.append({"step": step, "reward": reward})
            say(f"warm-up step {step:3d}  mean reward {reward:.3f}")
            if reward >= args.warmup_target:
                break

    # 2. RL iterations.
    adam = types.AdamParams(learning_rate=args.learning_rate)
    curve: list[dict] = []
    for it in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        problems = [task.problem(rng) for _ in range(args.prompts)]
        reward, rewards, groups = mean_reward(sampler, problems)
        data = []
        for (prompt, _), seqs, group_rewards in zip(problems, groups, rewards, strict=True):
            centre = float(np.mean(group_rewards))
            for seq, r in zip(seqs, group_rewards, strict=True):
                if r != centre and seq.tokens:  # an all-equal group teaches nothing
                    data.append(rl_datum(prompt, seq.tokens, seq.logprobs, r - centre))
        if data:
            fb = training.forward_backward(data, "importance_sampling")
            opt = training.optim_step(adam)
            fb.result()
            opt.result()
        curve.append({"iteration": it, "reward": reward, "datums": len(data)})
        say(
            f"iteration {it:3d}  mean reward {reward:.3f}  datums {len(data):3d}"
            f"  ({time.monotonic() - started:.1f} s)"
        )

    rewards = [c["reward"] for c in curve]
    head, tail = rewards[:3], rewards[-3:]
    summary = {
        "example": "rl_loop",
        "base_model": args.base_model,
        "seed": args.seed,
        "warmup": warmup,
        "curve": curve,
        "first": rewards[0],
        "last": rewards[-1],
        "first3": float(np.mean(head)),
        "last3": float(np.mean(tail)),
        "rise": float(np.mean(tail) - np.mean(head)),
        "seconds": round(time.monotonic() - started, 2),
    }
    say(
        f"mean reward, first 3 iterations {summary['first3']:.3f} -> last 3 "
        f"{summary['last3']:.3f} ({summary['rise']:+.3f})"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
