"""The Tinker API's policy losses beyond PPO (``backends/engines/tinker/model.py``): ``dro`` and
``gspo`` (GSPO-token), each loss equal to a hand computation from the model's own log-probs,
and each gradient equal to that of a cross-entropy whose per-token weights are the hand-derived
``-d loss / d logprob``; ``stable_reinforce`` refused, naming why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.backends.engines.tinker import forward
from flowrl.backends.engines.tinker import model as tinker_model
from flowrl.backends.engines.tinker.model import TinkerModel
from flowrl.backends.engines.tinker.types import Datum, TinkerInputError, tinker_lora

BETA = 0.3
LOW, HIGH = 0.95, 1.03  # narrow: some sequences are clipped, some not


@pytest.fixture(scope="module")
def base_dir(model_dir: str) -> str:
    return model_dir


def _model(base_dir: str, name: str) -> TinkerModel:
    return TinkerModel(base_dir, tinker_lora(rank=4), seed=5, name=name)


def _data(logprob_shift: float) -> list[Datum]:
    """Four data of different lengths, with a prompt (advantage 0) and a completion; the
    sampler's log-probs are made up (the model's own, shifted, per datum)."""
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate((6, 9, 7, 5)):
        tokens = rng.integers(5, 60, size=n).tolist()
        advantages = np.where(np.arange(n) >= 2, rng.normal(size=n), 0.0).astype(np.float32)
        inputs = {
            "target_tokens": np.array(tokens[1:] + [7]),
            "logprobs": np.full(n, -3.0 - logprob_shift * i, np.float32),
            "advantages": advantages,
        }
        out.append(Datum(tokens, inputs))
    return out


def _with_sampler_logprobs(model: TinkerModel, data: list[Datum], shift: float) -> list[Datum]:
    """``data`` whose sampler log-probs are the model's own plus ``shift`` per datum index."""
    probe = [Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in data]
    own = model.forward_backward(probe, "cross_entropy", forward_only=True).outputs
    return [
        Datum(d.tokens, {**d.inputs, "logprobs": (o["logprobs"] + shift * i).astype(np.float32)})
        for i, (d, o) in enumerate(zip(data, own, strict=True))
    ]


def _grads(model: TinkerModel) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model._named_params().values()])


def _as_cross_entropy(data: list[Datum], weights: list[np.ndarray]) -> list[Datum]:
    return [
        Datum(
            d.tokens, {"target_tokens": d.inputs["target_tokens"], "weights": w.astype(np.float32)}
        )
        for d, w in zip(data, weights, strict=True)
    ]


def _check(base_dir: str, loss_fn: str, config: dict, hand) -> None:  # noqa: ANN001
    """``loss_fn`` on a fresh model: its ``loss:sum`` equals the hand loss from the model's
    log-probs, and its gradient that of cross-entropy with the hand weights."""
    model, twin = _model(base_dir, "m"), _model(base_dir, "twin")
    data = _with_sampler_logprobs(model, _data(0.0), shift=0.02)
    out = model.forward_backward(data, loss_fn, config)
    logprobs = [o["logprobs"].astype(np.float64) for o in out.outputs]
    losses, weights = zip(*(hand(lp, d) for lp, d in zip(logprobs, data, strict=True)), strict=True)
    assert np.isclose(out.metrics["loss:sum"], sum(x.sum() for x in losses), rtol=1e-6, atol=1e-6)
    for o, expected in zip(out.outputs, losses, strict=True):
        assert np.allclose(o["elementwise_loss"], expected, rtol=1e-6, atol=1e-6)
    twin.forward_backward(_as_cross_entropy(data, list(weights)), "cross_entropy")
    got, want = _grads(model), _grads(twin)
    assert torch.norm(want) > 0
    assert torch.max(torch.abs(got - want)) <= 1e-6 * torch.max(torch.abs(want)) + 1e-9


