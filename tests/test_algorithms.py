"""Algorithm math against numbers worked out by hand, and slow loops against the vectorised code."""

import math
import statistics

import pytest
import torch

from backends.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    ppo_clip_loss,
    rloo_advantages,
    token_logprobs,
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
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo"} and set(POLICY_LOSSES) == {"ppo_clip"}
    with pytest.raises(KeyError, match="grpo, rloo"):
        get_advantage_estimator("gae")
    with pytest.raises(KeyError, match="ppo_clip"):
        get_policy_loss("dpo")
