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
"""``(logprobs_B_T, old_logprobs_B_T, advantages_B, mask_B_T, *, clip_eps, clip_eps_high,
loss_agg, weights_B_T) -> (loss, metrics)``: every loss takes the same options."""
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


def dr_grpo_advantages(rewards_N: Tensor, group_ids_N: Tensor) -> Tensor:
    """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r - mean_g``.

    GRPO without the division by the group std, which over-weights groups whose rewards barely
    differ (too easy or too hard prompts). Pair it with ``loss_agg="seq-mean-token-sum"`` to also
    drop GRPO's per-answer length normalisation, as the paper does.

    Args:
        rewards_N: float ``[N]``; group_ids_N: int ``[N]`` as in ``grpo_advantages``.

    Returns:
        float ``[N]``; 0 for a group of one.
    """
    return grpo_advantages(rewards_N, group_ids_N, scale_by_std=False)


def reinforce_pp_advantages(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262), the "-baseline" variant for groups:
    ``(r - mean_g) / (std_batch + eps)``.

    The group mean removes the prompt's difficulty; the *global* batch std (of the centred
    values, unbiased) normalises the scale without GRPO's per-group std, which the paper
    shows is biased and unstable. For one group this equals GRPO's advantage.

    Args:
        rewards_N: float ``[N]``; group_ids_N: int ``[N]`` as in ``grpo_advantages``.

    Returns:
        float ``[N]``; all zeros when every centred reward is 0.
    """
    centred_N = grpo_advantages(rewards_N, group_ids_N, scale_by_std=False).to(torch.float64)
    std = centred_N.std() if centred_N.numel() > 1 else centred_N.new_zeros(())
    return (centred_N / (std + eps)).to(rewards_N.dtype)


# --- loss aggregation and KL ----------------------------------------------------------------


def token_mean(values_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """``sum(v * m) / sum(m)`` over the whole batch: every trainable token weighs the same, so
    long answers weigh more (DAPO, Yu et al. 2025, recommends it). ``[B, T] -> []``."""
    return (values_B_T * mask_B_T).sum() / mask_B_T.sum().clamp(min=1.0)


def seq_mean_token_sum(values_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Sum over each row's tokens, mean over rows: no length normalisation (Dr. GRPO, Liu et
    al. 2025). ``[B, T] -> []``."""
    return (values_B_T * mask_B_T).sum(-1).mean()


