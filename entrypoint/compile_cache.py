"""The compile cache: where the compiled artifacts of one engine shape live.

vLLM keeps torch.compile's graphs, and the model information it records while planning,
under ``VLLM_CACHE_ROOT``. `qwen38 serve` gives every resolved engine a root of its own under
``CACHE_DIR/vllm``, named by a digest of the whole `ResolvedEngine` minus `COMPILE_IGNORED`
(as vLLM's own ``compute_hash`` hashes everything but an explicit list), so a field added to
the resolution later keys the cache until someone says why it need not. The planner uses the
same root (`entrypoint.plan`), so the model information it records is what the engine reads.
"""

from __future__ import annotations

from pathlib import Path

from entrypoint.resolved_engine import ResolvedEngine

# Fields of the resolved engine that cannot change a compiled graph; every other field
# keys the compile cache (as vLLM's own compute_hash ignores an explicit list).
COMPILE_IGNORED = {
    "served_model_name": "the id clients use",
    "tool_call_parser": "API layer",
    "reasoning_parser": "API layer",
    "structured_outputs_config": "API layer",
    "default_chat_template_kwargs": "API layer",
    "seed": "sampling (vLLM's ModelConfig hash ignores it too)",
    "kv_cache_memory_bytes": "the pool's size (vLLM's CacheConfig hash ignores it too)",
    "gpu_memory_utilization": "the pool's size (vLLM's CacheConfig hash ignores it too)",
    "lora.adapter_id": "which adapter, not its shape",
    "lora.path": "which adapter, not its shape",
    "lora.base_model_name": "which adapter, not its shape",
    "shutdown_timeout": "how long a stop waits, not what runs",
    "overridden": "where a value came from, not the value",
    "devices": "which GPUs, not what runs on them",
    "parallel.link": "what it decides (custom_all_reduce, nccl_p2p) is keyed instead",
    "parallel.link_origin": "where a value came from, not the value",
    "parallel.node_rank": "each host keeps its own cache (vLLM keys its artifacts by rank inside)",
    "parallel.head_address": "where the hosts are, not what they compile",
    "parallel.head_port": "where the hosts are, not what they compile",
    "parallel.node_address": "where the hosts are, not what they compile",
    "parallel.network_interface": "where the hosts are, not what they compile",
    "parallel.rdma_devices": "where the hosts are, not what they compile",
    "parallel.nccl_log_level": "NCCL's log level",
    "vision.processor_kwargs": "which image processor reads the pixels (PIL or torchvision), not what runs after",
}


def compile_cache_key(resolved: ResolvedEngine) -> str:
    """A cache directory name keyed by everything that may shape the compiled graphs.

    vLLM 0.28.0's own compile-cache hash misses the speculative depth (upstream #53292);
    keying the whole cache root by the resolved engine (minus `COMPILE_IGNORED`) keeps two
    shapes from ever sharing an artifact, patched or not.
    """
    return f"{resolved.profile}-{resolved.digest(COMPILE_IGNORED)[:12]}"


def vllm_cache_root(cache_dir: Path, resolved: ResolvedEngine) -> Path:
    """The engine's VLLM_CACHE_ROOT: compile caches (and model info) of this shape only."""
    return cache_dir.absolute() / "vllm" / compile_cache_key(resolved)
