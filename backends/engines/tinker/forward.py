"""One pass of a Tinker ``forward_backward`` over a batch of data
(``backends/engines/tinker/model.py`` holds the verbs): the model's log-probs of each datum's
targets, its loss, and its backward pass.

Data that repeat a prompt (a GRPO group's samples) run it once: each datum's tokens before its
first loss token (its first nonzero advantage, or weight under ``cross_entropy``) go through the
model once per distinct prefix into a KV cache that is copied to the data that share it
(gradients flow back through the copies), and each datum runs only the rest. Its log-probs are
those of the whole sequence run as one, at every position: the prefix's positions from the
prefix's run, with the datum's own targets. A datum whose prompt no other repeats, one with
images, and every datum of a custom loss or of ``cross_entropy`` without weights run whole.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from flowrl.backends.engines.algorithms import token_logprobs
from flowrl.backends.engines.hf_model import distinct_rows, prefill
from flowrl.backends.engines.tinker.custom_loss import CustomLoss, run_custom
from flowrl.backends.engines.tinker.losses import elementwise_loss
from flowrl.backends.engines.tinker.types import Datum
from flowrl.backends.engines.tinker.vision import vision_kwargs

if TYPE_CHECKING:
    from flowrl.backends.engines.tinker.model import TinkerModel


def run_pass(
    tinker: TinkerModel,
    data: Sequence[Datum],
    loss_fn: str,
    config: dict[str, float],
    custom: CustomLoss | None,
    backward: bool,
) -> tuple[float, list[dict[str, np.ndarray]], dict[str, float]]:
    """``forward_backward``'s pass over ``data`` on ``tinker``'s model (backpropagated when
    ``backward``): its loss, each datum's outputs and the custom loss's metrics."""
    ids, mask, inputs = _batch(data, tinker.device)
    metrics: dict[str, float] = {}
    targets = inputs["target_tokens"].long()
    attention = mask
    if targets.ndim == 3:  # (top-k) distillation targets: K per position
        mask = mask[..., None].expand_as(targets).contiguous()
    with contextlib.nullcontext() if backward else torch.no_grad():
        starts = None if custom is not None else _prompt_lengths(data, loss_fn)
        logp = _batch_logprobs(tinker, data, ids, attention, targets, starts)
        logp = logp * mask
        elementwise = None
        if custom is not None:
            rows = [len(d.tokens) for d in data]
            lps = [logp[i, :n] for i, n in enumerate(rows)]
            values = [[inputs[k][i, :n] for k in custom.inputs[1:]] for i, n in enumerate(rows)]
            loss, metrics = run_custom(custom, lps, values)
        else:
            elementwise = elementwise_loss(loss_fn, logp, inputs, config, mask) * mask
            loss = elementwise.sum()
        if backward:
            loss.backward()
    outputs = []
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        out = {"logprobs": logp[i, :n].detach().cpu().numpy().astype(np.float32)}
        if elementwise is not None:
            out["elementwise_loss"] = elementwise[i, :n].detach().cpu().numpy()
        outputs.append(out)
    return float(loss.detach()), outputs, metrics


def _prompt_lengths(data: Sequence[Datum], loss_fn: str) -> list[int] | None:
    """Each datum's tokens before its first loss token: before its first nonzero advantage (or
    ``cross_entropy`` weight), at most all but its last token; None where the loss reads every
    position (``cross_entropy`` without weights) or a datum holds images."""
    key = "weights" if loss_fn == "cross_entropy" else "advantages"
    if any(d.images or key not in d.inputs for d in data):
        return None
    return [min(_first_nonzero(d.inputs[key]), len(d.tokens) - 1) for d in data]


def _batch_logprobs(
    tinker: TinkerModel,
    data: Sequence[Datum],
    ids: torch.Tensor,
    attention: torch.Tensor,
    targets: torch.Tensor,
    starts: list[int] | None,
) -> torch.Tensor:
    """Each datum's log-probs of its targets: the data whose prompt (``starts``) another datum
    repeats run it once (``_shared_prefix_logprobs``), the others whole."""
    keys = [tuple(d.tokens[:s]) if s else None for d, s in zip(data, starts or [], strict=False)]
    repeats = Counter(keys)
    together = [i for i, k in enumerate(keys) if k is not None and repeats[k] > 1]
    alone = [i for i in range(len(data)) if i not in set(together)]
    parts = []
    if together:
        part = [data[i] for i in together]
        shared = [starts[i] for i in together] if starts else []
        parts.append(
            _shared_prefix_logprobs(tinker.model, part, ids[together], targets[together], shared)
        )
    if alone:  # to their own width
        width = max(len(data[i].tokens) for i in alone)
        sub = ids[alone, :width]
        extra = vision_kwargs(tinker.base.vision, sub, [data[i].images for i in alone])
        logits = tinker.model(input_ids=sub, attention_mask=attention[alone, :width], **extra)
        logp = _logprobs(logits.logits, targets[alone, :width])
        trailing = (0, 0) * (logp.ndim - 2)
        parts.append(torch.nn.functional.pad(logp, (*trailing, 0, ids.shape[1] - width)))
    if len(parts) == 1:
        return parts[0]
    order = torch.tensor(together + alone, device=ids.device)
    return torch.cat(parts)[order.argsort()]


def _shared_prefix_logprobs(
    model: torch.nn.Module,
    data: Sequence[Datum],
    ids: torch.Tensor,
    targets: torch.Tensor,
    starts: list[int],
) -> torch.Tensor:
    """The log-probs of ``targets`` (``(B, T)`` or ``(B, T, K)``) with each distinct prompt
    (``data[b].tokens[: starts[b]]``) run once (the module's docstring)."""
    first, index = distinct_rows([tuple(d.tokens[:s]) for d, s in zip(data, starts, strict=True)])
    device = ids.device
    width = max(starts[i] for i in first)
    prefix = torch.zeros((len(first), width), dtype=torch.long)
    prefix_mask = torch.zeros((len(first), width), dtype=torch.long)
    for u, i in enumerate(first):  # left padding
        prefix[u, width - starts[i] :] = torch.tensor(data[i].tokens[: starts[i]])
        prefix_mask[u, width - starts[i] :] = 1
    prefix, prefix_mask = prefix.to(device), prefix_mask.to(device)
    out = prefill(model, prefix, prefix_mask)
    rows_B = torch.tensor(index, device=device)
    cache = out.past_key_values
    cache.reorder_cache(rows_B)
    s_B = torch.tensor(starts, device=device)
    lengths_B = torch.tensor([len(d.tokens) for d in data], device=device)
    rest = int((lengths_B - s_B).max())
    offsets = torch.arange(rest, device=device)
    rest_mask = (offsets < (lengths_B - s_B).unsqueeze(-1)).long()
    columns = (s_B.unsqueeze(-1) + offsets).clamp(max=ids.shape[1] - 1)
    rest_ids = ids.gather(1, columns).masked_fill(rest_mask == 0, 0)
    logits = model(
        input_ids=rest_ids,
        attention_mask=torch.cat([prefix_mask[rows_B], rest_mask], dim=1),
        position_ids=columns.masked_fill(rest_mask == 0, 0),
        past_key_values=cache,
    ).logits
    t = torch.arange(ids.shape[1], device=device).expand(len(data), -1)
    before = t < s_B.unsqueeze(-1)
    # Position t of datum b: column width - s_b + t of its prefix's run, or t - s_b of its rest.
    in_prefix = (width - s_B.unsqueeze(-1) + t).clamp(0, width - 1)
    in_rest = (t - s_B.unsqueeze(-1)).clamp(0, rest - 1)
    prefix_logp = _picked(out.logits, rows_B, in_prefix, targets)
    rest_logp = _picked(logits, torch.arange(len(data), device=device), in_rest, targets)
    if targets.ndim == 3:
        before = before.unsqueeze(-1)
    return torch.where(before, prefix_logp, rest_logp)


def _picked(
    logits_U_S_V: torch.Tensor,
    rows_B: torch.Tensor,
    columns_B_T: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """``log_softmax(logits)[rows[b], columns[b, t], targets[b, t(, k)]]`` in float32, without
    a ``(B, T, V)`` log-softmax (as ``token_logprobs``: the gathered logit minus logsumexp)."""
    extra = (1,) * (targets.ndim - 2)
    rows = rows_B.view(-1, 1, *extra)
    columns = columns_B_T.view(*columns_B_T.shape, *extra)
    lse = torch.logsumexp(logits_U_S_V.float(), dim=-1)
    return logits_U_S_V[rows, columns, targets].float() - lse[rows, columns]


def _logprobs(logits_B_T_V: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's log-probs of its targets (``(B, T)`` or top-k ``(B, T, K)``)."""
    if targets.ndim == 3:
        return torch.log_softmax(logits_B_T_V.float(), dim=-1).gather(-1, targets)
    return token_logprobs(logits_B_T_V, targets)


def _first_nonzero(values: np.ndarray) -> int:
    """The first position whose entry (or any of its K entries) is nonzero; past the end for
    none."""
    rows = np.asarray(values).reshape(len(values), -1)
    nonzero = np.flatnonzero(np.any(rows != 0, axis=1))
    return int(nonzero[0]) if len(nonzero) else len(rows)


def _batch(data: Sequence[Datum], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The data right-padded: token ids, a mask of real positions, each loss input."""
    width = max(len(d.tokens) for d in data)
    ids = torch.zeros((len(data), width), dtype=torch.long)
    mask = torch.zeros((len(data), width), dtype=torch.float32)
    trailing = {k: v.shape[1:] for d in data for k, v in d.inputs.items()}
    inputs = {
        k: torch.zeros((len(data), width, *rest), dtype=torch.float32)
        for k, rest in trailing.items()
    }
    inputs["target_tokens"] = inputs["target_tokens"].long()
    for i, d in enumerate(data):
        n = len(d.tokens)
        ids[i, :n] = torch.tensor(d.tokens, dtype=torch.long)
        mask[i, :n] = 1.0
        for k, v in d.inputs.items():
            inputs[k][i, :n] = torch.from_numpy(np.array(v)).to(inputs[k].dtype)
    return (
        ids.to(device),
        mask.to(device),
        {k: v.to(device) for k, v in inputs.items()},
    )
