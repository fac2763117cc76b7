"""The folder an exported LoRA policy keeps its adapter in, and reading its ``lora.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LORA_EXPORT = "flowrl-lora"
"""The subfolder of an exported LoRA policy (``TorchTrainer.export_pretrained``) that keeps its
adapter (``adapter.safetensors``) and ``lora.json``: the base model's URI and LoRA settings."""


def lora_export(folder: str) -> dict[str, Any] | None:
    """``lora.json`` of an exported LoRA policy's folder (``base_model``: the URI it was
    trained on; ``lora``: its LoRA settings); None when the folder holds no adapter (a
    full-parameter policy, or one exported before adapters were kept)."""
    where = Path(folder) / LORA_EXPORT / "lora.json"
    if not where.is_file():
        return None
    meta = json.loads(where.read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("base_model"), str):
        raise ValueError(f"{where} is not a flowrl LoRA export (no base_model)")
    return meta