def test_dro_is_its_formula(base_dir: str) -> None:
    """``-(logp * A - beta / 2 * (logp - q) ** 2)`` per token, whose ``-dL/dlogp`` is
    ``A - beta (logp - q)``."""

    def hand(logp: np.ndarray, d: Datum) -> tuple[np.ndarray, np.ndarray]:
        adv, q = d.inputs["advantages"], d.inputs["logprobs"].astype(np.float64)
        loss = -(logp * adv - 0.5 * BETA * (logp - q) ** 2)
        return loss, adv - BETA * (logp - q)

    _check(base_dir, "dro", {"beta": BETA}, hand)


def test_gspo_is_its_formula(base_dir: str) -> None:
    """GSPO-token: each token's ratio is its sequence's geometric-mean ratio ``s`` over the
    tokens with an advantage; ``-min(s A, clip(s) A)``; the gradient, where the unclipped
    term is the minimum (or ``s`` is inside the clip), is ``s A`` on the token's log-prob."""

    def hand(logp: np.ndarray, d: Datum) -> tuple[np.ndarray, np.ndarray]:
        adv, q = d.inputs["advantages"].astype(np.float64), d.inputs["logprobs"]
        marked = adv != 0
        s = np.exp(np.mean((logp - q)[marked]))
        clipped = np.clip(s, LOW, HIGH)
        loss = -np.minimum(s * adv, clipped * adv)
        live = (s * adv <= clipped * adv) | ((s >= LOW) & (s <= HIGH))
        return loss, np.where(live, s * adv, 0.0)

    config = {"clip_low_threshold": LOW, "clip_high_threshold": HIGH}
    _check(base_dir, "gspo", config, hand)


def test_gspo_takes_the_sequence_mask_it_is_given(base_dir: str) -> None:
    """An explicit ``sequence_ratio_mask`` (here: the first marked token only) sets which
    tokens the sequence ratio averages over."""
    model = _model(base_dir, "m")
    data = _with_sampler_logprobs(model, _data(0.0), shift=0.05)
    masked = []
    for d in data:
        mask = np.zeros(len(d.tokens), np.float32)
        mask[2] = 1.0
        masked.append(Datum(d.tokens, {**d.inputs, "sequence_ratio_mask": mask}))
    out = model.forward_backward(masked, "gspo", {}, forward_only=True)
    for o, d in zip(out.outputs, masked, strict=True):
        logp, q, adv = o["logprobs"], d.inputs["logprobs"], d.inputs["advantages"]
        s = np.exp(logp[2] - q[2])
        expected = -np.minimum(s * adv, np.clip(s, 0.8, 1.2) * adv)
        assert np.allclose(o["elementwise_loss"], expected, rtol=1e-6, atol=1e-6)


def test_stable_reinforce_is_refused_naming_why(base_dir: str) -> None:
    model = _model(base_dir, "m")
    refused = "stable_reinforce.*not published.*record_stability_info"
    with pytest.raises(TinkerInputError, match=refused):
        model.forward_backward(_data(0.0), "stable_reinforce", {})
    with pytest.raises(TinkerInputError, match=r"\['gamma'\] are not used by 'dro'"):
        model.forward_backward(_data(0.0), "dro", {"gamma": 1.0})


