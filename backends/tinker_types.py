"""What the Tinker service and its models exchange: light types (numpy only, no torch), the
loss functions served with the inputs each reads, and the checks of a request's data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowrl.backends.types import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES, LoraSettings

TINKER_LORA_ALPHA = 32
"""LoRA scale numerator of a Tinker model (Tinker's documented alpha): the update is
``alpha / r * B @ A``."""

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


def tinker_lora(
    rank: int = 32, train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True
) -> LoraSettings:
    """The adapter of a Tinker SDK ``LoraConfig`` (its names: ``rank``, and the module groups
    it trains) as flowrl's ``LoraSettings``, with Tinker's alpha and no dropout. The config's
    ``seed`` is the model's (``TinkerModel``), not the adapter's."""
    modules = (
        (ATTN_MODULES if train_attn else ())
        + (MLP_MODULES if train_mlp else ())
        + (UNEMBED_MODULES if train_unembed else ())
    )
    if not modules:
        raise TinkerInputError(
            "lora_config: one of train_attn, train_mlp, train_unembed must be true"
        )
    return LoraSettings(
        enabled=True, r=rank, alpha=TINKER_LORA_ALPHA, dropout=0.0, target_modules=list(modules)
    )


def tinker_lora_config(lora: LoraSettings, seed: int | None) -> dict[str, Any]:
    """The Tinker SDK ``LoraConfig`` of ``lora`` and the model's ``seed``: the form the
    service's run and checkpoint records keep and its answers give (``tinker_lora`` reversed)."""
    modules = set(lora.target_modules)
    return {
        "rank": lora.r,
        "seed": seed,
        "train_mlp": modules >= set(MLP_MODULES),
        "train_attn": modules >= set(ATTN_MODULES),
        "train_unembed": modules >= set(UNEMBED_MODULES),
    }


def read_tinker_lora(config: Mapping[str, Any]) -> tuple[LoraSettings, int | None]:
    """A record's ``tinker_lora_config`` read back: the adapter and the model's seed."""
    flags = ("train_mlp", "train_attn", "train_unembed")
    return tinker_lora(config["rank"], **{k: config[k] for k in flags}), config.get("seed")


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
