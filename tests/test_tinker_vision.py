"""Image chunks through the Tinker SDK (0.38) on a tiny Qwen3-VL in the service's catalogue:
a model learns to tell images apart by training on them, samples with them as it trains, and
bad images are 400s that leave the service serving."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tinker
from families import build_qwen3_vl
from PIL import Image
from services import TinkerServer
from tinker import types

from flowrl.backends.models.tinker_checkpoints import resolve_base_model
from flowrl.backends.policy.placement import InProcess
from flowrl.backends.services.tinker.service import TinkerService

KEY = "tml-vision-" + "v" * 24
VL = "Qwen/Qwen3-VL-30B-A3B-Instruct"
COLORS = {"red": (220, 30, 30), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the service's url, the fixture's folder)."""
    root = tmp_path_factory.mktemp("vision")
    folder = build_qwen3_vl(root / "qwen3-vl")
    tiny = resolve_base_model("tiny", str(root / "model-cache"))
    catalogue = {VL: folder, "flowrl/tiny": tiny}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLOWRL_HOME", str(root / "home"))
        server = TinkerServer(TinkerService(InProcess(), catalogue=catalogue, keys={KEY: "v"}))
        try:
            yield server.url, folder
        finally:
            server.stop()


def _png(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


class Chat:
    """The fixture's Qwen3-VL chat format, as the cookbook's ``qwen3_vl_instruct`` renders a
    user turn with an image: text chunks around an ``ImageChunk``."""

    def __init__(self, folder: str):
        from transformers import AutoTokenizer
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def image(self, data: bytes, expected: int | None = None) -> types.ImageChunk:
        if expected is None:
            width, height = Image.open(io.BytesIO(data)).size
            patches = self.processor.get_number_of_image_patches(height, width, images_kwargs={})
            expected = patches // self.processor.merge_size**2
        return types.ImageChunk(data=data, format="png", expected_tokens=expected)

    def prompt(self, image: types.ImageChunk, after: list[int] | None = None) -> types.ModelInput:
        """A user turn showing ``image``, the assistant's turn opened (then ``after``)."""
        head = self.tokens("<|im_start|>user\n<|vision_start|>")
        tail = self.tokens("<|vision_end|>What color is it?<|im_end|>\n<|im_start|>assistant\n")
        chunks = [types.EncodedTextChunk(tokens=head), image]
        return types.ModelInput(
            chunks=[*chunks, types.EncodedTextChunk(tokens=tail + (after or []))]
        )

    def datum(self, image: types.ImageChunk, reply: list[int]) -> types.Datum:
        """The prompt and ``reply``, shifted by one; the loss on the reply alone."""
        full = self.prompt(image, reply)
        *before, last = full.chunks
        model_input = types.ModelInput(
            chunks=[*before, types.EncodedTextChunk(tokens=last.tokens[:-1])]
        )
        n = full.length
        targets = [0] * (n - 1 - len(reply)) + reply  # under image positions: weight 0
        weights = [0.0] * (n - 1 - len(reply)) + [1.0] * len(reply)
        return types.Datum(
            model_input=model_input,
            loss_fn_inputs={"target_tokens": targets, "weights": weights},
        )


def test_a_vlm_learns_to_tell_images_apart_and_samples_with_them(vl: tuple[str, str]) -> None:
    url, folder = vl
    chat = Chat(folder)
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=VL, rank=8)
    images = {name: chat.image(_png(rgb)) for name, rgb in COLORS.items()}
    assert {im.expected_tokens for im in images.values()} == {4}
    data = [chat.datum(images[name], chat.tokens(f" {name}<|im_end|>")) for name in COLORS]
    losses = []
    for _ in range(40):
        out = trainer.forward_backward(data, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert losses[-1] < 0.05 * losses[0], losses

    sampler = trainer.save_weights_and_get_sampling_client(name="colors")
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=["<|im_end|>"])
    for name, image in images.items():
        seq = sampler.sample(chat.prompt(image), 1, greedy).result().sequences[0]
        assert chat.tokenizer.decode(seq.tokens).replace("<|im_end|>", "").strip() == name
        # the sampler's log-probs are the trainer's for the same tokens and image
        fwd = trainer.forward([chat.datum(image, list(seq.tokens))], "cross_entropy").result()
        logprobs = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[-len(seq.tokens) :]
        np.testing.assert_allclose(logprobs, seq.logprobs, atol=1e-4)
    client.close("success").result()


def _claims_size(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def test_bad_images_are_400s_and_the_service_goes_on(vl: tuple[str, str]) -> None:
    url, folder = vl
    chat = Chat(folder)
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=VL, rank=8)
    red = _png(COLORS["red"])
    # refused as the request comes (the image's header)
    cases = {
        "does not decode": types.ImageChunk(data=b"not a png", format="png", expected_tokens=4),
        "5000x5000 pixels (at most": types.ImageChunk(
            data=_claims_size(5000, 5000), format="png", expected_tokens=4
        ),
        "decompression bomb": types.ImageChunk(
            data=_claims_size(60000, 60000), format="png", expected_tokens=4
        ),
    }
    for expected_error, image in cases.items():
        with pytest.raises(tinker.BadRequestError, match=expected_error.replace("(", r"\(")):
            trainer.forward_backward(
                [chat.datum(image, chat.tokens(" red"))], "cross_entropy"
            ).result()
    # refused by the model's own processor: the request fails, naming both counts
    wrong = chat.datum(chat.image(red, expected=9), chat.tokens(" red"))
    with pytest.raises(
        tinker.RequestFailedError, match="takes 4 tokens on this model, the chunk's"
    ):
        trainer.forward_backward([wrong], "cross_entropy").result()
    # an image for a base that reads text only
    text_only = client.create_lora_training_client(base_model="flowrl/tiny", rank=4)
    chunks = [
        types.EncodedTextChunk(tokens=[1, 2]),
        chat.image(red),
        types.EncodedTextChunk(tokens=[3]),
    ]
    datum = types.Datum(
        model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"target_tokens": [0] * 7}
    )
    with pytest.raises(tinker.RequestFailedError, match="reads text only"):
        text_only.forward_backward([datum], "cross_entropy").result()
    # an image pointer (a URL in the data) is refused, never fetched
    pointer = {"type": "image_asset_pointer", "format": "png", "location": "http://x/y.png"}
    body = {"prompt": {"chunks": [pointer]}, "num_samples": 1, "sampling_params": {}}
    r = httpx.post(f"{url}/api/v1/asample", json=body, headers={"X-API-Key": KEY}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    out = trainer.forward_backward(
        [chat.datum(chat.image(red), chat.tokens(" red"))], "cross_entropy"
    ).result()
    assert out.metrics["loss:sum"] > 0
    client.close("success").result()
