"""What the Tinker service and its models exchange: light types (numpy only, no torch), the
loss functions served with the inputs each reads, and the checks of a request's data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)

DEFAULT_CLIP = (0.8, 1.2)

LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # loss: (required inputs, optional inputs), besides target_tokens
    "cross_entropy": ((), ("weights",)),
    "importance_sampling": (("logprobs", "advantages"), ()),
    "ppo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
}
"""The loss functions served, with the ``loss_fn_inputs`` each reads."""
LOSS_CONFIG: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
}
"""The ``loss_fn_config`` keys each loss reads (any other key is refused)."""


class TinkerInputError(ValueError):
    """A request's data is wrong (the caller's error, answered with a 4xx)."""


@dataclass(frozen=True)
class LoraSpec:
    """A training model's adapter: rank, init seed and which modules it adapts."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def target_modules(self, present: set[str]) -> list[str]:
        """The adapted modules among ``present`` (a model's module names)."""
        wanted = (
            (ATTN_MODULES if self.train_attn else ())
            + (MLP_MODULES if self.train_mlp else ())
            + (UNEMBED_MODULES if self.train_unembed else ())
        )
        return [m for m in wanted if m in present]


@dataclass
class Datum:
    """One datum, decoded: its input tokens and its per-token loss inputs (1-D arrays)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None  # NaN at position 0


@dataclass
class ForwardOutput:
    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- validation


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = next(t for t in tokens if t < 0 or t >= vocab_size)
        raise TinkerInputError(
            f"{what}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
        )


def check_batch(
    data: Sequence[Datum], loss_fn: str, config: dict[str, Any], vocab_size: int
) -> None:
    """Refuse, naming what is wrong: an unknown loss or config key, a missing input, a length
    that differs from the datum's tokens, a token id outside the vocabulary."""
    if loss_fn not in LOSS_INPUTS:
        raise TinkerInputError(
            f"loss function {loss_fn!r} is not supported here (supported: {', '.join(LOSS_INPUTS)})"
        )
    extra = sorted(set(config) - set(LOSS_CONFIG[loss_fn]))
    if extra:
        raise TinkerInputError(f"loss_fn_config key(s) {extra} are not used by {loss_fn!r}")
    if not data:
        raise TinkerInputError("no data")
    required, optional = LOSS_INPUTS[loss_fn]
    for i, datum in enumerate(data):
        if not datum.tokens:
            raise TinkerInputError(f"datum {i}: model_input is empty")
        check_tokens(datum.tokens, vocab_size, f"datum {i}: model_input")
        names = set(datum.inputs)
        missing = [k for k in ("target_tokens", *required) if k not in names]
        if missing:
            raise TinkerInputError(f"datum {i}: {loss_fn!r} needs loss_fn_inputs {missing}")
        unknown = sorted(names - {"target_tokens", *required, *optional})
        if unknown:
            raise TinkerInputError(
                f"datum {i}: loss_fn_inputs {unknown} are not used by {loss_fn!r}"
            )
        for name, values in datum.inputs.items():
            if values.ndim != 1 or len(values) != len(datum.tokens):
                raise TinkerInputError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(values.shape)}, the "
                    f"model_input has {len(datum.tokens)} tokens"
                )
            if name != "target_tokens" and not np.all(np.isfinite(values)):
                raise TinkerInputError(f"datum {i}: loss_fn_inputs[{name!r}] is not finite")
        check_tokens(
            datum.inputs["target_tokens"].tolist(), vocab_size, f"datum {i}: target_tokens"
        )
