"""The Tinker API's protobuf messages, read and written with the proto module the ``tinker`` SDK
ships (``tinker.proto.tinker_public_pb2``): ``forward_backward`` requests in, ``forward_backward``
outputs and ``sample`` responses out. Everything here treats its input as hostile: a message that
does not parse, a dtype or chunk kind not served, a tensor whose bytes do not match its shape,
each raises ``TinkerInputError`` naming it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from flowrl.backends.engines.tinker.types import (
    IMAGE_SLOT,
    MAX_TOPK,
    Datum,
    ForwardOutput,
    ImageInput,
    SampleOutput,
    TinkerInputError,
    csr_dense,
    image_input,
)

_NUMPY = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64)}
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]
    loss_id: str | None = None
    """``custom``'s loss: a ``create_custom_loss`` of the model's session."""


def decompress(body: bytes, encoding: str | None, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The body as sent: identity, or zstd (at most ``limit`` bytes once decompressed)."""
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise TinkerInputError(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(limit + 1)
    except zstandard.ZstdError as e:
        raise TinkerInputError(f"the zstd body does not decompress: {e}") from None
    if len(out) > limit:
        raise TinkerInputError(f"the body decompresses to more than {limit} bytes")
    return out


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError) as e:
        raise TinkerInputError(f"malformed ForwardBackwardRequest protobuf: {e}") from None
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    loss_id = None
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text" and key == "loss_id" and msg.loss_fn == "custom":
            loss_id = value.text[:200]
            config.pop(key, None)
        elif value.WhichOneof("value") == "text":
            raise TinkerInputError(f"loss_fn_config[{key!r}]: text values are not supported")
        else:
            config[key] = float(value.number)
    data = [_datum(i, d) for i, d in enumerate(msg.data)]
    return ForwardBackwardCall(
        msg.model_id, msg.seq_id, msg.loss_fn, config, bool(msg.forward_only), data, loss_id
    )


def _datum(i: int, msg: pb.Datum) -> Datum:
    tokens: list[int] = []
    images: list[ImageInput] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            im = chunk.image
            expected = im.expected_tokens if im.HasField("expected_tokens") else None
            images.append(image_input(f"datum {i}", im.data, im.format, expected))
            tokens.extend([IMAGE_SLOT] * images[-1].expected_tokens)
            continue
        if kind != "encoded_text":
            raise TinkerInputError(f"datum {i}: model_input chunk {kind!r} is not supported here")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise TinkerInputError(f"datum {i}: encoded_text tokens are not int32 bytes")
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    if len(msg.model_input_spans) or len(msg.loss_fn_input_spans):
        raise TinkerInputError(f"datum {i}: provenance spans are not supported here")
    cells = max(len(tokens), 1) * MAX_TOPK  # a sparse input's most: [len(tokens), K]
    inputs = {
        name: _tensor(f"datum {i}: loss_fn_inputs[{name!r}]", t, cells)
        for name, t in msg.loss_fn_inputs.items()
    }
    return Datum(tokens, inputs, images)


def _tensor(what: str, msg: pb.Tensor, max_sparse_cells: int) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise TinkerInputError(f"{what}: dtype {msg.dtype} is not supported (float32, int64)")
    if msg.HasField("sparse_csr"):  # the SDK sends 2-D target_tokens and weights so
        csr = msg.sparse_csr
        values = _whole(what, csr.values, dtype)
        crow = _whole(what + " row pointers", csr.crow_indices, np.dtype(np.int64))
        col = _whole(what + " column indices", csr.col_indices, np.dtype(np.int64))
        return csr_dense(what, values, crow, col, list(msg.shape), 0, max_sparse_cells)
    values = _whole(what, msg.dense, dtype)
    shape = list(msg.shape) or [len(values)]
    if int(np.prod(shape)) != len(values):
        raise TinkerInputError(f"{what}: shape {shape} does not hold {len(values)} values")
    return values.reshape(shape)


def _whole(what: str, raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise TinkerInputError(f"{what}: {len(raw)} bytes are not whole {dtype} values")
    return np.frombuffer(raw, dtype=dtype)


def write_forward_output(out: ForwardOutput) -> bytes:
    """A ``ForwardBackwardOutput`` message: one record of every datum's 1-D fields."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(out.outputs)
    names = list(out.outputs[0]) if out.outputs else []
    for name in names:
        arrays = [np.asarray(o[name], dtype=np.float32) for o in out.outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field = record.fields[name]
        field.trailing_shape.extend(int(n) for n in arrays[0].shape[1:])  # (n, K): [K]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
    return msg.SerializeToString()


def write_sample_response(out: SampleOutput) -> bytes:
    msg = pb.SampleResponse()
    for seq in out.sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(out.prompt_logprobs, dtype=np.float32).tobytes()
    if out.topk_prompt is not None:
        ids, lps = out.topk_prompt
        msg.topk_prompt_logprobs.token_ids = np.ascontiguousarray(ids, np.int32).tobytes()
        msg.topk_prompt_logprobs.logprobs = np.ascontiguousarray(lps, np.float32).tobytes()
        msg.topk_prompt_logprobs.length, msg.topk_prompt_logprobs.k = ids.shape
    if out.target_prompt is not None:
        _write_tensor(msg.target_prompt_logprobs, out.target_prompt)
    return msg.SerializeToString()


def _write_tensor(msg: pb.Tensor, values: np.ndarray) -> None:
    """A dense float32 ``Tensor`` message of ``values``."""
    msg.dense = np.ascontiguousarray(values, np.float32).tobytes()
    msg.dtype = pb.DTYPE_FLOAT32
    msg.shape.extend(int(n) for n in values.shape)
