"""The resolved engine: what `resolve` makes of a profile and the settings, and what every
later step reads (verify's identity, the plan and its cache key, vLLM's arguments, the compile
cache key, the launch).

A value, frozen once made: `ResolvedEngine` and its parts (speculation, LoRA, tensor
parallelism), the knobs a user can override (`KNOBS`, for messages naming where a value came
from), and `digest`, which hashes the whole description minus an explicit ignore list, as
vLLM's own `compute_hash` does: a field added here is part of every cache key unless an ignore
list says why it is not. Making one is `entrypoint.resolve`'s work; this module computes
nothing from a profile.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# What the user can override, and the knob (environment name) that does it.
KNOBS = {
    "max_model_len": "MAX_MODEL_LEN",
    "max_num_seqs": "MAX_NUM_SEQS",
    "kv_cache_memory_bytes": "KV_CACHE_MEMORY_BYTES",
    "enable_prefix_caching": "PREFIX_CACHING",
    "speculation": "SPECULATION",
    "mtp_depth": "MTP_DEPTH",
    "lookup": "LOOKUP",
    "verify_block": "VERIFY_BLOCK",
    "enable_thinking": "ENABLE_THINKING",
    "shutdown_timeout": "SHUTDOWN_TIMEOUT",
    "vision": "VISION",
}


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResolvedSpeculative(_Frozen):
    """Speculative decoding as the engine runs it."""

    method: str  # dflash, mtp, ... (vLLM's speculative_config.method)
    drafter_tokens: int  # the drafter's (or the MTP head's) depth: the profile's, or MTP_DEPTH
    lookup_tokens: int  # verify positions past the drafter's, filled by lookup drafting (patches 0070, 0072)
    draft_sample_method: str | None
    drafter_dir: str | None  # absolute; None for methods without a drafter model
    attention_backend: str | None  # the drafter's layers' backend; None: vLLM selects one for it

    @property
    def num_speculative_tokens(self) -> int:
        """What vLLM verifies per step (its `num_speculative_tokens`)."""
        return self.drafter_tokens + self.lookup_tokens


class ResolvedLora(_Frozen):
    """The adapter served beside the base through vLLM's native per-request LoRA."""

    adapter_id: str
    path: str  # absolute
    base_model_name: str
    max_lora_rank: int
    max_loras: int


class ResolvedVision(_Frozen):
    """Images in: the vision tower loaded and what one request may carry (VISION)."""

    images_per_prompt: int  # vLLM's limit_mm_per_prompt["image"]; our API layer refuses more with a 400
    max_pixels: int  # width x height an image may have (our 400); also the image processor's cap
    # The image processor's options beside the pixel cap (vLLM's mm_processor_kwargs): the CPU
    # build's PIL processor, see `entrypoint.resolve.processor_kwargs`.
    processor_kwargs: dict[str, Any]
    # Hosts image URLs may be fetched from (VISION_URL_DOMAINS; empty: none, images come inline):
    # our API layer's allow-list and vLLM's --allowed-media-domains.
    url_domains: tuple[str, ...] = ()
    # VISION_TOWER: the tower's weights on the device, or in host memory (patch 0087).
    tower: Literal["gpu", "host"] = "gpu"


class ResolvedParallel(_Frozen):
    """Tensor parallelism as the engine runs it: how many GPUs, where, and how they talk."""

    tensor_parallel_size: int
    nodes: int
    node_rank: int  # 0: the head (API server); 1..: a headless worker host
    link: Literal["pcie", "nvlink", "network"]  # between the GPUs: in one host, or between hosts
    link_origin: str  # where `link` came from, for messages
    custom_all_reduce: bool  # vLLM's own all-reduce kernel (else NCCL's)
    nccl_p2p: bool  # NCCL's peer-to-peer transport inside a host (False: NCCL_P2P_DISABLE=1)
    head_address: str | None  # multi-host: the head's IP on the link (vLLM --master-addr)
    head_port: int | None  # multi-host: torch.distributed's rendezvous port (vLLM --master-port)
    node_address: str | None  # multi-host: this host's IP on the link (VLLM_HOST_IP)
    network_interface: str | None  # multi-host: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    rdma_devices: str | None
    nccl_log_level: str | None

    @property
    def headless(self) -> bool:
        """A worker host: vLLM runs its share of the GPUs and no API server."""
        return self.node_rank > 0


