"""Algorithm math against numbers worked out by hand, and slow loops against the vectorised code."""

import math
import statistics

import pytest
import torch

from flowrl.backends.engines.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    cispo_loss,
    decoupled_is_weights,
    dr_grpo_advantages,
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    gspo_loss,
    kl_penalized_rewards,
    masked_is_weights,
    off_policy_correction,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    token_logprobs,
    truncated_is_weights,
)

torch.set_num_threads(1)


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> bool:
    return torch.allclose(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol)


# --- advantages -------------------------------------------------------------------------------


def test_grpo_one_group_matches_hand_values():
    # rewards [1, 0, 1, 1]: mean 0.75; deviations [.25, -.75, .25, .25];
    # unbiased var = (3 * .0625 + .5625) / 3 = .25 -> std .5; advantages = deviation / .5
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    advantages = grpo_advantages(rewards, torch.zeros(4, dtype=torch.long))
    assert close(advantages, [0.5, -1.5, 0.5, 0.5])
    assert advantages.dtype == torch.float32


def test_grpo_two_interleaved_groups_and_identical_rewards_give_zero():
    # group 7: rewards [1, 0] -> mean .5, unbiased std sqrt(.5 / 1) = .70711 -> +-.5 / .70711
    # group 3: rewards [2, 2, 2] -> all equal -> 0 / (0 + eps) = 0
    rewards = torch.tensor([1.0, 2.0, 0.0, 2.0, 2.0])
    group_ids = torch.tensor([7, 3, 7, 3, 3])
    assert close(grpo_advantages(rewards, group_ids), [0.70711, 0.0, -0.70711, 0.0, 0.0])


def test_grpo_singleton_group_has_no_signal_and_mean_only_variant():
    # a group of one: r - mean = 0 (no NaN from the unbiased std of one sample)
    assert close(grpo_advantages(torch.tensor([5.0]), torch.tensor([0])), [0.0])
    # scale_by_std=False keeps r - mean_g: [1, 0, 1, 1] - .75
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mean_only = grpo_advantages(rewards, torch.zeros(4, dtype=torch.long), scale_by_std=False)
    assert close(mean_only, [0.25, -0.75, 0.25, 0.25])


def test_rloo_matches_hand_values():
    # [1, 0, 1, 1]: episode 0's others [0, 1, 1] mean 2/3 -> 1/3; episode 1's others mean 1 -> -1
    # group 5 has one episode -> 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0])
    group_ids = torch.tensor([0, 0, 0, 0, 5])
    assert close(rloo_advantages(rewards, group_ids), [1 / 3, -1.0, 1 / 3, 1 / 3, 0.0])


def _grpo_slow(rewards: list[float], groups: list[int], eps: float) -> list[float]:
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        std = statistics.stdev(members) if len(members) > 1 else 0.0
        out.append((r - statistics.fmean(members)) / (std + eps))
    return out


def _rloo_slow(rewards: list[float], groups: list[int]) -> list[float]:
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        others = [
            x for j, (x, h) in enumerate(zip(rewards, groups, strict=True)) if h == g and j != i
        ]
        out.append(r - statistics.fmean(others) if others else 0.0)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_advantages_vectorised_equal_slow_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (40,), generator=gen).float() + torch.rand(40, generator=gen)
    groups = torch.randint(0, 9, (40,), generator=gen)
    r, g = rewards.tolist(), groups.tolist()
    assert close(grpo_advantages(rewards, groups, eps=1e-4), _grpo_slow(r, g, 1e-4))
    assert close(rloo_advantages(rewards, groups), _rloo_slow(r, g))


# --- PPO clip ---------------------------------------------------------------------------------

