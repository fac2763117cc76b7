"""A trainer's update in several forward and backward passes (gradient accumulation) whose
gradients sum to the whole batch's: the batch's rows in consecutive runs of at most so many
padded tokens, each run's loss scaled by its share of the aggregation's denominator
(``algorithms.aggregation_denominator``), as the trainer already scales the rows it keeps when it
leaves rows of advantage 0 out.

A pass's activations are what a trainer holds at its peak: a ~3M-parameter policy's update of
128 rows of ~41 tokens peaked at ~1.2 GB in one pass and ~0.72 GB in passes of 32 rows, in the
same time (``PASS_MEMORY_CPU``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowrl.backends.engines.algorithms import aggregation_denominator
from flowrl.backends.types import Datum

PASS_MEMORY_CPU = 256 << 20
"""On a CPU, a pass's activations are held to the larger of this and the trainer's own state
(``cpu_tokens_per_pass``). Measured on a 2-core AMD EPYC, one ``TorchTrainer`` update (forward,
backward) as the benchmark's jobs run it:

- ~3M parameters (float32), 128 rows × ~41 tokens: the process's peak RSS 1.19-1.23 GB in one
  pass; 0.82-0.84 GB in passes of ~2050 tokens; 0.72 GB in passes of ~1300 tokens (0.75 s against
  0.78-0.82 s in one pass); 0.67 GB of ~1000 (0.86 s). In a whole job (14 steps, ~2 passes of
  ~40 rows): the worker's peak PSS 1022 → 698 MB.
- the default job's 0.34M policy, 512 rows × ~11 tokens (~0.1 GB of activations): passes of
  ~1500 tokens saved ~50-90 MB of the job's peak but made its step ~10% longer (each pass's
  fixed cost): it stays one pass.
- ~100M parameters (bf16 autocast), 32 rows × ~30 tokens: passes of 240 tokens saved ~460 MB
  of ~3.1 GB and made the update 17% longer (each pass reads every weight again): with 1.6 GB of
  weights, gradients and AdamW state, it stays one pass.

On a GPU an update stays one pass."""


def cpu_tokens_per_pass(model: torch.nn.Module) -> int:
    """The most padded tokens (rows × the longest row) of one pass of ``model``'s trainer on a
    CPU: ``PASS_MEMORY_CPU`` or the trainer's state (float32 weights; gradients and two AdamW
    moments of the trained ones), whichever is larger, over an estimate of one token's
    activations (per layer 12 hidden-size and 6 MLP-size float32 vectors, fitted to the
    measurements above)."""
    text = model.config.get_text_config()
    hidden = int(text.hidden_size)
    mlp = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    per_token = int(text.num_hidden_layers) * (12 * hidden + 6 * mlp) * 4
    state = sum(p.numel() * (16 if p.requires_grad else 4) for p in model.parameters())
    return max(1, max(PASS_MEMORY_CPU, state) // per_token)


def split_passes(data: Sequence[Datum], tokens: int | None) -> list[list[Datum]]:
    """``data`` in consecutive runs of rows whose padded batch (rows × the longest row's
    length) holds at most ``tokens`` tokens, one row at least; ``tokens`` None: one run."""
    if tokens is None:
        return [list(data)]
    passes: list[list[Datum]] = []
    run: list[Datum] = []
    width = 0
    for datum in data:
        wider = max(width, len(datum.tokens))
        if run and wider * (len(run) + 1) > tokens:
            passes.append(run)
            run, wider = [], len(datum.tokens)
        run.append(datum)
        width = wider
    if run:
        passes.append(run)
    return passes


def pass_share(loss_agg: str, rows: Sequence[Datum], data: Sequence[Datum]) -> float:
    """What a loss aggregated by ``loss_agg`` over ``rows`` is multiplied by to be their part of
    the loss over all of ``data`` (1.0 where ``rows`` is all of it)."""
    if len(rows) == len(data):
        return 1.0

    def counts(of: Sequence[Datum]) -> list[int]:
        return [sum(d.loss_mask[1:]) for d in of]

    return aggregation_denominator(loss_agg, counts(rows)) / aggregation_denominator(
        loss_agg, counts(data)
    )


def merged_metrics(parts: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """The passes' metrics as one update's: each the mean of the passes that report it,
    weighted by their share of the loss (``pass_share``); a token-mean metric is then the whole
    batch's."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for share, metrics in parts:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + share * value
            weights[key] = weights.get(key, 0.0) + share
    return {k: sums[k] / weights[k] if weights[k] else sums[k] for k in sums}
