"""Vision-language models offline: a tiny LLaVA (CLIP vision tower + Llama text model) with its
processor, and what the chat format and the workers need to feed it images.

Images travel through flowrl as encoded bytes (PNG/JPEG: small and picklable, JSON as base64).
They become ``pixel_values`` only inside the sampler and trainer workers, through the model
folder's own image processor (the PIL one: no torchvision). In the prompt, each image is
``image_seq_length`` copies of ``IMAGE_TOKEN``, one per image feature, exactly the ids the model
consumes; LLaVA scatters the features into those positions in order.

The folder is a standard HF folder (``config.json`` with a ``vision_config``,
``model.safetensors``, the tokenizer files, ``processor_config.json``):
``AutoModelForImageTextToText`` and ``AutoProcessor`` load it.
"""

from __future__ import annotations

import io

import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from flowrl.backends.models.model_folder import is_vision_language
from flowrl.backends.models.tiny_model import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN,
    TinyModelSpec,
    build_tokenizer,
    llama_config,
    save_tokenizer,
)

_TEXT_CONTENT = "{%- if message.content is defined -%}{{ message.content }}{%- endif -%}"
_PARTS_CONTENT = (
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- elif message.content is defined -%}"
    "{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<image>"
    "{%- elif part.type == 'text' -%}{{ part.text }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
)
assert _TEXT_CONTENT in CHAT_TEMPLATE
MULTIMODAL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_CONTENT, _PARTS_CONTENT)
"""``CHAT_TEMPLATE`` where a message's content may also be a list of parts: ``{"type": "image"}``
renders as one ``<image>`` (a literal, so ``sanitize_control_tokens`` keeps "<image>" typed in
message text as plain characters), ``{"type": "text", "text": ...}`` as its text."""

"""Files that hold a processor's settings (beside the tokenizer's own files)."""


def build_tiny_vlm(spec: TinyModelSpec, out_dir: str) -> str:
    """Build a random-weight ``LlavaForConditionalGeneration`` and its ``LlavaProcessor``.

    Text model: the Llama of ``spec`` (as ``build_tiny_model``); tokenizer: ``build_tokenizer()``
    plus ``IMAGE_TOKEN`` (the last id) and ``MULTIMODAL_CHAT_TEMPLATE``; vision: a CLIP tower of
    ``spec.vision`` whose patch features (CLS dropped: ``vision_feature_select_strategy
    "default"``) go through LLaVA's projector. Deterministic in ``spec``; the global torch RNG is
    left untouched. Writes a standard HF folder to ``out_dir`` and returns ``out_dir``.
    """
    vision = spec.vision
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = MULTIMODAL_CHAT_TEMPLATE
    tokenizer.model_max_length = spec.max_position_embeddings
    side = {"height": vision.image_size, "width": vision.image_size}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": vision.image_size}, crop_size=side
        ),
        tokenizer=tokenizer,
        patch_size=vision.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
    )
    config = LlavaConfig(
        text_config=llama_config(spec, tokenizer),
        vision_config=CLIPVisionConfig(
            hidden_size=vision.hidden_size,
            intermediate_size=vision.intermediate_size,
            num_hidden_layers=vision.num_layers,
            num_attention_heads=vision.num_heads,
            image_size=vision.image_size,
            patch_size=vision.patch_size,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlavaForConditionalGeneration(config)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)  # the tokenizer's own files, as load_tokenizer reads them
    return out_dir


def image_seq_length(path: str) -> int:
    """Prompt tokens per image for the model at ``path`` (0 for a text-only model).

    Measured by the folder's own processor on a blank image, so it is whatever the processor
    expands ``IMAGE_TOKEN`` to (LLaVA: ``(side / patch)^2`` for the "default" strategy).
    """
    if not is_vision_language(path):
        return 0
    processor = AutoProcessor.from_pretrained(path)
    side = _processed_side(processor)
    ids = processor(text=IMAGE_TOKEN, images=[Image.new("RGB", (side, side))])["input_ids"][0]
    return sum(1 for t in ids if t == processor.image_token_id)


def _processed_side(processor: LlavaProcessor) -> int:
    crop = getattr(processor.image_processor, "crop_size", None) or {"height": 32}
    return int(crop["height"])


def decode_image(data: bytes) -> Image.Image:
    """An encoded image (PNG/JPEG bytes) as an RGB PIL image."""
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class ImageInputs:
    """Turns encoded images into ``pixel_values`` with a model folder's image processor.

    ``unsampled_token_ids`` (the image token) is never sampled: the policy's distribution is
    the model's with those logits at -inf, in the sampler and the trainer alike, so a completion
    never holds an image token that no image backs.
    """

    def __init__(self, path: str):
        processor = AutoProcessor.from_pretrained(path)
        self.image_processor = processor.image_processor
        self.unsampled_token_ids: list[int] = [int(processor.image_token_id)]

    @classmethod
    def for_model(cls, path: str) -> ImageInputs | None:
        """The image inputs of the model at ``path``; None for a text-only model."""
        return cls(path) if is_vision_language(path) else None

    def pixel_values(self, images: list[bytes]) -> torch.Tensor:
        """``(N, 3, H, W)`` float pixel values of ``N`` encoded images, in order."""
        decoded = [decode_image(data) for data in images]
        return self.image_processor(images=decoded, return_tensors="pt")["pixel_values"]


def vision_inputs(
    inputs: ImageInputs | None, images: list[list[bytes]] | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """``{"pixel_values": ...}`` for a batch whose row ``i`` shows ``images[i]`` (flattened in
    row order, which is the order of the image tokens in the batch); ``{}`` when no row has
    an image. Raises ``ValueError`` for images given to a text-only model."""
    flat = [data for row in images or [] for data in row]
    if not flat:
        return {}
    if inputs is None:
        raise ValueError(f"{len(flat)} images were given to a model that reads text only")
    return {"pixel_values": inputs.pixel_values(flat).to(device)}
