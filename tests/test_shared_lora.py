"""Many LoRA tenants on one base model (``backends.engines.tinker.model.SharedBase``): the base
weights loaded once; each tenant its own adapter, AdamW state, step count and RNG; isolated bit
for bit; parked least-recently-used when the adapter slots are full and restored exactly."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from flowrl.backends.engines.tinker.model import SharedBase, TinkerModel
from flowrl.backends.engines.tinker.types import Datum, SampleParams, TinkerInputError, tinker_lora

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


@pytest.fixture(scope="module")
def base_dir(model_dir: str) -> str:
    return model_dir


def _data(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        tokens = rng.integers(5, 60, size=8).tolist()
        inputs = {"target_tokens": np.array(tokens[1:] + [6]), "weights": np.ones(8, np.float32)}
        out.append(Datum(tokens, inputs))
    return out


def _train(model: TinkerModel, seed: int, steps: int = 2) -> float:
    loss = math.nan
    for k in range(steps):
        loss = model.forward_backward(_data(seed + k), "cross_entropy").metrics["loss:sum"]
        model.optim_step(learning_rate=1e-2)
    return loss


def _samples(model: TinkerModel) -> list[tuple[list[int], list[float]]]:
    model.snapshot("now")
    params = SampleParams(max_tokens=5, temperature=1.0, seed=11)
    outs = [model.sample(p, 2, params, "now", prompt_logprobs=True) for p in PROMPTS]
    return [(s.tokens, s.logprobs) for out in outs for s in out.sequences]


def _logprobs(model: TinkerModel, seed: int) -> list[np.ndarray]:
    out = model.forward_backward(_data(seed), "cross_entropy", forward_only=True)
    return [o["logprobs"] for o in out.outputs]


def test_tenants_share_the_base_and_are_isolated_bit_for_bit(base_dir: str) -> None:
    """B's sampled tokens and log-probs (fp32, CPU) are the same bits whether or not A trains
    between B's calls, and the same as B's on a base of its own; A's training changes neither
    B's adapter nor the base weights, which exist once."""
    shared = SharedBase(base_dir)
    a = TinkerModel(shared, tinker_lora(rank=4), seed=1, name="a")
    b = TinkerModel(shared, tinker_lora(rank=8), seed=2, name="b")
    alone = TinkerModel(base_dir, tinker_lora(rank=8), seed=2, name="b")
    base_weight = shared.base.get_input_embeddings().weight
    before_base = base_weight.detach().clone()
    _train(b, 100)
    _train(alone, 100)
    b_state = b.state_bytes(True)
    first = _samples(b)
    _train(a, 200, steps=3)  # A trains between B's calls
    assert _samples(b) == first
    assert first == _samples(alone)
    assert b.state_bytes(True) == b_state  # A's steps touched nothing of B's
    assert torch.equal(base_weight, before_base)  # the base stays frozen
    assert a.model is b.model and len(shared.peft.peft_config) == 2  # one model, two adapters
    for x, y in zip(_logprobs(b, 7), _logprobs(alone, 7), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_parked_tenant_is_restored_exactly(base_dir: str) -> None:
    """With one adapter slot, tenants take turns (each call may park the other, with its
    gradients accumulated so far); A ends bit-identical to A trained alone."""
    shared = SharedBase(base_dir, resident=1)
    a = TinkerModel(shared, tinker_lora(rank=4), seed=3, name="a")
    b = TinkerModel(shared, tinker_lora(rank=4), seed=4, name="b")
    alone = TinkerModel(base_dir, tinker_lora(rank=4), seed=3, name="a")
    for model in (a, alone):
        model.generator.manual_seed(5)
    for step in range(3):
        for model in (a, alone):
            model.forward_backward(_data(step), "cross_entropy")
        _train(b, 50 + step, steps=1)  # parks A between its forward_backward and optim_step
        for model in (a, alone):
            model.optim_step(learning_rate=1e-2, weight_decay=0.01)
    assert shared.evictions >= 5 and len(shared.resident) == 1
    assert a.steps == alone.steps == 3
    for x, y in zip(_logprobs(a, 9), _logprobs(alone, 9), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.state_bytes(True) == alone.state_bytes(True)
    assert _samples(a) == _samples(alone)  # the sampling RNG came back too


def test_a_tenant_joins_a_live_base_without_loading_it_again(base_dir: str) -> None:
    started = time.perf_counter()
    shared = SharedBase(base_dir)
    TinkerModel(shared, tinker_lora(rank=4), seed=1, name="first")
    load_s = time.perf_counter() - started
    base = shared.base
    started = time.perf_counter()
    late = TinkerModel(shared, tinker_lora(rank=4), seed=2, name="late")
    join_s = time.perf_counter() - started
    print(f"\nbase + first tenant {load_s * 1000:.0f} ms, a tenant joining {join_s * 1000:.0f} ms")
    assert shared.base is base and join_s < load_s
    assert math.isfinite(_train(late, 1))
    late.close()
    assert "late" not in shared.resident and "late" not in shared.peft.peft_config


def test_a_failing_tenant_fails_alone(base_dir: str) -> None:
    """A bad batch is refused and a diverged adapter (NaN weights) stays its own: the other
    tenant trains on as if alone."""
    shared = SharedBase(base_dir)
    bad = TinkerModel(shared, tinker_lora(rank=4), seed=1, name="bad")
    good = TinkerModel(shared, tinker_lora(rank=4), seed=2, name="good")
    alone = TinkerModel(base_dir, tinker_lora(rank=4), seed=2, name="good")
    with pytest.raises(TinkerInputError, match="vocabulary"):
        bad.forward_backward(
            [Datum([5, 10_000], {"target_tokens": np.array([6, 7])})], "cross_entropy"
        )
    bad.forward_backward(_data(1), "cross_entropy")
    bad.optim_step(learning_rate=1e30)  # diverges
    bad.optim_step(learning_rate=1e30)
    assert not math.isfinite(
        bad.forward_backward(_data(2), "cross_entropy", forward_only=True).metrics["loss:sum"]
    )
    assert _train(good, 300) == _train(alone, 300)
