"""A model on local disk: a plain Hugging Face folder (``config.json``, ``model.safetensors``,
``tokenizer.json`` ...) and what reads it: its tokenizer, facts from its config, its weights.

A model URI becomes such a folder first (``flowrl.backends.models.model_uri.resolve_model_uri``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:  # torch and the model classes load where weights do, not in the flow process
    import torch
    from transformers import PreTrainedModel

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def copy_model_files(src: str, dst: str) -> None:
    """Copy every file of model folder ``src`` that is not weights or ``config.json`` to
    ``dst``, byte for byte: tokenizer, chat template, generation config (its eos ids), processor
    settings. A trained policy is saved with these so that it reloads exactly as its base."""
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.startswith("."):
            if not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(path, Path(dst) / path.name)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load a tokenizer from a local HF folder (never ``AutoTokenizer``: see STACK_NOTES)."""
    return PreTrainedTokenizerFast.from_pretrained(path)


def pad_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its eos (Llama 3 has no
    pad token); padded positions are masked out of attention and loss either way."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def model_positions(path: str) -> int | None:
    """``max_position_embeddings`` of a local model folder (a VLM's text model's), if stated."""
    config = json.loads((Path(path) / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if positions is None:
        positions = (config.get("text_config") or {}).get("max_position_embeddings")
    return int(positions) if positions is not None else None


def is_vision_language(path: str) -> bool:
    """Whether the local HF folder ``path`` holds a vision-language model (its config has a
    ``vision_config``, e.g. LLaVA)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return "vision_config" in config


def load_causal_lm(
    path: str, dtype: torch.dtype | None = None, attention: str | None = None
) -> PreTrainedModel:
    """Load a causal LM from a local HF folder, in eval mode (``dtype`` default float32); a
    vision-language folder (its config has a ``vision_config``, e.g. LLaVA) loads as
    ``AutoModelForImageTextToText``. ``attention``: the attention implementation
    (``backends.models.precision.attention_kernels``); None is transformers' default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = torch.float32 if dtype is None else dtype
    auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
    chosen = {} if attention is None else {"attn_implementation": attention}
    return auto.from_pretrained(path, dtype=dtype, **chosen).eval()


MAX_SAFETENSORS_HEADER = 64 << 20


def weight_count(path: str) -> int | None:
    """How many numbers the local HF folder ``path``'s weights hold (its parameters and
    buffers), summed from the headers of its ``*.safetensors`` files without loading a tensor;
    None where it has none (``.bin`` weights) or a header is not a safetensors header."""
    total, files = 0, sorted(Path(path).glob("*.safetensors"))
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= MAX_SAFETENSORS_HEADER:
                return None
            try:
                header = json.loads(f.read(size))
            except ValueError:
                return None
        for name, entry in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in entry.get("shape", ()):
                    numel *= int(dim)
                total += numel
    return total if files else None
