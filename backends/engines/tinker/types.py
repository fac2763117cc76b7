"""What the Tinker service and its models exchange: light types (numpy only, no torch), the
loss functions served with the inputs each reads, and the checks of a request's data."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowrl.backends.types import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES, LoraSettings

TINKER_LORA_ALPHA = 32
"""LoRA scale numerator of a Tinker model (Tinker's documented alpha): the update is
``alpha / r * B @ A``."""

DEFAULT_CLIP = (0.8, 1.2)
DEFAULT_DRO_BETA = 0.05
"""``dro``'s ``beta`` when ``loss_fn_config`` sets none (the value Tinker's docs show)."""

LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # loss: (required inputs, optional inputs), besides target_tokens
    "cross_entropy": ((), ("weights",)),
    "importance_sampling": (("logprobs", "advantages"), ()),
    "ppo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "dro": (("logprobs", "advantages"), ()),
    "gspo": (
        ("logprobs", "advantages"),
        ("sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold"),
    ),
}
"""The loss functions served, with the ``loss_fn_inputs`` each reads."""
LOSS_CONFIG: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
}
"""The ``loss_fn_config`` keys each loss reads (any other key is refused)."""
REFUSED_LOSSES = {
    "stable_reinforce": "its objective is not published (hosted Tinker's alpha loss, computed "
    "from stability information its samplers record: record_stability_info, sequence_id), so "
    "this server cannot compute it; use ppo, cispo or importance_sampling",
}
"""Losses the SDK names that this server refuses, with why."""


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


IMAGE_SLOT = -1
"""A token position that an image's features fill (the base's image token id, on the worker)."""
MAX_IMAGE_BYTES = 8 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGE_TOKENS = 16384
FORMATS = {"png": "PNG", "jpeg": "JPEG"}


@dataclass(frozen=True)
class ImageInput:
    """One image of a datum or prompt: its encoded bytes and the tokens the client expects."""

    data: bytes
    format: str
    expected_tokens: int


def image_input(what: str, data: bytes, fmt: str, expected: int | None) -> ImageInput:
    """An image chunk's fields, checked (a 400 naming ``what`` otherwise)."""
    if fmt not in FORMATS:
        raise TinkerInputError(f"{what}: image format {fmt!r} is not served (png, jpeg)")
    if not data or len(data) > MAX_IMAGE_BYTES:
        raise TinkerInputError(f"{what}: image of {len(data)} bytes (1..{MAX_IMAGE_BYTES})")
    if expected is None or not 1 <= int(expected) <= MAX_IMAGE_TOKENS:
        raise TinkerInputError(
            f"{what}: an image chunk needs expected_tokens, 1..{MAX_IMAGE_TOKENS} (got {expected})"
        )
    _check_header(what, data, fmt)
    return ImageInput(bytes(data), fmt, int(expected))


def _check_header(what: str, data: bytes, fmt: str) -> None:
    """The image's header says ``fmt`` and a size within ``MAX_IMAGE_PIXELS`` (read without
    decoding the pixels: a decompression bomb is refused here, not expanded)."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=[FORMATS[fmt]]) as opened:
            width, height = opened.size
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad bytes
        why = "not an image of that format" if isinstance(e, UnidentifiedImageError) else e
        raise TinkerInputError(f"{what}: the {fmt} image does not decode: {why}") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise TinkerInputError(
            f"{what}: image of {width}x{height} pixels (at most {MAX_IMAGE_PIXELS})"
        )


def model_input(what: str, chunks: Sequence[Any]) -> tuple[list[int], list[ImageInput]]:
    """The tokens (``IMAGE_SLOT`` for image positions) and images of a ``ModelInput``'s chunks
    as the SDK's types hold them (``encoded_text`` and ``image``; others refused)."""
    tokens: list[int] = []
    images: list[ImageInput] = []
    for chunk in chunks:
        kind = getattr(chunk, "type", None)
        if kind == "encoded_text":
            tokens.extend(int(t) for t in chunk.tokens)
        elif kind == "image":
            image = image_input(what, chunk.data, chunk.format, chunk.expected_tokens)
            images.append(image)
            tokens.extend([IMAGE_SLOT] * image.expected_tokens)
        else:
            raise TinkerInputError(f"{what}: chunk {kind!r} is not supported here")
    return tokens, images


