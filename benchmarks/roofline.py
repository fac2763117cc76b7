"""How fast a GRPO step could be on this machine: the field's sizes (`benchmarks/field.py`)
against the rate this CPU's matrix multiplies reach in the step's own shapes.

    python benchmarks/roofline.py --field /tmp/flowrl-field-XXXX/field.json \\
        --out docs/benchmarks/roofline.md

``--field`` is the ``field.json`` a run of ``benchmarks/field.py`` leaves in its state folder
(it prints the folder). For each size the script counts the work of one step, the matrix
multiplies of the model's linear layers (attention scores, softmax, sampling and AdamW left
out), two ways:

- as TRL does it: every row's prompt and completion through the forward pass while sampling
  (prefill, then one token at a time), and every row's whole sequence through forward and
  backward (3x a forward) while training;
- the least any trainer can do: a group's shared prompt once, its rows' completions each.

It then times ``torch.nn.functional.linear`` in the step's shapes with the job's threads (one
decode step: as many rows as the batch; a training pass: every token of the batch) and gives
the **floor**: the least work at those rates, the backward pass taken at the forward's. No
step of this machine can be shorter; a step of 2x TRL's samples/s must be half TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark scripts' folder

import trl_compare  # noqa: E402

SIDES = ("trl-2t", "flowrl defaults")


@dataclass(frozen=True)
class Shape:
    """A step's shape: the model's linear layers and the batch."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    rows: int  # samples a step
    groups: int  # prompts a step
    prompt: float  # tokens a prompt
    completion: float  # tokens a sample

    @property
    def linear_params(self) -> int:
        """Weights a token meets in the linear layers (q, k, v, o, the MLP, the unembedding)."""
        return self.layers * (4 * self.hidden**2 + 3 * self.hidden * self.intermediate) + (
            self.hidden * self.vocab
        )

    def work(self, least: bool) -> tuple[float, float, float]:
        """FLOPs of (prefill, decode, training) in one step; ``least``: a group's prompt once."""
        flops = 2 * self.linear_params  # a token's forward pass
        prompts = (self.groups if least else self.rows) * self.prompt
        decode = self.rows * self.completion
        return flops * prompts, flops * decode, 3 * flops * (prompts + decode)


def shape_of(size: str, completion: float) -> Shape:
    """The field's job at ``size`` (``trl_compare.SIZES``), with its mean prompt length."""
    from flowrl.backends.models.chat import HFChatFormat
    from flowrl.backends.models.tiny_model import build_tokenizer

    config = trl_compare.job_config(size, [])
    tokenizer = build_tokenizer()
    chat, task = HFChatFormat(tokenizer), config.env.task()
    prompts = [
        chat.encode_prompt([{"role": "user", "content": task.problem(i)["question"]}])
        for i in range(64)
    ]
    tiny, r = config.model.tiny, config.rollout
    return Shape(
        hidden=tiny.hidden_size,
        layers=tiny.num_layers,
        intermediate=tiny.intermediate_size,
        vocab=len(tokenizer),
        rows=r.prompts_per_step * r.group_size,
        groups=r.prompts_per_step,
        prompt=statistics.mean(len(p) for p in prompts),
        completion=completion,
    )


def linear_rate(shape: Shape, rows: int, dtype: str = "float32", repeats: int = 15) -> float:
    """FLOP/s of one forward pass of the model's linear layers over ``rows`` tokens in
    ``dtype`` (the job's compute dtype): the best of ``repeats`` timings (the floor is the least
    time this machine takes)."""
    import torch
    import torch.nn.functional as F

    h, i = shape.hidden, shape.intermediate

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size).to(getattr(torch, dtype))

    x, y = randn(rows, h), randn(rows, i)
    weights = [(x, randn(h, h))] * 4 + [(x, randn(i, h))] * 2
    weights += [(y, randn(h, i)), (x, randn(shape.vocab, h))]
    flops = 2 * rows * sum(w.numel() for _, w in weights)
    with torch.no_grad():
        for a, w in weights:  # warm the kernels
            F.linear(a, w)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            for a, w in weights:
                F.linear(a, w)
            times.append(time.perf_counter() - began)
    return flops / min(times)


