"""What this machine's CPU kernels can do, read without importing torch (a job's flow process
decides its workers' ``resources.dtype: auto`` with it, and never imports torch)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

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
    return True, f"the CPU has {'/'.join(found)}: bf16 matmuls run 2-3x float32's"