class ResolvedEngine(_Frozen):
    """Everything the engine of one command will run with, after the user's overrides."""

    profile: str
    platform: Literal["cpu", "cuda"]
    machine: str
    cuda_arch: str | None
    require_patches: bool
    target_dir: str  # absolute
    served_model_name: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: vLLM's default for the device
    kv_cache_dtype: str
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float | None
    enable_prefix_caching: bool
    mamba_ssm_cache_dtype: str
    block_size: int | None
    attention_backend: str | None
    enforce_eager: bool
    compilation_config: dict[str, Any] | None
    cudagraph_capture_limit: int | None  # the largest CUDA graph captured (see `cudagraph_capture_limit`)
    additional_config: dict[str, Any] | None
    enable_flashinfer_autotune: bool | None
    language_model_only: bool
    tool_call_parser: str | None
    reasoning_parser: str | None
    structured_outputs_config: dict[str, Any] | None
    default_chat_template_kwargs: dict[str, Any] | None
    seed: int | None
    shutdown_timeout: int  # seconds SIGTERM lets in-flight requests run
    extra: dict[str, Any]  # the profile's verbatim vLLM arguments, long-form names with `-`
    speculative: ResolvedSpeculative | None
    lora: ResolvedLora | None
    devices: str | None  # CUDA_VISIBLE_DEVICES (numbered in PCI bus order); None on CPU
    parallel: ResolvedParallel | None  # None: one GPU (or one CPU worker)
    env: dict[str, str]  # the profile's environment for vLLM
    vision: ResolvedVision | None = None  # None: text only (vLLM's language_model_only)
    overridden: tuple[str, ...]  # the KNOBS the user set (for messages: where a value came from)

    @property
    def reads_drafter(self) -> bool:
        """Whether the engine reads the profile's drafter directory (mtp and off do not)."""
        return self.speculative is not None and self.speculative.drafter_dir is not None

    def origin(self, field: str) -> str:
        """How a one-line message names where ``field``'s value came from."""
        value = getattr(self, field)
        if field in self.overridden:
            return f"{KNOBS[field]}={value}"
        return f"profile {self.profile}: engine.{field} = {value}"

    def digest(self, ignore: Iterable[str] = ()) -> str:
        """sha256 over every field but those in ``ignore`` (``a.b`` names a nested field)."""
        return hashlib.sha256(json.dumps(self.factors(ignore), sort_keys=True).encode()).hexdigest()

    def factors(self, ignore: Iterable[str] = ()) -> dict[str, Any]:
        """What `digest` hashes: the whole engine as JSON, less ``ignore`` (which must name fields)."""
        ignored = set(ignore)
        unknown = ignored - set(field_paths())
        if unknown:
            raise ValueError(f"ignore list names no field of ResolvedEngine: {sorted(unknown)}")
        data = self.model_dump(mode="json")
        for name in ignored:
            *parents, leaf = name.split(".")
            node = data
            for parent in parents:
                node = node.get(parent) or {}
            if isinstance(node, dict):
                node.pop(leaf, None)
        return data


def field_paths() -> list[str]:
    """Every field of ResolvedEngine, nested ones as ``parent.child``."""
    nested = {
        "speculative": ResolvedSpeculative, "lora": ResolvedLora, "parallel": ResolvedParallel, "vision": ResolvedVision
    }
    paths = []
    for name in ResolvedEngine.model_fields:
        paths.append(name)
        if name in nested:
            paths.extend(f"{name}.{child}" for child in nested[name].model_fields)
    return paths