def measure(field: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per size: its shape, the two works, the rates and the floor, and each side's s/step."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    out = {}
    for size, sides in field.items():
        shape = shape_of(size, sides["flowrl defaults"]["tokens_per_sample"])
        dtype = sides["flowrl defaults"].get("picked", {}).get("dtype") or "float32"
        decode_rate = linear_rate(shape, shape.rows, dtype)
        train_rows = round(shape.rows * (shape.prompt + shape.completion))
        train_rate = linear_rate(shape, train_rows, dtype)
        prefill, decode, train = shape.work(least=True)
        flowrl = sides["flowrl defaults"]["profile"]
        out[size] = {
            "shape": shape.__dict__,
            "dtype": dtype,
            "work": sum(shape.work(least=False)),
            "least_work": prefill + decode + train,
            "decode_rate": decode_rate,
            "train_rate": train_rate,
            "rollout_floor_s": prefill / train_rate + decode / decode_rate,
            "train_floor_s": train / train_rate,
            "rollout_s": flowrl["rollout"],
            "train_s": flowrl["train"],
            "step_s": {side: trl_compare.steady(sides[side]) for side in SIDES},
        }
    return out


def report(rows: dict[str, dict[str, Any]], field_path: Path) -> str:
    names = {"tiny": "tiny (0.34M)", "large": "~3M (3.19M)", "huge": "~100M (99.19M)"}
    lines = [
        "| size | TRL-2t s/step | 2× TRL: s/step | flowrl s/step | floor s/step | floor ÷ 2× | "
        "rollout s: floor / flowrl | training s: floor / flowrl | "
        "GFLOP/s: TRL (its work) / flowrl (least) | linear GFLOP/s: decode / train |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    said = []
    for size, r in rows.items():
        trl, ours = r["step_s"]["trl-2t"], r["step_s"]["flowrl defaults"]
        floor = r["rollout_floor_s"] + r["train_floor_s"]
        lines.append(
            f"| {names.get(size, size)} | {trl:.2f} | {trl / 2:.2f} | {ours:.2f} | {floor:.2f} | "
            f"**{floor / (trl / 2):.2f}** | {r['rollout_floor_s']:.2f} / {r['rollout_s']:.2f} | "
            f"{r['train_floor_s']:.2f} / {r['train_s']:.2f} | "
            f"{r['work'] / trl / 1e9:.0f} / {r['least_work'] / ours / 1e9:.0f} | "
            f"{r['decode_rate'] / 1e9:.0f} / {r['train_rate'] / 1e9:.0f} |"
        )
        left = trl / 2 - r["train_s"]
        said.append(
            f"- {names.get(size, size)}: flowrl's training takes {r['train_s']:.2f} s (its floor: "
            f"{r['train_floor_s'] / r['train_s']:.0%} of that), its rollout {r['rollout_s']:.2f} s "
            f"(floor: {r['rollout_floor_s'] / r['rollout_s']:.0%}). The step of 2× TRL-2t, "
            f"{trl / 2:.2f} s, is {abs(left):.2f} s {'more' if left >= 0 else 'less'} than "
            "flowrl's training alone takes now."
        )
    shapes = "\n".join(
        f"- {names.get(s, s)}: hidden {r['shape']['hidden']} × {r['shape']['layers']} layers, "
        f"MLP {r['shape']['intermediate']}, vocabulary {r['shape']['vocab']}; "
        f"{r['shape']['rows']} samples ({r['shape']['groups']} prompts) a step, "
        f"{r['shape']['prompt']:.1f} prompt + {r['shape']['completion']:.1f} sampled tokens"
        for s, r in rows.items()
    )
    dtypes = ", ".join(f"{names.get(s, s)} {r['dtype']}" for s, r in rows.items())
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    return f"""# The floor of a GRPO step on this machine

- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `{shlex.join(["python", *sys.argv])}`
- machine: {len(os.sched_getaffinity(0))} CPUs, {cpu}, as many torch threads; the linear
  layers timed in the precision the defaults computed in: {dtypes}
- steps: the s/step of `{field_path.name}`'s run of `benchmarks/field.py` (the sides
  `trl-2t` and `flowrl defaults`, steady state)
- work: the linear layers' multiply-adds (2 FLOPs each) of one step. TRL's: every row's prompt
  and completion forward while sampling, every row's sequence forward and backward (3× a
  forward) while training. The least: a group's shared prompt once (flowrl's trainer and
  sampler share it: docs/benchmarks/trainer_speed.md). Attention scores, softmax, sampling and
  AdamW are left out, so the floor is below any real step.
- rates: `torch.nn.functional.linear` timed in the step's shapes on this machine, the best of
  15 passes: a decode
  step (one token of every row: as many rows as samples), a training pass (every token of the
  batch); the backward pass taken at the forward's rate
- floor: the least work at those rates. 2× TRL-2t's samples/s needs a step of half TRL's: a
  floor ÷ 2× above 1 means no code on this machine gets there in that precision; below 1, it is the
  share of the linear layers' own rate the whole step would have to run at.
- rollout and training: flowrl's split of the same run (`time/rollout_s`, the update's
  forward, backward and AdamW), each against its part of the floor

{shapes}

{chr(10).join(lines)}

{chr(10).join(said)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--field", type=Path, required=True, help="a field run's field.json")
    parser.add_argument("--out", type=Path, help="Also write the markdown report here.")
    args = parser.parse_args()
    rows = measure(json.loads(args.field.read_text()))
    text = report(rows, args.field)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
