"""A policy's Hugging Face model as both workers load it (``hf_sampler.HFSampler``,
``torch_trainer.TorchTrainer``): the model and its LoRA adapter on the worker's device, its
trainable tensors as bytes, an exported LoRA policy, and the prompt-prefix cache both roles
reuse across the rows of a batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save as save_safetensors

from flowrl.backends.models.lora_export import LORA_EXPORT
from flowrl.backends.models.model_folder import (
    load_causal_lm,
    load_tokenizer,
)
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.models.precision import attention_kernels, compute_dtype
from flowrl.backends.models.vlm import ImageInputs
from flowrl.backends.types import WorkerSpec

if TYPE_CHECKING:
    from peft import LoraConfig


def write_lora_export(
    folder: str, state: dict[str, torch.Tensor], base_uri: str, lora: dict[str, Any]
) -> None:
    """The adapter ``state`` of a policy trained on ``base_uri`` into ``folder``'s
    ``LORA_EXPORT`` subfolder (``models.lora_export`` reads its settings back)."""
    out = Path(folder) / LORA_EXPORT
    out.mkdir()
    (out / "adapter.safetensors").write_bytes(save_safetensors(state))
    (out / "lora.json").write_text(json.dumps({"base_model": base_uri, "lora": lora}))


def worker_device(spec: WorkerSpec) -> torch.device:
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)


def load_policy_model(
    spec: WorkerSpec, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Any, str]:
    """Load the model in ``dtype`` (with a LoRA adapter when enabled), its tokenizer and its
    local path."""
    torch.set_num_threads(spec.torch_threads)
    path = resolve_model_uri(spec.model_uri, spec.cache_dir)
    device = worker_device(spec)
    attention = attention_kernels(compute_dtype(spec.dtype, device), device)
    model = load_causal_lm(path, dtype, attention)
    if spec.lora.enabled:
        from peft import get_peft_model  # imported by LoRA workers only (~0.5 s at start)

        # Same seed in sampler and trainer: both start from identical adapter weights.
        torch.manual_seed(spec.seed)
        model = get_peft_model(model, lora_config(spec))
    return model.to(device), load_tokenizer(path), path


def lora_config(spec: WorkerSpec) -> LoraConfig:
    from peft import LoraConfig

    return LoraConfig(
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=list(spec.lora.target_modules),
        task_type="CAUSAL_LM",
    )


def trainable_state(
    model: torch.nn.Module, lora: bool, adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """Detached CPU copies (tied weights become separate tensors, as safetensors requires);
    with LoRA the adapter named ``adapter``, its keys without the name."""
    if lora:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model, adapter_name=adapter)
    else:
        state = model.state_dict()
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def load_trainable_state(
    model: torch.nn.Module, state: dict[str, torch.Tensor], lora: bool, adapter: str = "default"
) -> None:
    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state, adapter_name=adapter)
    else:
        model.load_state_dict(state, strict=False)


Loaded = tuple[torch.nn.Module, Any, str]
"""A loaded policy model, its tokenizer and its local path (``load_policy_model``)."""


def distinct_rows(rows: list[tuple[Any, ...]]) -> tuple[list[int], list[int]]:
    """(the first row of each distinct value, each row's distinct slot)."""
    slots: dict[tuple[Any, ...], int] = {}
    first: list[int] = []
    index: list[int] = []
    for i, row in enumerate(rows):
        slot = slots.setdefault(row, len(first))
        if slot == len(first):
            first.append(i)
        index.append(slot)
    return first, index


def prefill(model: torch.nn.Module, ids_U_P: torch.Tensor, mask_U_P: torch.Tensor) -> Any:
    """The model's output on the left-padded prefixes ``ids_U_P``, numbered from each row's
    first real token as ``generate`` numbers them; its ``past_key_values`` a ``DynamicCache``."""
    from transformers import DynamicCache

    positions = mask_U_P.long().cumsum(-1) - 1
    positions.masked_fill_(mask_U_P == 0, 1)
    cache = DynamicCache(config=model.config)
    return model(
        input_ids=ids_U_P, attention_mask=mask_U_P, position_ids=positions, past_key_values=cache
    )


def prefilled_cache(
    model: torch.nn.Module, ids_U_P: torch.Tensor, mask_U_P: torch.Tensor, index: list[int]
) -> Any:
    """A ``DynamicCache`` of the left-padded distinct prefixes ``ids_U_P``, copied to the rows
    (row i holds prefix ``index[i]``); gradients flow back through the copies when enabled."""
    cache = prefill(model, ids_U_P, mask_U_P).past_key_values
    cache.reorder_cache(torch.tensor(index, device=ids_U_P.device))
    return cache


def unsampled_token_ids(image_inputs: ImageInputs | None) -> list[int]:
    return image_inputs.unsampled_token_ids if image_inputs is not None else []


def without_tokens(logits_B_T_V: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """The logits with ``token_ids`` at -inf (tokens the policy never samples)."""
    if not token_ids:
        return logits_B_T_V
    logits_B_T_V = logits_B_T_V.clone()
    logits_B_T_V[..., token_ids] = float("-inf")
    return logits_B_T_V
