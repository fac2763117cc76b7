"""RL algorithm math as pure functions over tensors, chosen by name from small registries.

Shape suffixes: ``N`` episodes, ``B`` rows of a training batch, ``T`` tokens, ``V`` vocabulary.
Nothing here holds state, touches a model or knows about flows; the trainer composes these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

AdvantageEstimator = Callable[[Tensor, Tensor], Tensor]
"""``(rewards_N, group_ids_N) -> advantages_N``."""
PolicyLoss = Callable[..., tuple[Tensor, dict[str, float]]]
"""``(logprobs_B_T, old_logprobs_B_T, advantages_B, mask_B_T, **kw) -> (loss, metrics)``."""
_F = TypeVar("_F")


def _group_stats(rewards_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-episode group size, group mean and unbiased group std (0 for a group of one).

    Returns three float tensors of shape ``[N]``, each the statistic of the episode's group.
    """
    _, index_N = torch.unique(group_ids_N, return_inverse=True)
    num_groups = int(index_N.max()) + 1 if index_N.numel() else 0
    rewards_N = rewards_N.to(torch.float64)  # sums of squares in float64: no cancellation
    zeros_G = torch.zeros(num_groups, dtype=torch.float64, device=rewards_N.device)
    count_G = zeros_G.index_add(0, index_N, torch.ones_like(rewards_N))
    mean_G = zeros_G.index_add(0, index_N, rewards_N) / count_G
    sq_dev_N = (rewards_N - mean_G[index_N]) ** 2
    sum_sq_G = zeros_G.index_add(0, index_N, sq_dev_N)
    std_G = torch.sqrt(sum_sq_G / (count_G - 1).clamp(min=1))
    return count_G[index_N], mean_G[index_N], std_G[index_N]


def grpo_advantages(
    rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024): ``(r - mean_g) / (std_g + eps)``.

    Args:
        rewards_N: float ``[N]``, one return per episode.
        group_ids_N: int ``[N]``, episodes started from the same prompt share an id (any values).
        eps: added to the std so a group of identical rewards divides 0 by ``eps``.
        scale_by_std: ``False`` keeps only the mean baseline ``r - mean_g`` (Dr. GRPO).

    Returns:
        float ``[N]`` advantages in the dtype of ``rewards_N``.

    The std is the unbiased sample std (Bessel, divides by ``G - 1``), as in TRL's and verl's
    GRPO, so numbers compare side by side. A group of identical rewards, and a group of one
    episode, get advantage 0: there is no relative signal in them.
    """
    _, mean_N, std_N = _group_stats(rewards_N, group_ids_N)
    advantages_N = rewards_N.to(torch.float64) - mean_N
    if scale_by_std:
        advantages_N = advantages_N / (std_N + eps)
    return advantages_N.to(rewards_N.dtype)


def rloo_advantages(rewards_N: Tensor, group_ids_N: Tensor) -> Tensor:
    """Leave-one-out baseline (RLOO, Ahmadian et al. 2024): ``r_i - mean of the others in g``.

    Args:
        rewards_N: float ``[N]``; group_ids_N: int ``[N]`` as in ``grpo_advantages``.

    Returns:
        float ``[N]``; equals ``G / (G - 1) * (r_i - mean_g)``; 0 for a group of one.
    """
    count_N, mean_N, _ = _group_stats(rewards_N, group_ids_N)
    scale_N = count_N / (count_N - 1).clamp(min=1)
    scale_N = torch.where(count_N > 1, scale_N, torch.zeros_like(scale_N))
    return (scale_N * (rewards_N.to(torch.float64) - mean_N)).to(rewards_N.dtype)


def ppo_clip_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B: Tensor,
    mask_B_T: Tensor,
    clip_eps: float = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level PPO-clip loss (Schulman et al. 2017), averaged over all trainable tokens.

    Per token: ``ratio = exp(logp - old_logp)`` and
    ``loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with the episode's
    advantage ``A`` broadcast over its tokens. Aggregation is "token-mean": the sum over tokens
    with ``mask == 1`` divided by their count in the whole batch (long answers weigh more).

    Args:
        logprobs_B_T: float ``[B, T]`` log-probs of the taken tokens under the current policy
            (carries the gradient).
        old_logprobs_B_T: float ``[B, T]`` log-probs under the sampling policy (no gradient).
        advantages_B: float ``[B]`` one advantage per row.
        mask_B_T: ``[B, T]`` 1 for sampled tokens, 0 for prompt, injected and padding tokens.
        clip_eps: half-width of the trust region on the ratio.

    Returns:
        ``(loss, metrics)``: a scalar tensor, and floats ``clip_fraction`` (share of trainable
        tokens where the clipped term is the one taken, i.e. whose gradient is cut),
        ``approx_kl`` (mean of ``old_logp - logp``) and ``ratio_mean``, all over mask-1 tokens.
        With no trainable token the loss is a zero that still backpropagates.
    """
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    old_logprobs_B_T = old_logprobs_B_T.detach()
    advantages_B_1 = advantages_B.detach().to(logprobs_B_T.dtype).unsqueeze(-1)
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    unclipped_B_T = ratio_B_T * advantages_B_1
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - clip_eps, 1.0 + clip_eps) * advantages_B_1
    loss_B_T = -torch.minimum(unclipped_B_T, clipped_B_T)
    num_tokens = mask_B_T.sum().clamp(min=1.0)
    loss = (loss_B_T * mask_B_T).sum() / num_tokens

    def masked_mean(values_B_T: Tensor) -> float:
        return float((values_B_T.detach() * mask_B_T).sum() / num_tokens)

    metrics = {
        "clip_fraction": masked_mean((clipped_B_T < unclipped_B_T).to(mask_B_T.dtype)),
        "approx_kl": masked_mean(old_logprobs_B_T - logprobs_B_T),
        "ratio_mean": masked_mean(ratio_B_T),
    }
    return loss, metrics


def token_logprobs(logits_B_T_V: Tensor, targets_B_T: Tensor) -> Tensor:
    """Log-probability of each target token: ``log_softmax(logits)[b, t, targets[b, t]]``.

    Args:
        logits_B_T_V: float ``[B, T, V]``; row ``t`` is the distribution of ``targets[:, t]``
            (for a causal LM pass ``logits[:, :-1]`` with ``tokens[:, 1:]``).
        targets_B_T: int ``[B, T]`` token ids.

    Returns:
        float32 ``[B, T]`` (computed in float32 even from bf16 logits). Uses
        ``gather - logsumexp`` rather than materialising a ``[B, T, V]`` log-softmax.
    """
    logits_B_T_V = logits_B_T_V.float()
    picked_B_T = torch.gather(logits_B_T_V, -1, targets_B_T.long().unsqueeze(-1)).squeeze(-1)
    return picked_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as ``name`` (KeyError listing the known names)."""
    return _lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (KeyError listing the known names)."""
    return _lookup(POLICY_LOSSES, name, "policy loss")


def _lookup(registry: dict[str, _F], name: str, kind: str) -> _F:
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise KeyError(f"unknown {kind} {name!r}; known: {known}") from None