def seq_mean_token_mean(values_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Mean over each row's tokens, then over the rows that have any (the original GRPO, Shao
    et al. 2024; GSPO). ``[B, T] -> []``."""
    count_B = mask_B_T.sum(-1)
    row_mean_B = (values_B_T * mask_B_T).sum(-1) / count_B.clamp(min=1.0)
    has_tokens_B = (count_B > 0).to(values_B_T.dtype)
    return (row_mean_B * has_tokens_B).sum() / has_tokens_B.sum().clamp(min=1.0)


LossAggregation = Callable[[Tensor, Tensor], Tensor]
"""``(values_B_T, mask_B_T) -> scalar``."""
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
}


def aggregation_denominator(loss_agg: str, token_counts: list[int]) -> float:
    """What the ``LOSS_AGGREGATIONS`` entry ``loss_agg`` divides a batch's summed terms by, for
    rows with ``token_counts`` trainable tokens each: the token count (token-mean), the row
    count (seq-mean-token-sum) or the count of rows with a token (seq-mean-token-mean).

    A loss taken over some of a batch's rows, times ``denominator(those rows) /
    denominator(all rows)``, is the whole batch's loss less the other rows' terms: the trainer
    leaves out rows whose every term is 0 (advantage 0) that way, with the same gradient.
    """
    _lookup(LOSS_AGGREGATIONS, loss_agg, "loss aggregation")
    if loss_agg == "token-mean":
        return float(max(sum(token_counts), 1))
    if loss_agg == "seq-mean-token-sum":
        return float(len(token_counts))
    return float(max(sum(1 for n in token_counts if n > 0), 1))


def kl_k1(logprobs_B_T: Tensor, ref_logprobs_B_T: Tensor) -> Tensor:
    """``log p - log p_ref``: unbiased per-sample estimate of KL(p || p_ref), can be negative
    (Schulman 2020, "Approximating KL Divergence"). ``[B, T] -> [B, T]``."""
    return logprobs_B_T - ref_logprobs_B_T


def kl_k2(logprobs_B_T: Tensor, ref_logprobs_B_T: Tensor) -> Tensor:
    """``0.5 * (log p - log p_ref)^2``: biased, always >= 0, low variance (Schulman 2020)."""
    return 0.5 * (logprobs_B_T - ref_logprobs_B_T) ** 2


def kl_k3(logprobs_B_T: Tensor, ref_logprobs_B_T: Tensor) -> Tensor:
    """``exp(d) - d - 1`` with ``d = log p_ref - log p``: unbiased and >= 0 (Schulman 2020; the
    GRPO paper's KL term). ``d`` is clamped to [-20, 20] so one outlier cannot overflow."""
    d_B_T = (ref_logprobs_B_T - logprobs_B_T).clamp(-20.0, 20.0)
    return torch.exp(d_B_T) - d_B_T - 1.0


def mismatch_kl(logprobs_B_T: Tensor, sampler_logprobs_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """KL(sampler || trainer) over the sampled tokens: the token-mean of the k3 estimate
    ``exp(d) - d - 1`` with ``d = logp_trainer - logp_sampler`` (the tokens were drawn by the
    sampler, so k3 is unbiased for this direction). ``[B, T] -> []``, no gradient.

    0 when the two agree; about ``mean(d^2) / 2`` for small ``d``. After a weight sync it
    measures what precision (bf16 sampler, float32 master weights) and kernels change.
    """
    kl_B_T = kl_k3(sampler_logprobs_B_T.detach(), logprobs_B_T.detach())
    return token_mean(kl_B_T, mask_B_T.to(kl_B_T.dtype))


KLEstimator = Callable[[Tensor, Tensor], Tensor]
"""``(logprobs_B_T, ref_logprobs_B_T) -> kl_B_T``."""
KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalized_rewards(
    rewards_N: Tensor,
    logprobs_N_T: Tensor,
    ref_logprobs_N_T: Tensor,
    mask_N_T: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """KL in the reward (InstructGPT, Ouyang et al. 2022): ``r - kl_coef * sum_t kl_t``.

    Args:
        rewards_N: float ``[N]`` episode returns.
        logprobs_N_T: float ``[N, T]`` log-probs of the sampled tokens under the sampling policy.
        ref_logprobs_N_T: float ``[N, T]`` the same tokens under the reference model.
        mask_N_T: ``[N, T]`` 1 for sampled tokens.
        kl_coef: weight of the penalty; estimator: a ``KL_ESTIMATORS`` name.

    Returns:
        ``(penalised_rewards_N, kl_N)`` where ``kl_N`` is each episode's summed estimate.
    """
    kl_N_T = _lookup(KL_ESTIMATORS, estimator, "KL estimator")(logprobs_N_T, ref_logprobs_N_T)
    kl_N = (kl_N_T * mask_N_T.to(kl_N_T.dtype)).sum(-1)
    return rewards_N - kl_coef * kl_N.to(rewards_N.dtype), kl_N


# --- policy losses ----------------------------------------------------------------------------


def _loss_metrics(
    ratio_B_T: Tensor, logprobs_B_T: Tensor, old_B_T: Tensor, clipped_B_T: Tensor, mask_B_T: Tensor
) -> dict[str, float]:
    """``clip_fraction``, ``approx_kl`` (mean ``old - logp``) and ``ratio_mean`` over mask-1."""
    return {
        "clip_fraction": float(token_mean(clipped_B_T.to(mask_B_T.dtype), mask_B_T)),
        "approx_kl": float(token_mean((old_B_T - logprobs_B_T).detach(), mask_B_T)),
        "ratio_mean": float(token_mean(ratio_B_T.detach(), mask_B_T)),
    }


def _weighted(loss_B_T: Tensor, weights_B_T: Tensor | None) -> Tensor:
    """``loss_B_T * sg(weights_B_T)``; ``None`` returns ``loss_B_T`` itself (bit-identical)."""
    return loss_B_T if weights_B_T is None else loss_B_T * weights_B_T.detach()


def _behaviour_ratios(
    prox_B_T: Tensor, behaviour_B_T: Tensor, mask_B_T: Tensor
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``rho = exp(logp_prox - logp_behaviour)`` per token (detached), the mask as floats, and
    ``is_ratio_mean`` / ``is_ratio_min`` / ``is_ratio_max`` of ``rho`` over mask-1 tokens (0
    with none)."""
    mask_B_T = mask_B_T.to(prox_B_T.dtype)
    rho_B_T = torch.exp(prox_B_T.detach() - behaviour_B_T.detach())
    kept = rho_B_T[mask_B_T > 0]
    stats = {
        "is_ratio_mean": float(kept.mean()) if kept.numel() else 0.0,
        "is_ratio_min": float(kept.min()) if kept.numel() else 0.0,
        "is_ratio_max": float(kept.max()) if kept.numel() else 0.0,
    }
    return rho_B_T, mask_B_T, stats


def truncated_is_weights(
    trainer_old_B_T: Tensor, sampler_B_T: Tensor, mask_B_T: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; Espeholt et al. 2018's truncation).

    The tokens were sampled by the behaviour policy ``pi_sampler`` (the sampling engine's
    weights, which differ from the trainer's by kernels and precision, and by the updates it
    is behind when rollouts run ahead), not by the trainer's ``pi_old``. TIS takes the policy
    loss's ratio against the trainer's own ``pi_old`` and corrects the sampling per token with
    ``w = min(exp(logp_trainer_old - logp_sampler), cap)``: the cap bounds the variance, at
    the cost of a small bias on the tokens it truncates.

    Args:
        trainer_old_B_T: float ``[B, T]`` log-probs of the sampled tokens under the trainer's
            policy before the update (no gradient).
        sampler_B_T: float ``[B, T]`` the same tokens' log-probs reported by the sampler.
        mask_B_T: ``[B, T]`` 1 for sampled tokens that have sampler log-probs.
        cap: ``C > 1``, the truncation.

    Returns:
        ``(weights_B_T, metrics)``: float ``[B, T]`` weights, detached, 1 where the mask is 0;
        floats ``tis_weight_mean`` (mean ``w``) and ``tis_clip_frac`` (share of tokens where
        ``w`` was capped, i.e. ``exp(...) > C``), both over mask-1 tokens (0 with none), and
        the ratio's statistics (``_behaviour_ratios``).
    """
    if not cap > 1.0:
        raise ValueError(f"truncated importance sampling needs cap > 1, got {cap}")
    raw_B_T, mask_B_T, stats = _behaviour_ratios(trainer_old_B_T, sampler_B_T, mask_B_T)
    capped_B_T = raw_B_T > cap
    weights_B_T = torch.where(mask_B_T > 0, raw_B_T.clamp(max=cap), torch.ones_like(raw_B_T))
    metrics = {
        "tis_weight_mean": float(token_mean(weights_B_T, mask_B_T)),
        "tis_clip_frac": float(token_mean(capped_B_T.to(mask_B_T.dtype), mask_B_T)),
    }
    return weights_B_T, metrics | stats


def masked_is_weights(
    trainer_old_B_T: Tensor, sampler_B_T: Tensor, mask_B_T: Tensor, band: tuple[float, float]
) -> tuple[Tensor, dict[str, float]]:
    """Masked importance sampling (MIS, token level, as verl's rollout correction in its mask
    mode): per token ``rho = exp(logp_trainer_old - logp_sampler)``; a token whose ``rho``
    leaves ``band = (low, high)`` is dropped from the loss (weight 0), the others are weighted
    by ``rho`` itself. Unlike TIS nothing is biased by a cap; tokens the behaviour policy
    sampled far off the trainer's are left out instead.

    Returns:
        ``(weights_B_T, metrics)``: float ``[B, T]`` weights, detached, 1 where the mask is 0;
        ``mis_weight_mean`` (mean weight, dropped tokens counted as 0) and ``mis_masked_frac``
        (share of tokens dropped) over mask-1 tokens, and the ratio's statistics.
    """
    low, high = band
    if not 0.0 < low < 1.0 < high:
        raise ValueError(f"masked importance sampling needs 0 < low < 1 < high, got {band}")
    raw_B_T, mask_B_T, stats = _behaviour_ratios(trainer_old_B_T, sampler_B_T, mask_B_T)
    return _dropping("mis", raw_B_T, (raw_B_T < low) | (raw_B_T > high), mask_B_T, stats)


def decoupled_is_weights(
    prox_B_T: Tensor, behaviour_B_T: Tensor, mask_B_T: Tensor, cap: float | None
) -> tuple[Tensor, dict[str, float]]:
    """The behaviour weights of decoupled PPO (AReaL; Fu et al. 2025, after Hilton et al.
    2022's proximal policy): the PPO ratio is taken against a proximal policy ``pi_prox``
    between the behaviour policy and the current one (here the trainer's weights before this
    update), so the trust region is around ``pi_prox``, however stale the behaviour policy;
    each token's clipped term is then weighted by ``w = pi_prox / pi_behaviour``, unclipped.
    With ``cap``, tokens whose ``w`` exceeds it are dropped (weight 0), as AReaL's
    ``behav_imp_weight_cap`` does.

    Returns:
        ``(weights_B_T, metrics)``: float ``[B, T]`` weights, detached, 1 where the mask is 0;
        ``decoupled_weight_mean`` and ``decoupled_masked_frac`` (tokens dropped by the cap)
        over mask-1 tokens, and the ratio's statistics.
    """
    if cap is not None and not cap > 1.0:
        raise ValueError(f"decoupled PPO's weight cap must be > 1, got {cap}")
    raw_B_T, mask_B_T, stats = _behaviour_ratios(prox_B_T, behaviour_B_T, mask_B_T)
    over_B_T = raw_B_T > cap if cap is not None else torch.zeros_like(raw_B_T, dtype=torch.bool)
    return _dropping("decoupled", raw_B_T, over_B_T, mask_B_T, stats)


def _dropping(
    name: str, raw_B_T: Tensor, dropped_B_T: Tensor, mask_B_T: Tensor, stats: dict[str, float]
) -> tuple[Tensor, dict[str, float]]:
    """Weights ``rho``, 0 where ``dropped_B_T``, 1 where the mask is 0; with
    ``<name>_weight_mean`` and ``<name>_masked_frac`` over mask-1 tokens, and ``stats``."""
    kept_B_T = torch.where(dropped_B_T, torch.zeros_like(raw_B_T), raw_B_T)
    weights_B_T = torch.where(mask_B_T > 0, kept_B_T, torch.ones_like(raw_B_T))
    metrics = {
        f"{name}_weight_mean": float(token_mean(weights_B_T, mask_B_T)),
        f"{name}_masked_frac": float(token_mean(dropped_B_T.to(mask_B_T.dtype), mask_B_T)),
    }
    return weights_B_T, metrics | stats


OffPolicyCorrection = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, dict[str, float]]]
"""``(trainer_old_B_T, sampler_B_T, mask_B_T) -> (weights_B_T, metrics)``."""


def off_policy_correction(
    name: str, cap: float | None = None, band: tuple[float, float] = (0.5, 2.0)
) -> OffPolicyCorrection:
    """The correction ``name`` (``OFF_POLICY_CORRECTIONS``) with its parameters: ``tis`` (its
    truncation ``cap``), ``mis`` (its ``band``), ``decoupled`` (its drop ``cap``, or none)."""
    if name == "tis":
        if cap is None:
            raise ValueError("truncated importance sampling needs a cap")
        return lambda old, sampler, mask: truncated_is_weights(old, sampler, mask, cap)
    if name == "mis":
        return lambda old, sampler, mask: masked_is_weights(old, sampler, mask, band)
    if name == "decoupled":
        return lambda old, sampler, mask: decoupled_is_weights(old, sampler, mask, cap)
    raise KeyError(f"unknown off-policy correction {name!r}; known: decoupled, mis, tis")


OFF_POLICY_CORRECTIONS = ("tis", "mis", "decoupled")


def ppo_clip_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B: Tensor,
    mask_B_T: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    loss_agg: str = "token-mean",
    weights_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level PPO-clip loss (Schulman et al. 2017) with DAPO's asymmetric clip-higher.

    Per token: ``ratio = exp(logp - old_logp)`` and
    ``loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)`` with the
    episode's advantage ``A`` broadcast over its tokens. ``clip_eps_high > clip_eps`` ("clip
    higher", Yu et al. 2025, DAPO: 0.2 / 0.28) lets unlikely tokens with ``A > 0`` grow further,
    which keeps entropy from collapsing; ``None`` means symmetric.

    Args:
        logprobs_B_T: float ``[B, T]`` log-probs of the taken tokens under the current policy
            (carries the gradient).
        old_logprobs_B_T: float ``[B, T]`` log-probs under the sampling policy (no gradient).
        advantages_B: float ``[B]`` one advantage per row.
        mask_B_T: ``[B, T]`` 1 for sampled tokens, 0 for prompt, injected and padding tokens.
        clip_eps: lower half-width of the trust region on the ratio.
        clip_eps_high: upper half-width (``None``: ``clip_eps``).
        loss_agg: a ``LOSS_AGGREGATIONS`` name; "token-mean" divides by the batch's token count.
        weights_B_T: float ``[B, T]`` per-token factors on ``loss_t`` (no gradient), e.g.
            ``truncated_is_weights``; ``None``: all ones.

    Returns:
        ``(loss, metrics)``: a scalar tensor, and floats ``clip_fraction`` (share of trainable
        tokens where the clipped term is the one taken, i.e. whose gradient is cut),
        ``approx_kl`` (mean of ``old_logp - logp``) and ``ratio_mean``, all over mask-1 tokens.
        With no trainable token the loss is a zero that still backpropagates.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    old_logprobs_B_T = old_logprobs_B_T.detach()
    advantages_B_1 = advantages_B.detach().to(logprobs_B_T.dtype).unsqueeze(-1)
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    unclipped_B_T = ratio_B_T * advantages_B_1
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - clip_eps, 1.0 + high) * advantages_B_1
    loss_B_T = _weighted(-torch.minimum(unclipped_B_T, clipped_B_T), weights_B_T)
    loss = _lookup(LOSS_AGGREGATIONS, loss_agg, "loss aggregation")(loss_B_T, mask_B_T)
    cut_B_T = clipped_B_T.detach() < unclipped_B_T.detach()
    return loss, _loss_metrics(ratio_B_T, logprobs_B_T, old_logprobs_B_T, cut_B_T, mask_B_T)