# Hand example, clip_eps = .2. Row 0 has A = +1, row 1 has A = -2; token (1, 2) is masked out.
#   token  ratio  ratio*A  clip(ratio)*A  min    loss   clipped term taken?
#   (0,0)  1.5    1.5      1.2            1.2    -1.2   yes
#   (0,1)  1.0    1.0      1.0            1.0    -1.0   no
#   (0,2)  0.5    0.5      0.8            0.5    -0.5   no (A > 0: a low ratio is not clipped)
#   (1,0)  0.5   -1.0     -1.6           -1.6     1.6   yes
#   (1,1)  1.1   -2.2     -2.2           -2.2     2.2   no
#   (1,2)  3.0   (masked: would be -6 vs -2.4 -> loss 6, must not count)
# token-mean loss = (-1.2 - 1.0 - 0.5 + 1.6 + 2.2) / 5 = 1.1 / 5 = .22
# clip_fraction = 2 / 5; ratio_mean = (1.5 + 1 + .5 + .5 + 1.1) / 5 = .92
# approx_kl = mean(old - new) = -(ln 1.5 + 0 + 2 ln .5 + ln 1.1) / 5 = .885519 / 5 = .177104
# d loss / d logp = -ratio * A / 5 where unclipped, 0 where clipped or masked:
#   (0,1) -.2, (0,2) -.1, (1,1) +.44
RATIOS = [[1.5, 1.0, 0.5], [0.5, 1.1, 3.0]]


def _hand_batch():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.7, -2.5]])
    new = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return new, old, advantages, mask


def test_ppo_clip_matches_hand_values():
    new, old, advantages, mask = _hand_batch()
    loss, metrics = ppo_clip_loss(new, old, advantages, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.22, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.4)
    assert metrics["ratio_mean"] == pytest.approx(0.92, abs=1e-6)
    assert metrics["approx_kl"] == pytest.approx(0.177104, abs=1e-6)
    loss.backward()
    assert close(new.grad, [[0.0, -0.2, -0.1], [0.0, 0.44, 0.0]], tol=1e-6)


def test_ppo_clip_ignores_masked_tokens_and_handles_an_empty_mask():
    new, old, advantages, _ = _hand_batch()
    empty = torch.zeros(2, 3)
    loss, metrics = ppo_clip_loss(new, old, advantages, empty)
    loss.backward()
    assert loss.item() == 0.0 and metrics == {"clip_fraction": 0, "approx_kl": 0, "ratio_mean": 0}
    assert torch.equal(new.grad, torch.zeros(2, 3))
    # changing a masked token's log-prob changes nothing
    new, old, advantages, mask = _hand_batch()
    shifted = new.detach().clone()
    shifted[1, 2] += 5.0
    assert ppo_clip_loss(shifted, old, advantages, mask)[0].item() == pytest.approx(0.22, abs=1e-6)


