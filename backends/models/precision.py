"""The workers' precision (``resources.dtype``): one policy for every sampler and trainer.

- **Sampler** (``HFSampler``; vLLM's ``dtype``): weights and activations in the compute dtype.
- **Trainer** (``TorchTrainer`` and the DeepSpeed trainers): float32 master weights, float32
  gradients and float32 AdamW state, whatever the compute dtype; with bfloat16 the forward pass
  runs under ``torch.autocast`` (matmuls in bf16 from weights rounded on the fly), so updates
  smaller than bf16's resolution still accumulate in the master weights.
- **Log-probs**: the logits are upcast to float32 before the log-softmax on both sides
  (``algorithms.token_logprobs``), so the loss, the ratio and every KL see float32 numbers.
- **Weight sync**: the trainer sends its float32 weights; loading them into a bf16 sampler rounds
  them to nearest, the same rounding autocast applies in the trainer's forward.

The two sides still differ in bf16 (the sampler keeps its residual stream in bf16, the
trainer's stays float32): ``train/mismatch_kl`` (``algorithms.mismatch_kl``) shows how much.

``auto`` is bfloat16 on CUDA, float32 on a CPU. A job's flow decides a CPU job's ``auto``
before its workers start (``flows/auto.py``, ``cpu_kernels.pick_cpu_dtype``): bfloat16 for a
model of 50M parameters or more where the CPU's kernels have bf16 dot products (AVX512-BF16 or
AMX: a bf16 matrix multiply runs 2-3x a float32 one, as TRL's default ``bf16=True`` autocast
uses), else float32.
"""

from __future__ import annotations

import contextlib

import torch

from flowrl.backends.types import Precision


def compute_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """The dtype a worker on ``device`` computes in for ``precision`` (``auto``: see above)."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]


def forward_autocast(
    dtype: torch.dtype, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """Context for the trainer's forward pass: bf16 autocast over float32 master weights, or
    nothing at float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def attention_kernels(dtype: torch.dtype, device: torch.device) -> str | None:
    """The attention implementation of a worker that computes in ``dtype`` on ``device``:
    ``eager`` (matmul, float32 softmax, matmul) on a CPU computing in bfloat16, where torch's
    fused CPU attention (SDPA) is slow in bf16: with eager, sampling a batch took 0.66-0.88x
    and a forward and backward pass 0.55-0.86x the time at the benchmark's sizes
    (docs/benchmarks/cpu_attention.md), and a ~100M job's step 3.54 s against 4.14. Else None,
    transformers' default (SDPA: on a CUDA GPU, and on a CPU in float32, where eager was no
    faster: 0.97-1.00x)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "eager"
    return None