@dataclass
class Datum:
    """One datum, decoded: its input tokens (``IMAGE_SLOT`` where an image goes), its per-token
    loss inputs (1-D arrays, or ``(n, K)``), and its images in order."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    images: list[ImageInput] = field(default_factory=list)

    def text_tokens(self) -> list[int]:
        """Its tokens but the image slots."""
        return [t for t in self.tokens if t != IMAGE_SLOT] if self.images else self.tokens


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
    prompt_logprobs: list[float] | None = None  # NaN at position 0 (and before the last n)
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None
    """(token ids int32, log-probs float32), each ``[len(prompt), k]``; empty rows (position 0,
    positions before the last n) hold token 0 and ``MASK_LOGPROB``."""
    target_prompt: np.ndarray | None = None
    """float32 ``[len(prompt) - 1, K]``: the log-probs of ``PromptScoring.targets``' ids."""


MASK_LOGPROB = -99999.0
MAX_TOPK = 64
"""The most top log-probs (and target ids) per prompt position a request may ask for."""


@dataclass(frozen=True)
class PromptScoring:
    """What a sample request asks of its prompt (log-probs of the model's distribution before
    sampling settings): each token's log-prob, the ``topk`` most likely tokens at each
    position, the log-probs of chosen ids (``targets``: ``[len(prompt) - 1, K]``, cell
    ``[i, j]`` scored at position ``i + 1``, -1 asks nothing), and only the last ``last_n``
    positions."""

    logprobs: bool = False
    topk: int = 0
    last_n: int | None = None
    targets: np.ndarray | None = None

    @property
    def wanted(self) -> bool:
        return self.logprobs or self.topk > 0 or self.targets is not None


@dataclass
class ForwardOutput:
    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- validation


def csr_dense(
    what: str,
    values: np.ndarray,
    crow: Sequence[int],
    col: Sequence[int],
    shape: Sequence[int],
    fill: float,
    max_cells: int,
) -> np.ndarray:
    """A sparse CSR tensor (the SDK's ``TensorData.from_torch_sparse``: ``values``, row
    pointers ``crow``, column indices ``col``, the dense ``shape``) as its dense 2-D array,
    ``fill`` in every unlisted cell: 0 for ``loss_fn_inputs`` (the SDK leaves zeros out of
    ``target_tokens`` and ``weights``), -1 for ``target_prompt_logprobs`` (an unlisted cell
    asks nothing). Every index is checked before one is used; a shape of more than
    ``max_cells`` cells is refused before it is allocated."""
    if len(shape) != 2 or min(shape) < 0:
        raise TinkerInputError(f"{what}: a sparse CSR tensor needs a 2-D shape, got {list(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    if rows * cols > max_cells:
        raise TinkerInputError(f"{what}: sparse shape {list(shape)} is above {max_cells} cells")
    crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
    nnz = len(values)
    if len(crow_a) != rows + 1 or crow_a[0] != 0 or crow_a[-1] != nnz or len(col_a) != nnz:
        raise TinkerInputError(
            f"{what}: sparse CSR of {rows} rows needs {rows + 1} row pointers from 0 to "
            f"{nnz} (the values) and {nnz} column indices; got {len(crow_a)} pointers and "
            f"{len(col_a)} columns"
        )
    if np.any(np.diff(crow_a) < 0) or (nnz and (col_a.min() < 0 or col_a.max() >= cols)):
        raise TinkerInputError(
            f"{what}: sparse CSR row pointers must not decrease and columns must be 0..{cols - 1}"
        )
    dense = np.full((rows, cols), fill, dtype=values.dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow_a)), col_a] = values
    return dense


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = next(t for t in tokens if t < 0 or t >= vocab_size)
        raise TinkerInputError(
            f"{what}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
        )


TOPK_INPUTS = ("target_tokens", "weights")
"""``cross_entropy``'s inputs that may be 2-D, ``(n, K)``: top-k distillation."""


def _topk_width(i: int, datum: Datum, loss_fn: str) -> int | None:
    """K of a datum's 2-D (top-k) targets, None for 1-D; a 400 for a shape that does not fit
    (2-D only for ``cross_entropy``'s targets and weights, the same ``(n, K)``)."""
    targets = datum.inputs.get("target_tokens")
    if targets is None or targets.ndim != 2:
        return None
    n, k = targets.shape
    if loss_fn != "cross_entropy":
        raise TinkerInputError(f"datum {i}: 2-D (top-k) target_tokens are for cross_entropy")
    if n != len(datum.tokens) or not 1 <= k <= MAX_TOPK:
        raise TinkerInputError(
            f"datum {i}: target_tokens has shape {[n, k]}; 2-D targets are "
            f"[{len(datum.tokens)}, K] with K of 1..{MAX_TOPK}"
        )
    weights = datum.inputs.get("weights")
    if weights is not None and weights.shape != targets.shape:
        raise TinkerInputError(
            f"datum {i}: weights has shape {list(weights.shape)}, target_tokens {[n, k]}"
        )
    return k


