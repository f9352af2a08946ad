"""How much of a CUDA GPU a test engine asks for when its KV pool is pinned in bytes.

With ``kv_cache_memory_bytes`` set, vLLM sizes nothing from ``gpu_memory_utilization``; it only
checks at start-up that ``utilization x total`` is free (``v1/worker/utils.request_memory``). A
tiny model's engine needs a few GiB, so asking for a tenth lets the GPU tier run its lanes side
by side on one GPU (tests/gpu/lent_machine.sh) instead of each probe claiming 90 % of it.
"""

from __future__ import annotations

SHARED_GPU_UTILIZATION = 0.1


def gpu_share() -> dict[str, float]:
    """``LLM(...)`` keyword arguments for an engine with a pinned pool: a small share on CUDA,
    nothing elsewhere (the CPU build reads no utilization)."""
    import torch

    return {"gpu_memory_utilization": SHARED_GPU_UTILIZATION} if torch.cuda.is_available() else {}
