"""The Tinker API's losses on a batch's log-probs (``backends/engines/tinker/model.py`` holds their
documented semantics), and which data a loss leaves without a gradient.

A policy loss of ``importance_sampling``, ``ppo``, ``cispo`` or ``gspo`` is its advantage times
a factor on every token, so a datum whose advantages are all 0 (a group whose samples all scored
the same, or a prompt-only datum) has a loss of 0 and no gradient whatever the weights; so has a
``cross_entropy`` datum whose weights are all 0. ``dro``'s penalty and a custom loss depend on
the log-probs alone, so none of theirs is left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flowrl.backends.engines.tinker.types import DEFAULT_CLIP, DEFAULT_DRO_BETA, Datum

_TIMES_ADVANTAGE = frozenset({"importance_sampling", "ppo", "cispo", "gspo"})


def rows_without_gradient(data: Sequence[Datum], loss_fn: str) -> set[int]:
    """The indices of ``data`` whose ``loss_fn`` loss is 0, and its gradient too, whatever the
    model's weights."""
    key = "advantages" if loss_fn in _TIMES_ADVANTAGE else None
    if loss_fn == "cross_entropy":
        key = "weights"  # absent: every token weighs 1
    if key is None:
        return set()
    return {
        i for i, d in enumerate(data) if key in d.inputs and not np.any(np.asarray(d.inputs[key]))
    }


def elementwise_loss(
    loss_fn: str,
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    config: dict,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Each token's loss of ``loss_fn`` (rows are data; ``mask``: their real positions)."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -(weights if weights is not None else mask) * logp
    adv = inputs["advantages"]
    if loss_fn == "dro":
        beta = config.get("beta", DEFAULT_DRO_BETA)
        return -(logp * adv - 0.5 * beta * (logp - inputs["logprobs"]) ** 2)
    if loss_fn == "gspo":
        ratio = _sequence_ratio(logp, inputs, mask)
    else:
        ratio = torch.exp(logp - inputs["logprobs"])
    if loss_fn == "importance_sampling":
        return -ratio * adv
    low = inputs.get(
        "clip_low_threshold",
        torch.full_like(logp, config.get("clip_low_threshold", DEFAULT_CLIP[0])),
    )
    high = inputs.get(
        "clip_high_threshold",
        torch.full_like(logp, config.get("clip_high_threshold", DEFAULT_CLIP[1])),
    )
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    if loss_fn in ("ppo", "gspo"):
        return -torch.minimum(ratio * adv, clipped * adv)
    return -(clipped.detach() * adv * logp)  # cispo


def _sequence_ratio(
    logp: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's ratio of each token (rows are data): the value of its sequence's ratio
    (the geometric mean of the token ratios over the row's ``sequence_ratio_mask``), the
    gradient of its own log-prob."""
    marks = inputs.get("sequence_ratio_mask")
    in_ratio = ((marks != 0) if marks is not None else (inputs["advantages"] != 0)) & (mask != 0)
    in_ratio = in_ratio.to(logp.dtype)
    log_ratio = ((logp.detach() - inputs["logprobs"]) * in_ratio).sum(dim=1, keepdim=True)
    log_ratio = log_ratio / in_ratio.sum(dim=1, keepdim=True).clamp(min=1.0)
    return torch.exp(log_ratio + logp - logp.detach())
