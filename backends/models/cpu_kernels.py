"""What this machine's CPU kernels can do, read without importing torch, and what a CPU job's
``resources.dtype: auto`` comes to (its flow process decides it, and never imports torch)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

BF16_MIN_PARAMETERS = 50_000_000
"""From this size a CPU job's auto precision is bf16 where the kernels have bf16 dot products.
Measured in whole jobs on a 2-core AMD EPYC (docs/benchmarks/field.md, 2026-11-30): bf16 made
the step 31% shorter at 99M parameters (6.49 -> 4.47 s) and none at 3.19M or 0.34M, where
decoding is bound by per-token overhead and bf16's casts add to it, while its sampler's copy
and the kernels' memory cost 100-400 MB; the threshold lies between the measured sizes. With
eager attention in bf16 (``precision.attention_kernels``, 2026-11-30) a 3.19M job's step fell
1.20 -> 0.92 s but its worker's peak PSS rose 1022 -> 1232 MB (glibc's heap), and TRL's step
in bf16 fell too (1.58 -> 1.44 s): at that size the memory it costs outweighs the time."""

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_BF16_ISAS = ("ALL", "BF16", "AMX", "AVX10")  # ONEDNN_MAX_CPU_ISA values that keep bf16 dots


@functools.cache
def cpu_bf16() -> tuple[bool, str]:
    """Whether this process's CPU kernels have bf16 dot products, and why (or why not): the
    CPU's flags (``/proc/cpuinfo``), and neither ATen's dispatch (``ATEN_CPU_CAPABILITY``) nor
    oneDNN (``ONEDNN_MAX_CPU_ISA``) capped below them, as the test suite pins them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False, "no /proc/cpuinfo to read the CPU's flags from: float32"
    lines = text.splitlines()
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    found = [f for f in _BF16_FLAGS if f in flags]
    if not found:
        return False, "the CPU has no bf16 dot products (AVX512-BF16, AMX): float32"
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability and capability != "avx512":
        return False, f"ATen's kernels are capped at ATEN_CPU_CAPABILITY={capability}: float32"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if not any(k in isa for k in _BF16_ISAS):
        return False, f"oneDNN is capped at ONEDNN_MAX_CPU_ISA={isa}: float32"
    return True, f"the CPU has {'/'.join(found)}: bf16 matmuls run 2-3x float32s"


def pick_cpu_dtype(parameters: int | None, kernels: tuple[bool, str]) -> tuple[str, str]:
    """``resources.dtype: auto`` for a CPU job of a model of ``parameters`` (None: unknown)
    on kernels ``cpu_bf16()`` describes: ``(dtype, why)``."""
    bf16, why = kernels
    if not bf16:
        return "float32", why
    if parameters is None or parameters < BF16_MIN_PARAMETERS:
        size = "of unknown size" if parameters is None else f"of {parameters / 1e6:.2f}M parameters"
        return "float32", (
            f"{why.removesuffix(': bf16 matmuls run 2-3x float32s')}, but the model is {size}, "
            f"under {BF16_MIN_PARAMETERS / 1e6:.0f}M, where bf16 shortened no step: float32"
        )
    return "bfloat16", f"{why}; the model has {parameters / 1e6:.0f}M parameters"