def _check_loss(loss_fn: str, custom_inputs: Sequence[str] | None) -> None:
    if loss_fn == "custom" and custom_inputs is None:
        raise TinkerInputError(
            "loss function 'custom' runs a loss made with create_custom_loss: send its loss_id"
        )
    if loss_fn in REFUSED_LOSSES:
        raise TinkerInputError(
            f"loss function {loss_fn!r} is not supported here: {REFUSED_LOSSES[loss_fn]}"
        )
    if loss_fn not in LOSS_INPUTS and loss_fn != "custom":
        raise TinkerInputError(
            f"loss function {loss_fn!r} is not supported here (supported: {', '.join(LOSS_INPUTS)})"
        )


def check_batch(
    data: Sequence[Datum],
    loss_fn: str,
    config: dict[str, Any],
    vocab_size: int,
    custom_inputs: Sequence[str] | None = None,
) -> None:
    """Refuse, naming what is wrong: an unknown loss or config key, a missing input, a length
    that differs from the datum's tokens, a token id outside the vocabulary. ``custom`` (a
    client's uploaded loss) needs the inputs that loss reads (``custom_inputs``)."""
    _check_loss(loss_fn, custom_inputs)
    extra = sorted(set(config) - set(LOSS_CONFIG.get(loss_fn, ())))
    if extra:
        raise TinkerInputError(f"loss_fn_config key(s) {extra} are not used by {loss_fn!r}")
    if not data:
        raise TinkerInputError("no data")
    required, optional = LOSS_INPUTS.get(loss_fn, (tuple(custom_inputs or ()), ()))
    widths = {_topk_width(i, d, loss_fn) for i, d in enumerate(data)}
    if len(widths) > 1:
        raise TinkerInputError(
            "the data mix 1-D and 2-D (top-k) targets, or 2-D targets of different K"
        )
    for i, datum in enumerate(data):
        if not datum.tokens:
            raise TinkerInputError(f"datum {i}: model_input is empty")
        check_tokens(datum.text_tokens(), vocab_size, f"datum {i}: model_input")
        names = set(datum.inputs)
        missing = [k for k in ("target_tokens", *required) if k not in names]
        if missing:
            raise TinkerInputError(f"datum {i}: {loss_fn!r} needs loss_fn_inputs {missing}")
        unknown = sorted(names - {"target_tokens", *required, *optional})
        if unknown and loss_fn != "custom":  # a custom loss's datum carries what it may not read
            raise TinkerInputError(
                f"datum {i}: loss_fn_inputs {unknown} are not used by {loss_fn!r}"
            )
        for name, values in datum.inputs.items():
            if values.ndim == 2 and name in TOPK_INPUTS and loss_fn == "cross_entropy":
                pass  # (n, K): checked by _topk_width
            elif values.ndim != 1 or len(values) != len(datum.tokens):
                raise TinkerInputError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(values.shape)}, the "
                    f"model_input has {len(datum.tokens)} tokens"
                )
            if name != "target_tokens" and not np.all(np.isfinite(values)):
                raise TinkerInputError(f"datum {i}: loss_fn_inputs[{name!r}] is not finite")
        check_tokens(
            datum.inputs["target_tokens"].ravel().tolist(), vocab_size, f"datum {i}: target_tokens"
        )


# ----------------------------------------------------------- the checks of a request's settings
# Each takes the SDK's request object (attributes as the SDK names them) and raises
# ``TinkerInputError`` (a 400) naming what is wrong.

MAX_LORA_RANK = 256


def training_lora(lora_config: Any, optimizer_config: Any) -> tuple[LoraSettings, int | None]:
    """A ``create_model`` request's LoRA (its settings and seed): LoRA models with AdamW only."""
    if lora_config is None:
        raise TinkerInputError("only LoRA training models are served here (lora_config)")
    rank = lora_config.rank
    if not 1 <= rank <= MAX_LORA_RANK:
        raise TinkerInputError(f"LoRA rank must be 1..{MAX_LORA_RANK}, got {rank}")
    optimizer = getattr(optimizer_config, "type", "adamw")
    if optimizer != "adamw":
        raise TinkerInputError(f"optimizer {optimizer!r} is not supported (adamw)")
    c = lora_config
    return tinker_lora(c.rank, c.train_mlp, c.train_attn, c.train_unembed), c.seed


def adam_step(params: Any) -> dict[str, Any]:
    """An ``optim_step`` request's Adam parameters (the SDK's ``AdamParams``) as keyword
    arguments of the model's step."""
    for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
        if not 0 <= getattr(params, name) < float("inf"):
            raise TinkerInputError(f"adam_params.{name} must be a finite number >= 0")
    if not (0 <= params.beta1 < 1 and 0 <= params.beta2 < 1):
        raise TinkerInputError("adam_params.beta1 and beta2 must be in [0, 1)")
    return params.model_dump()