def test_top_k_cross_entropy_is_k_weighted_cross_entropies(base_dir: str) -> None:
    """2-D ``(n, K)`` targets and weights (distillation onto a teacher's top k): each
    position's K log-probs are those of the 1-D loss on each column, the loss is
    ``-sum w * logp``, and the gradient is that of the K weighted 1-D losses together."""
    model, twin = _model(base_dir, "m"), _model(base_dir, "twin")
    rng = np.random.default_rng(1)
    data, columns = [], []
    for n in (6, 9):
        tokens = rng.integers(5, 60, size=n).tolist()
        targets = rng.integers(5, 60, size=(n, 3))
        weights = rng.dirichlet(np.ones(3), size=n).astype(np.float32)
        data.append(Datum(tokens, {"target_tokens": targets, "weights": weights}))
        columns.append([(targets[:, k], weights[:, k]) for k in range(3)])
    out = model.forward_backward(data, "cross_entropy")
    total = 0.0
    for k in range(3):
        column = [
            Datum(d.tokens, {"target_tokens": c[k][0], "weights": c[k][1]})
            for d, c in zip(data, columns, strict=True)
        ]
        one = twin.forward_backward(column, "cross_entropy")
        total += one.metrics["loss:sum"]
        for o, c in zip(out.outputs, one.outputs, strict=True):
            assert np.allclose(o["logprobs"][:, k], c["logprobs"], atol=1e-6)
    assert out.outputs[0]["logprobs"].shape == (6, 3)
    assert np.isclose(out.metrics["loss:sum"], total, rtol=1e-6)
    got, want = _grads(model), _grads(twin)
    assert torch.max(torch.abs(got - want)) <= 1e-6 * torch.max(torch.abs(want)) + 1e-9
    mixed = [data[0], Datum(data[1].tokens, {"target_tokens": columns[1][0][0]})]
    with pytest.raises(TinkerInputError, match="mix 1-D and 2-D"):
        model.forward_backward(mixed, "cross_entropy")
    with pytest.raises(TinkerInputError, match="are for cross_entropy"):
        rl = {**data[0].inputs, "logprobs": np.zeros(6), "advantages": np.ones(6)}
        model.forward_backward([Datum(data[0].tokens, rl)], "ppo")


def _idle(data: list[Datum], loss_fn: str, rows: tuple[int, ...]) -> list[Datum]:
    """``data`` for ``loss_fn`` with ``rows`` left without a gradient: their advantages (or,
    for cross_entropy, weights) all 0."""
    key = "weights" if loss_fn == "cross_entropy" else "advantages"
    if loss_fn == "cross_entropy":
        weights = [np.linspace(0.5, 1.5, len(d.tokens)) for d in data]
        data = _as_cross_entropy(data, weights)
    return [
        Datum(d.tokens, {**d.inputs, key: np.zeros(len(d.tokens), np.float32)}) if i in rows else d
        for i, d in enumerate(data)
    ]