def test_ppo_clip_at_old_policy_is_minus_mean_advantage():
    # ratio 1 everywhere: loss = -(token mean of A) = -(3 * 1 + 2 * -2) / 5 = .2, nothing clipped
    _, old, advantages, mask = _hand_batch()
    loss, metrics = ppo_clip_loss(old.clone(), old, advantages, mask)
    assert loss.item() == pytest.approx(0.2, abs=1e-6)
    assert metrics == pytest.approx({"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0})


def _ppo_slow(new, old, adv, mask, eps):
    total, count, clipped = 0.0, 0, 0
    for b in range(len(new)):
        for t in range(len(new[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(new[b][t] - old[b][t])
            surrogate = ratio * adv[b]
            clipped_surrogate = min(max(ratio, 1 - eps), 1 + eps) * adv[b]
            total += -min(surrogate, clipped_surrogate)
            clipped += clipped_surrogate < surrogate
            count += 1
    return total / count, clipped / count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_clip_vectorised_equals_slow_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 11, generator=gen, dtype=torch.float64) * 3
    new = old + torch.randn(6, 11, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 11, generator=gen) > 0.3).long()
    loss, metrics = ppo_clip_loss(new, old, adv, mask, clip_eps=0.15)
    slow_loss, slow_clip = _ppo_slow(new.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.15)
    assert loss.item() == pytest.approx(slow_loss, abs=1e-9)
    assert metrics["clip_fraction"] == pytest.approx(slow_clip, abs=1e-9)


# --- token log-probs --------------------------------------------------------------------------


def test_token_logprobs_hand_values():
    # logits [0, ln 3] -> probs [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    targets = torch.tensor([[1, 0]])
    assert close(token_logprobs(logits, targets), [[math.log(0.75), math.log(0.25)]])


def test_token_logprobs_equal_slow_log_softmax_and_are_float32_from_bf16():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 17, generator=gen)
    targets = torch.randint(0, 17, (3, 5), generator=gen)
    slow = [
        [torch.log_softmax(logits[b, t], -1)[targets[b, t]].item() for t in range(5)]
        for b in range(3)
    ]
    assert close(token_logprobs(logits, targets), slow)
    assert token_logprobs(logits.bfloat16(), targets).dtype == torch.float32


# --- registries -------------------------------------------------------------------------------


def test_registries_resolve_by_name_and_reject_unknown_names_listing_known_ones():
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    assert set(POLICY_LOSSES) == {"ppo_clip", "cispo", "gspo"}
    with pytest.raises(KeyError, match="dr_grpo, grpo, reinforce_pp, rloo"):
        get_advantage_estimator("gae")
    with pytest.raises(KeyError, match="ppo_clip"):
        get_policy_loss("dpo")


def test_config_validation_names_every_registered_algorithm_and_no_other():
    # Job configs are validated where torch is not imported, against these names.
    from flowrl.backends import types

    assert types.ADVANTAGE_NAMES == tuple(ADVANTAGE_ESTIMATORS)
    assert types.POLICY_LOSS_NAMES == tuple(POLICY_LOSSES)
    assert types.LOSS_AGGREGATION_NAMES == tuple(LOSS_AGGREGATIONS)
    assert types.KL_ESTIMATOR_NAMES == tuple(KL_ESTIMATORS)


# --- Dr. GRPO and REINFORCE++ -----------------------------------------------------------------


def test_dr_grpo_is_the_group_mean_baseline_without_std():
    # group 7: [1, 0] mean .5 -> [+.5, -.5]; group 3: [2, 2, 2] -> 0 (GRPO would give +-.70711)
    rewards = torch.tensor([1.0, 2.0, 0.0, 2.0, 2.0])
    group_ids = torch.tensor([7, 3, 7, 3, 3])
    assert close(dr_grpo_advantages(rewards, group_ids), [0.5, 0.0, -0.5, 0.0, 0.0])


def test_reinforce_pp_centres_per_group_and_scales_by_the_batch_std():
    # group 0: [1, 0] -> centred [.5, -.5]; group 1: [3, 1] -> centred [1, -1]
    # batch of centred values [.5, -.5, 1, -1]: mean 0, unbiased var (.25+.25+1+1)/3 = .83333,
    # std .91287 -> [.54772, -.54772, 1.09545, -1.09545] (GRPO would give +-.70711 in both)
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    assert close(
        reinforce_pp_advantages(rewards, group_ids), [0.54772, -0.54772, 1.09545, -1.09545]
    )
    # no signal at all: zeros, no NaN
    assert close(reinforce_pp_advantages(torch.ones(4), group_ids), [0.0] * 4)


# --- loss aggregation and KL ------------------------------------------------------------------


def test_loss_aggregations_match_hand_values():
    # rows [1, 2, 3] (all tokens) and [4, (5), (6)] (one token):
    # token-mean (1+2+3+4)/4 = 2.5; seq-mean-token-sum (6 + 4)/2 = 5;
    # seq-mean-token-mean (2 + 4)/2 = 3
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    got = {name: float(agg(values, mask)) for name, agg in LOSS_AGGREGATIONS.items()}
    assert got == pytest.approx(
        {"token-mean": 2.5, "seq-mean-token-sum": 5.0, "seq-mean-token-mean": 3.0}
    )


def test_kl_estimators_match_hand_values():
    # p = .5, p_ref = .25: k1 = ln 2 = .693147; k2 = .5 (ln 2)^2 = .240227;
    # k3 = p_ref/p - ln(p_ref/p) - 1 = .5 + .693147 - 1 = .193147. Equal policies: all 0.
    logp, ref = torch.tensor([[math.log(0.5), -1.0]]), torch.tensor([[math.log(0.25), -1.0]])
    assert close(KL_ESTIMATORS["k1"](logp, ref), [[0.693147, 0.0]])
    assert close(KL_ESTIMATORS["k2"](logp, ref), [[0.240227, 0.0]])
    assert close(KL_ESTIMATORS["k3"](logp, ref), [[0.193147, 0.0]])


def test_kl_in_the_reward_sums_over_sampled_tokens():
    # episode 0: tokens (p .5 vs ref .25, equal) -> k1 = ln 2 + 0; episode 1: second token is
    # masked (its -5 gap must not count) -> ln 2. coef .1: rewards [1, 0] - .069315
    logp = torch.tensor([[math.log(0.5), -1.0], [math.log(0.5), 0.0]])
    ref = torch.tensor([[math.log(0.25), -1.0], [math.log(0.25), -5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, kl = kl_penalized_rewards(torch.tensor([1.0, 0.0]), logp, ref, mask, 0.1, "k1")
    assert close(kl, [0.693147, 0.693147])
    assert close(rewards, [1 - 0.0693147, -0.0693147])


# --- clip-higher, aggregation options, CISPO, GSPO (on the PPO hand batch above) -------------


def test_ppo_clip_higher_lets_positive_advantage_tokens_rise_further():
    # clip range [.8, 1.6]: token (0,0) ratio 1.5, A = +1 is no longer clipped -> loss -1.5;
    # token (1,0) ratio .5, A = -2 is still clipped at .8 -> 1.6.
    # loss = (-1.5 - 1.0 - .5 + 1.6 + 2.2) / 5 = .16; clip_fraction 1/5; grad (0,0) = -1.5/5
    new, old, advantages, mask = _hand_batch()
    loss, metrics = ppo_clip_loss(new, old, advantages, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(0.16, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.2)
    loss.backward()
    assert close(new.grad, [[-0.3, -0.2, -0.1], [0.0, 0.44, 0.0]], tol=1e-6)


def test_ppo_clip_sequence_aggregations():
    # per-token losses: row 0 [-1.2, -1.0, -.5] (sum -2.7, mean -.9); row 1 [1.6, 2.2] (3.8, 1.9)
    # seq-mean-token-sum (-2.7 + 3.8)/2 = .55; seq-mean-token-mean (-.9 + 1.9)/2 = .5
    new, old, advantages, mask = _hand_batch()
    sums = ppo_clip_loss(new, old, advantages, mask, loss_agg="seq-mean-token-sum")[0]
    means = ppo_clip_loss(new, old, advantages, mask, loss_agg="seq-mean-token-mean")[0]
    assert sums.item() == pytest.approx(0.55, abs=1e-6)
    assert means.item() == pytest.approx(0.5, abs=1e-6)


def test_cispo_keeps_every_tokens_gradient_with_a_capped_weight():
    # weight = min(ratio, 1.2) detached: [[1.2, 1, .5], [.5, 1.1, -]]; d loss/d logp = -w A / 5:
    # (0,0) -.24, (0,1) -.2, (0,2) -.1, (1,0) +.2, (1,1) +.44 -- where PPO-clip gives (0,0) and
    # (1,0) no gradient at all. new logp = old + ln ratio, so the loss value is
    # -(1.2*-.594535 - 2 + .5*-1.193147 + (.5*-2)*-.993147 + (1.1*-2)*-1.604690) / 5 = -.242690
    new, old, advantages, mask = _hand_batch()
    loss, metrics = cispo_loss(new, old, advantages, mask, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-0.242690, abs=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.2)  # only (0,0) is capped
    loss.backward()
    assert close(new.grad, [[-0.24, -0.2, -0.1], [0.2, 0.44, 0.0]], tol=1e-6)


def test_gspo_uses_one_ratio_per_sequence():
    # row 0: s = exp(mean(ln 1.5, 0, ln .5)) = .908560, A = +1 -> inside [.8, 1.2]: -.908560
    # row 1: s = exp(mean(ln .5, ln 1.1)) = .741620 (masked token ignored), A = -2:
    #   min(-1.483240, .8 * -2) = -1.6 -> loss 1.6, clipped
    # seq-mean-token-mean: (-.908560 + 1.6) / 2 = .345720
    # grad: row 0 tokens each -s/(3 tokens * 2 rows) = -.151427; row 1 clipped -> 0
    new, old, advantages, mask = _hand_batch()
    loss, metrics = gspo_loss(new, old, advantages, mask, clip_eps=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(0.345720, abs=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)  # row 1's two tokens
    loss.backward()
    assert close(new.grad, [[-0.151427] * 3, [0.0, 0.0, 0.0]], tol=1e-5)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_at_the_old_policy_pushes_up_positive_advantages(name):
    # ratio 1 everywhere: no clipping anywhere; the gradient on a token is -A / 5 (token-mean),
    # so gradient descent raises log-probs of A > 0 rows and lowers those of A < 0 rows.
    _, old, advantages, mask = _hand_batch()
    new = old.clone().requires_grad_(True)
    loss, _ = get_policy_loss(name)(new, old, advantages, mask, clip_eps=0.2, loss_agg="token-mean")
    loss.backward()
    assert close(new.grad, [[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]], tol=1e-6)


# --- truncated importance sampling ------------------------------------------------------------


def test_truncated_is_weights_match_hand_values():
    # w = min(exp(trainer_old - sampler), 2) on mask-1 tokens, 1 elsewhere:
    #   (0,0) exp(ln 1.5) = 1.5 (uncapped); (0,1) exp(ln .5) = .5; (0,2) exp(ln 4) = 4 -> 2
    #   (capped); (1,0) exp(0) = 1; (1,1) exp(ln 3) would be capped but is masked -> 1, not
    #   counted; (1,2) exp(50) is masked -> 1.
    # tis_weight_mean = (1.5 + .5 + 2 + 1) / 4 = 1.25; tis_clip_frac = 1 / 4 (only (0,2))
    sampler = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -60.0]])
    ratios = torch.tensor([[1.5, 0.5, 4.0], [1.0, 3.0, 1.0]])
    trainer_old = sampler + torch.log(ratios)
    trainer_old[1, 2] = -10.0  # d = 50: exp(50) = 5.2e21, on a masked token
    trainer_old.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    weights, metrics = truncated_is_weights(trainer_old, sampler, mask, cap=2.0)
    assert close(weights, [[1.5, 0.5, 2.0], [1.0, 1.0, 1.0]])
    assert not weights.requires_grad  # a weight, never a path for the gradient
    # is_ratio_*: the raw ratios of the mask-1 tokens, 1.5, .5, 4, 1
    assert metrics == pytest.approx(
        {
            "tis_weight_mean": 1.25,
            "tis_clip_frac": 0.25,
            "is_ratio_mean": 1.75,
            "is_ratio_min": 0.5,
            "is_ratio_max": 4.0,
        }
    )
    _, none = truncated_is_weights(trainer_old, sampler, torch.zeros(2, 3), cap=2.0)
    assert none == dict.fromkeys(metrics, 0.0)
    with pytest.raises(ValueError, match="cap > 1"):
        truncated_is_weights(trainer_old, sampler, mask, cap=1.0)


def _is_batch():
    """The TIS test's batch: raw ratios rho = [[1.5, .5, 4], [1, 3, 1]], mask [[1,1,1],[1,0,0]]."""
    sampler = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -6.0]])
    prox = sampler + torch.log(torch.tensor([[1.5, 0.5, 4.0], [1.0, 3.0, 1.0]]))
    return prox, sampler, torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_is_weights_match_hand_values():
    # band (.6, 2): (0,0) 1.5 kept as 1.5; (0,1) .5 < .6 dropped; (0,2) 4 > 2 dropped; (1,0) 1
    # kept; masked tokens weigh 1 and are not counted.
    # mis_weight_mean = (1.5 + 0 + 0 + 1) / 4 = .625; mis_masked_frac = 2 / 4
    prox, sampler, mask = _is_batch()
    weights, metrics = masked_is_weights(prox, sampler, mask, (0.6, 2.0))
    assert close(weights, [[1.5, 0.0, 0.0], [1.0, 1.0, 1.0]], tol=1e-6)
    assert metrics == pytest.approx(
        {
            "mis_weight_mean": 0.625,
            "mis_masked_frac": 0.5,
            "is_ratio_mean": 1.75,
            "is_ratio_min": 0.5,
            "is_ratio_max": 4.0,
        }
    )
    for band in [(1.0, 2.0), (0.5, 1.0), (0.0, 2.0)]:
        with pytest.raises(ValueError, match="0 < low < 1 < high"):
            masked_is_weights(prox, sampler, mask, band)


def test_decoupled_is_weights_match_hand_values():
    # w = pi_prox / pi_behaviour unclipped: 1.5, .5, 4, 1; with cap 3 the 4 is dropped.
    # decoupled_weight_mean = (1.5 + .5 + 0 + 1) / 4 = .75; decoupled_masked_frac = 1 / 4
    prox, sampler, mask = _is_batch()
    weights, metrics = decoupled_is_weights(prox, sampler, mask, cap=3.0)
    assert close(weights, [[1.5, 0.5, 0.0], [1.0, 1.0, 1.0]], tol=1e-6)
    assert metrics["decoupled_weight_mean"] == pytest.approx(0.75)
    assert metrics["decoupled_masked_frac"] == pytest.approx(0.25)
    uncapped, metrics = decoupled_is_weights(prox, sampler, mask, cap=None)
    assert close(uncapped, [[1.5, 0.5, 4.0], [1.0, 1.0, 1.0]], tol=1e-6)
    assert metrics["decoupled_masked_frac"] == 0.0
    with pytest.raises(ValueError, match="> 1"):
        decoupled_is_weights(prox, sampler, mask, cap=0.9)


def _reference_ppo(new, prox, behaviour, advantages, mask, weigh, eps=0.2):
    """The corrected PPO-clip loss and its gradient written out per token in plain Python:
    r = exp(logp - logp_prox), w = weigh(exp(logp_prox - logp_behaviour)),
    term = -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A), token-mean over mask-1 tokens;
    d term / d logp = -w * r * A where the unclipped term is the smaller (or r is inside the
    clip range), else 0."""
    count = sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for b, row in enumerate(mask):
        a = advantages[b]
        for t, m in enumerate(row):
            if not m:
                continue
            r = math.exp(new[b][t] - prox[b][t])
            w = weigh(math.exp(prox[b][t] - behaviour[b][t]))
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            loss += -w * min(unclipped, clipped) / count
            if unclipped <= clipped or 1 - eps < r < 1 + eps:
                grad[b][t] = -w * r * a / count
    return loss, grad


@pytest.mark.parametrize(
    ("name", "cap", "band", "weigh"),
    [
        ("tis", 2.0, None, lambda rho: min(rho, 2.0)),
        ("mis", None, (0.6, 2.0), lambda rho: rho if 0.6 <= rho <= 2.0 else 0.0),
        ("decoupled", 3.0, None, lambda rho: rho if rho <= 3.0 else 0.0),
        ("decoupled", None, None, lambda rho: rho),
    ],
)
def test_each_correction_s_loss_and_gradient_equal_the_formula(name, cap, band, weigh):
    """Issue 43: the current policy a few steps from the proximal one (ratios inside and
    outside the clip range), the behaviour policy further back; loss and gradient of
    ``ppo_clip_loss`` with the correction's weights, against the per-token formula."""
    prox, behaviour, _ = _is_batch()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    new = (prox + torch.log(torch.tensor([[1.1, 0.7, 1.3], [0.9, 1.25, 1.0]]))).double()
    new.requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    correction = off_policy_correction(name, cap, band or (0.5, 2.0))
    weights, _ = correction(prox.double(), behaviour.double(), mask)
    loss, _ = ppo_clip_loss(new, prox.double(), advantages, mask, weights_B_T=weights)
    loss.backward()
    expected_loss, expected_grad = _reference_ppo(
        new.tolist(), prox.tolist(), behaviour.tolist(), advantages.tolist(), mask.tolist(), weigh
    )
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert close(new.grad, expected_grad, tol=1e-6)


def test_an_unknown_correction_or_a_tis_without_cap_is_refused():
    with pytest.raises(KeyError, match="known: decoupled, mis, tis"):
        off_policy_correction("vtrace")
    with pytest.raises(ValueError, match="cap"):
        off_policy_correction("tis", None)


def test_ppo_clip_with_weights_matches_hand_values():
    # ratio 1 everywhere (new = old), A = [1, -2], mask [[1,1,1],[1,1,0]], token-mean over 5:
    # loss = -sum(w * A) / 5 = -(1.5 + .5 + 2 + 1 * -2 + .25 * -2) / 5 = -1.5 / 5 = -.3
    # (the masked (1,2) weight 9 counts for nothing); d loss / d logp = -w * A / 5:
    #   [[-.3, -.1, -.4], [+.4, +.1, 0]]; the weights get no gradient.
    _, old, advantages, mask = _hand_batch()
    new = old.clone().requires_grad_(True)
    weights = torch.tensor([[1.5, 0.5, 2.0], [1.0, 0.25, 9.0]], requires_grad=True)
    loss, metrics = ppo_clip_loss(new, old, advantages, mask, weights_B_T=weights)
    assert loss.item() == pytest.approx(-0.3, abs=1e-6)
    assert metrics == pytest.approx({"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0})
    loss.backward()
    assert close(new.grad, [[-0.3, -0.1, -0.4], [0.4, 0.1, 0.0]], tol=1e-6)
    assert weights.grad is None


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_scales_with_its_token_weights_and_none_changes_nothing(name):
    # weights None: the very same loss as without the argument (bit for bit); uniform
    # weights 2: every term doubles, so with token-mean the loss and its gradient double.
    new, old, advantages, mask = _hand_batch()
    loss_fn = get_policy_loss(name)
    plain, _ = loss_fn(new, old, advantages, mask, clip_eps=0.2, loss_agg="token-mean")
    unweighted, _ = loss_fn(
        new, old, advantages, mask, clip_eps=0.2, loss_agg="token-mean", weights_B_T=None
    )
    assert torch.equal(plain, unweighted)
    (grad_plain,) = torch.autograd.grad(plain, new)
    doubled, _ = loss_fn(
        new,
        old,
        advantages,
        mask,
        clip_eps=0.2,
        loss_agg="token-mean",
        weights_B_T=torch.full((2, 3), 2.0),
    )
    (grad_doubled,) = torch.autograd.grad(doubled, new)
    assert doubled.item() == pytest.approx(2 * plain.item(), abs=1e-6)
    assert torch.allclose(grad_doubled, 2 * grad_plain, atol=1e-6)