def sample_params(params: Any) -> SampleParams:
    """A sampling request's parameters, checked (what depends on the model: ``check_fits``)."""
    max_tokens = 64 if params.max_tokens is None else params.max_tokens
    if not 1 <= max_tokens <= 2**20:
        raise TinkerInputError(f"max_tokens must be >= 1, got {max_tokens}")
    temperature, top_p = float(params.temperature), float(params.top_p)
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1):
        raise TinkerInputError("temperature must be a finite number >= 0 and top_p in (0, 1]")
    if params.seed is not None and not 0 <= params.seed < 2**63:
        raise TinkerInputError(f"seed must be in [0, 2**63), got {params.seed}")
    stop = params.stop
    tokens: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop:
        items = list(stop)
        if all(isinstance(s, str) for s in items):
            strings = tuple(items)
        elif all(isinstance(s, int) for s in items):
            tokens = tuple(items)
        else:
            raise TinkerInputError("stop must be token ids or strings, not both")
    return SampleParams(
        max_tokens=int(max_tokens),
        temperature=temperature,
        top_k=int(params.top_k),
        top_p=top_p,
        stop_tokens=tokens,
        stop_strings=strings,
        seed=params.seed,
    )


def check_fits(prompt: Sequence[int], params: SampleParams, info: Mapping[str, int]) -> None:
    """The prompt and stop tokens are in the model's vocabulary, and prompt + max_tokens fits
    its context."""
    check_tokens([t for t in prompt if t != IMAGE_SLOT], info["vocab_size"], "prompt")
    check_tokens(params.stop_tokens, info["vocab_size"], "stop")
    context = info["context_length"]
    if context and len(prompt) + params.max_tokens > context:
        raise TinkerInputError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context length {context}"
        )


UNSUPPORTED_SAMPLE_OPTIONS = (
    "topk_sample_logprobs",
    "prompt_alt_tokens_k",
    "record_stability_info",
)


def check_sample_request(
    req: Any, max_samples: int
) -> tuple[list[int], list[ImageInput], PromptScoring]:
    """An ``asample`` request's options this server serves; its prompt tokens (``IMAGE_SLOT``
    where an image goes), its images and what it asks of them."""
    unsupported = [name for name in UNSUPPORTED_SAMPLE_OPTIONS if getattr(req, name, None)]
    if unsupported:
        raise TinkerInputError(f"not supported here: {', '.join(unsupported)}")
    if not 1 <= req.num_samples <= max_samples:
        raise TinkerInputError(f"num_samples must be 1..{max_samples}, got {req.num_samples}")
    prompt, images = model_input("prompt", req.prompt.chunks)
    if not prompt:
        raise TinkerInputError("the prompt is empty")
    return prompt, images, prompt_scoring(req, len(prompt))


def prompt_scoring(req: Any, length: int) -> PromptScoring:
    """A sample request's ``prompt_logprobs``, ``topk_prompt_logprobs``,
    ``target_prompt_logprobs`` and ``prompt_logprobs_last_n``, checked."""
    topk = int(req.topk_prompt_logprobs or 0)
    if not 0 <= topk <= MAX_TOPK:
        raise TinkerInputError(f"topk_prompt_logprobs must be 0..{MAX_TOPK}, got {topk}")
    targets = None
    if req.target_prompt_logprobs is not None:
        targets = _targets(req.target_prompt_logprobs, length)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not req.prompt_logprobs:
            raise TinkerInputError("prompt_logprobs_last_n needs prompt_logprobs")
        if not 1 <= last_n <= length - 1:
            raise TinkerInputError(
                f"prompt_logprobs_last_n must be 1..{length - 1} (the prompt's length - 1), "
                f"got {last_n}"
            )
    return PromptScoring(bool(req.prompt_logprobs), topk, last_n, targets)


def _targets(tensor: Any, length: int) -> np.ndarray:
    shape = tensor.shape or [len(tensor.data)]
    if len(shape) != 2 or shape[0] != length - 1 or not 1 <= shape[1] <= MAX_TOPK:
        raise TinkerInputError(
            f"target_prompt_logprobs has shape {shape}; it must be [{length - 1}, K] "
            f"(the prompt's length - 1, K of 1..{MAX_TOPK})"
        )
    ids = np.asarray(tensor.data, dtype=np.int64)
    if tensor.sparse_crow_indices is not None or tensor.sparse_col_indices is not None:
        crow, col = tensor.sparse_crow_indices or [], tensor.sparse_col_indices or []
        what = "target_prompt_logprobs"
        return csr_dense(what, ids, crow, col, shape, -1, shape[0] * shape[1])
    if ids.size != shape[0] * shape[1]:
        raise TinkerInputError(f"target_prompt_logprobs: {ids.size} values for shape {shape}")
    return ids.reshape(shape)