@pytest.mark.parametrize(
    "loss_fn", ["ppo", "importance_sampling", "cispo", "gspo", "cross_entropy"]
)
def test_data_without_a_gradient_run_forward_only_to_the_same_step(
    base_dir: str, loss_fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data whose advantages (cross_entropy: weights) are all 0 go through the model without
    a graph for backward, the rest with one; log-probs, element-wise losses, ``loss:sum``,
    gradients and the AdamW step after it are those of the whole batch in one pass (to float32
    rounding: each pass pads to its own width), also
    when a call holds no datum with a gradient, after steps that left AdamW moments."""
    model, twin = _model(base_dir, "m"), _model(base_dir, "twin")
    data = _idle(_with_sampler_logprobs(model, _data(0.0), shift=0.02), loss_fn, rows=(1, 3))
    passes: list[tuple[int, bool]] = []
    hook = model.model.register_forward_hook(
        lambda _m, _a, kw, _o: passes.append((len(kw["input_ids"]), torch.is_grad_enabled())),
        with_kwargs=True,
    )
    split = model.forward_backward(data, loss_fn, {})
    hook.remove()
    assert passes == [(2, True), (2, False)]

    def in_one_pass(batch: list[Datum]) -> tinker_model.ForwardOutput:
        with monkeypatch.context() as one_pass:
            one_pass.setattr(tinker_model, "rows_without_gradient", lambda *_: set())
            return twin.forward_backward(batch, loss_fn, {})

    whole = in_one_pass(data)
    assert np.isclose(split.metrics["loss:sum"], whole.metrics["loss:sum"], rtol=1e-5)
    for got, want in zip(split.outputs, whole.outputs, strict=True):
        assert np.allclose(got["logprobs"], want["logprobs"], atol=1e-6)
        assert np.allclose(got["elementwise_loss"], want["elementwise_loss"], atol=1e-6)
    got, want = _grads(model), _grads(twin)
    assert torch.max(torch.abs(got - want)) <= 1e-5 * torch.max(torch.abs(want))
    for trainer in (model, twin):
        trainer.optim_step(1e-2)
    idle = _idle(data, loss_fn, rows=(0, 1, 2, 3))
    assert model.forward_backward(idle, loss_fn, {}).metrics["loss:sum"] == 0.0
    in_one_pass(idle)
    for trainer in (model, twin):
        trainer.optim_step(1e-2)
    for got, want in zip(model.params, twin.params, strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _groups(loss_fn: str, top_k: int = 0) -> list[Datum]:
    """Three groups of four data that repeat their group's prompt (of 5, 7 and 6 tokens) and
    sample completions of 3-8 tokens, and a datum whose prompt none repeats; the loss reads
    the completions only (advantages, or cross_entropy weights, 0 on the prompt). ``top_k``:
    (n, K) targets and weights."""
    rng = np.random.default_rng(3)
    data = []
    for p in (5, 7, 6):
        prompt = rng.integers(5, 60, size=p).tolist()
        for _ in range(4):
            tokens = prompt + rng.integers(5, 60, size=int(rng.integers(3, 9))).tolist()
            n = len(tokens)
            on = (np.arange(n) >= p - 1).astype(np.float32)
            if loss_fn == "cross_entropy":
                targets = np.array(tokens[1:] + [7])
                weights = on
                if top_k:
                    targets = np.stack([targets, *rng.integers(5, 60, size=(top_k - 1, n))], 1)
                    weights = on[:, None] * rng.dirichlet(np.ones(top_k), size=n)
                inputs = {"target_tokens": targets, "weights": weights.astype(np.float32)}
            else:
                inputs = {
                    "target_tokens": np.array(tokens[1:] + [7]),
                    "logprobs": np.full(n, -4.0, np.float32),
                    "advantages": (on * rng.normal()).astype(np.float32),
                }
            data.append(Datum(tokens, inputs))
    lone = data[0]  # a prompt no other datum repeats, amid the groups
    data.insert(5, Datum([3, *lone.tokens[1:]], lone.inputs))
    return data


@pytest.mark.parametrize(
    ("loss_fn", "top_k"), [("ppo", 0), ("cross_entropy", 0), ("cross_entropy", 3)]
)
def test_data_that_repeat_a_prompt_run_it_once_to_the_same_result(
    base_dir: str, loss_fn: str, top_k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's data that repeat its prompt run the prompt once (the tokens before the first
    loss token, in one batch of the distinct prompts) and then each its own rest; a datum whose
    prompt none repeats runs whole. Log-probs at every position, element-wise losses,
    ``loss:sum`` and gradients are those of every datum run whole (to float32 rounding)."""
    model, twin = _model(base_dir, "m"), _model(base_dir, "twin")
    data = _groups(loss_fn, top_k)
    shapes: list[tuple[int, int]] = []
    hook = model.model.register_forward_hook(
        lambda _m, _a, kw, _o: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    shared = model.forward_backward(data, loss_fn, {})
    hook.remove()
    # the 3 prompts but their last token, then the 12 data's rests, then the lone datum whole
    assert shapes == [(3, 6), (12, 9), (1, len(data[5].tokens))]
    with monkeypatch.context() as whole:
        whole.setattr(forward, "_prompt_lengths", lambda *_: None)
        each = twin.forward_backward(data, loss_fn, {})
    assert np.isclose(shared.metrics["loss:sum"], each.metrics["loss:sum"], rtol=1e-5)
    for got, want in zip(shared.outputs, each.outputs, strict=True):
        assert got["logprobs"].shape == want["logprobs"].shape
        assert np.allclose(got["logprobs"], want["logprobs"], atol=1e-5)
        assert np.allclose(got["elementwise_loss"], want["elementwise_loss"], atol=1e-5)
    got, want = _grads(model), _grads(twin)
    assert torch.max(torch.abs(got - want)) <= 1e-5 * torch.max(torch.abs(want))
