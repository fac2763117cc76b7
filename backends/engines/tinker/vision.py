"""Image chunks on a vision-language base: what the Tinker engine needs to read images.

A ``ModelInput``'s ``ImageChunk`` (encoded PNG/JPEG bytes, with the number of tokens the
client's renderer expects it to take) becomes ``expected_tokens`` copies of ``IMAGE_SLOT`` in
the datum's or prompt's tokens, and an ``ImageInput`` beside them. Only the model's worker
decodes images: it replaces each slot with the base's image token id, runs the base folder's
own image processor, checks that each image takes the tokens the client expected (a 400 that
gives both counts, as hosted Tinker fails such requests early), and hands the model its pixel
values, grid and ``mm_token_type_ids`` (Qwen-VL's M-RoPE reads them).

Hostile input: an image's bytes and pixels are capped before it is decoded (a decompression
bomb is refused, not expanded), and only PNG and JPEG are opened.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Sequence
from typing import Any

import torch

from flowrl.backends.engines.tinker.types import (
    FORMATS,
    IMAGE_SLOT,
    ImageInput,
    TinkerInputError,
)


def decode(what: str, image: ImageInput) -> Any:
    """An ``ImageInput`` (its header checked when it was made: ``types.image_input``) as an
    RGB PIL image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(image.data), formats=[FORMATS[image.format]]) as opened:
            return opened.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad bytes
        raise TinkerInputError(f"{what}: the {image.format} image does not decode: {e}") from None


class Vision:
    """A vision-language base's image processor and image token: turns a batch's images into
    the model's keyword inputs."""

    def __init__(self, base_path: str, model: torch.nn.Module):
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(base_path)
        config = model.config
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)
        self.fixed_tokens = getattr(config, "image_seq_length", None)
        accepted = inspect.signature(model.forward).parameters
        self.token_types = "mm_token_type_ids" in accepted
        self.rope_holders = [m for m in model.modules() if hasattr(m, "rope_deltas")]

    @classmethod
    def of(cls, base_path: str, model: torch.nn.Module) -> Vision | None:
        """The base's vision, or None for a text-only base."""
        return cls(base_path, model) if hasattr(model.config, "vision_config") else None

    def forget_positions(self) -> None:
        """Drop the M-RoPE offsets a previous image prompt left on the model (the next call's
        prefill computes its own; a text-only decode must not reuse them)."""
        for module in self.rope_holders:
            module.rope_deltas = None

    def inputs(
        self, ids: torch.Tensor, images: Sequence[Sequence[ImageInput]]
    ) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for a batch whose row ``i`` (``ids``, with ``IMAGE_SLOT``
        at image positions, replaced here in place) shows ``images[i]``."""
        slots = ids == IMAGE_SLOT
        ids[slots] = self.image_token_id
        flat = [
            (f"row {i}: image {j}", image)
            for i, row in enumerate(images)
            for j, image in enumerate(row)
        ]
        extra: dict[str, torch.Tensor] = {}
        if self.token_types:
            extra["mm_token_type_ids"] = slots.int()
        if not flat:
            return extra
        pictures = [decode(what, image) for what, image in flat]
        processed = self.processor(images=pictures, return_tensors="pt")
        grid = processed.get("image_grid_thw")
        for k, (what, image) in enumerate(flat):
            if grid is not None:
                tokens = int(grid[k].prod()) // self.merge**2
            else:
                tokens = int(self.fixed_tokens or image.expected_tokens)
            if tokens != image.expected_tokens:
                raise TinkerInputError(
                    f"{what}: the image takes {tokens} tokens on this model, the chunk's "
                    f"expected_tokens is {image.expected_tokens}"
                )
        extra["pixel_values"] = processed["pixel_values"].to(ids.device)
        if grid is not None:
            extra["image_grid_thw"] = grid.to(ids.device)
        return extra


def vision_kwargs(
    vision: Vision | None, ids: torch.Tensor, images: Sequence[Sequence[ImageInput]]
) -> dict[str, torch.Tensor]:
    """The model's keyword inputs beside ``ids`` for rows showing ``images`` (none for a
    text-only base; images given to one are refused)."""
    if vision is None:
        if any(images):
            raise TinkerInputError("this base model reads text only: image chunks are refused")
        return {}
    vision.forget_positions()
    return vision.inputs(ids, images)