def cispo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B: Tensor,
    mask_B_T: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    loss_agg: str = "token-mean",
    weights_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a truncated, detached importance weight.

    ``loss_t = -sg(min(ratio, 1 + clip_eps_high)) * A * logp``. Unlike PPO-clip no token's
    gradient is ever dropped: a clipped token still gets the (capped) weight, so rare
    "fork" tokens keep learning. The weight is truncated importance sampling (Ionides 2008;
    Yao et al. 2025 use the same cap for sampler/trainer mismatch). ``clip_eps`` is unused
    (no lower bound, as in the paper); it is accepted so every loss takes the same options.

    Args/Returns: as ``ppo_clip_loss``; ``clip_fraction`` is the share of capped tokens.
    """
    del clip_eps
    high = 0.2 if clip_eps_high is None else clip_eps_high
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    old_logprobs_B_T = old_logprobs_B_T.detach()
    advantages_B_1 = advantages_B.detach().to(logprobs_B_T.dtype).unsqueeze(-1)
    ratio_B_T = torch.exp(logprobs_B_T.detach() - old_logprobs_B_T)
    weight_B_T = ratio_B_T.clamp(max=1.0 + high)
    loss_B_T = _weighted(-weight_B_T * advantages_B_1 * logprobs_B_T, weights_B_T)
    loss = _lookup(LOSS_AGGREGATIONS, loss_agg, "loss aggregation")(loss_B_T, mask_B_T)
    capped_B_T = ratio_B_T > 1.0 + high
    return loss, _loss_metrics(ratio_B_T, logprobs_B_T, old_logprobs_B_T, capped_B_T, mask_B_T)


def gspo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B: Tensor,
    mask_B_T: Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    loss_agg: str = "seq-mean-token-mean",
    weights_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO-clip on a
    sequence-level ratio ``s_b = exp(mean_t (logp - old_logp))`` over the row's mask-1 tokens.

    Implemented as GSPO-token: ``s_b,t = sg(s_b) * exp(logp_t - sg(logp_t))`` has the value of
    ``s_b`` and, with one advantage per row and ``seq-mean-token-mean``, exactly GSPO's
    gradient. ``loss_t = -min(s * A, clip(s, 1 - clip_eps, 1 + clip_eps_high) * A)``. The
    paper's clip range is tiny (3e-4 / 4e-4): a sequence ratio moves far less than a token's.

    Args/Returns: as ``ppo_clip_loss``; the ratio metrics are of the sequence ratio, and
    ``weights_B_T`` scales each token's term (the sequence ratio itself is unweighted).
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    old_logprobs_B_T = old_logprobs_B_T.detach()
    advantages_B_1 = advantages_B.detach().to(logprobs_B_T.dtype).unsqueeze(-1)
    count_B = mask_B_T.sum(-1).clamp(min=1.0)
    log_seq_ratio_B = ((logprobs_B_T - old_logprobs_B_T) * mask_B_T).sum(-1) / count_B
    log_ratio_B_T = log_seq_ratio_B.detach().unsqueeze(-1) + logprobs_B_T - logprobs_B_T.detach()
    ratio_B_T = torch.exp(log_ratio_B_T)
    unclipped_B_T = ratio_B_T * advantages_B_1
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - clip_eps, 1.0 + high) * advantages_B_1
    loss_B_T = _weighted(-torch.minimum(unclipped_B_T, clipped_B_T), weights_B_T)
    loss = _lookup(LOSS_AGGREGATIONS, loss_agg, "loss aggregation")(loss_B_T, mask_B_T)
    cut_B_T = clipped_B_T.detach() < unclipped_B_T.detach()
    return loss, _loss_metrics(ratio_B_T, logprobs_B_T, old_logprobs_B_T, cut_B_T, mask_B_T)


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
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
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
