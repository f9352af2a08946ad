"""The KV-cache arithmetic of one engine configuration, done by vLLM 0.28.0 itself.

Runs in a child process (``python -m entrypoint.kv_capacity`` with JSON requests on
stdin, the JSON results on stdout) whose PYTHONPATH puts a stock or a patched view of
the vLLM tree first, so the same request is answered by either version of
``vllm/v1/core/kv_cache_utils.py``.

What is ours is only how the per-layer KV-cache specs are built from config.json
files, the way the model runner would build them on the GPU: one FullAttentionSpec
per target attention layer, one MambaSpec per GDN layer (shapes and dtypes from the
model class), one SlidingWindowSpec or FullAttentionSpec per drafter layer, all per GPU
(with tensor parallelism each GPU holds 1/TP of the heads and of the state), each
shaped by the attention backend the GPU would select (its block-size preference,
kernel block sizes, page customisation). Block-size alignment, grouping, page
unification, the pool division, the capacity and the admission check are vLLM's
functions (`Platform.update_block_size_for_backend`, `get_kv_cache_configs`,
`get_kv_cache_groups`, `get_kv_cache_config_from_groups`, `get_kv_cache_capacity`).

Planning a CUDA configuration on a machine without a GPU needs two switches, both
limited to this process: the V2 model runner's "requires Triton" check is told
Triton exists, and the CPU platform's config hook (which would force CPU block sizes
and state dtypes) is skipped, so the engine config is the one a CUDA build resolves.

One vLLM import per process is the whole cost of a plan (about 10 s of CPU), so this
process does not start another: vLLM inspects a model class in a subprocess (to keep
CUDA uninitialised in a process that will serve), and here inspects it in-process with
the same function (`_inspect_in_this_process`). The process never serves.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from core.profiles import K4V2_KV_CACHE_DTYPE

# vLLM 0.28.0 platforms/cuda.py `_get_backend_priorities` (non-MLA, not SM100):
# the first backend whose validate_configuration accepts the layer is used.
CUDA_BACKEND_PRIORITY = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")

# The k4v2_g128 KV format (docs/kv-k4v2.md): its definition, bytes and kernels. vLLM's copy where
# the tree delivers it (vllm/v1/attention/ops/), else this source in the series.
K4V2_SOURCE = Path(__file__).resolve().parent.parent / "patches/src/v1/attention/ops/qwen38_kv_k4v2.py"
K4V2_BACKEND = "TRITON_ATTN"  # the backend whose write and decode/verify paths read the format


def plan_request(request: dict[str, Any]) -> dict[str, Any]:
    """Answer one planning request (`entrypoint.plan.build_request` makes it)."""
    _emulate_cuda(request["platform"] == "cuda")

    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    # vLLM's arguments for the engine, as the launch gives them (`entrypoint.engine_args`); the
    # weights are never read (a config-only copy of the model) and no tokenizer is needed.
    kwargs: dict[str, Any] = {**request["engine_args"], "load_format": "dummy", "skip_tokenizer_init": True}
    k4v2 = _k4v2_laid_out_here(kwargs)
    config = EngineArgs(**kwargs).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)

    if k4v2 is not None:
        request = {**request, "attention_backend": K4V2_BACKEND}
    backend, backend_name = _select_backend(request, config)
    if k4v2 is not None:
        backend = _k4v2_backend(backend, k4v2)
    if config.speculative_config is not None and config.speculative_config.method == "mtp":
        # The MTP head is a layer of the target's model (its config, its backend).
        drafter_backend, drafter_backend_name = backend, backend_name
    else:
        drafter_backend, drafter_backend_name = _select_backend(request, config, drafter=True)
    _align_block_size(config, backend, request["platform"] == "cuda")
    specs = _layer_specs(config, backend, drafter_backend)
    result = _capacity(config, specs)
    result["backend"] = backend_name
    result["drafter_backend"] = drafter_backend_name if config.speculative_config else None
    result["async_scheduling"] = bool(config.scheduler_config.async_scheduling)
    result["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
    result["mamba_cache_mode"] = config.cache_config.mamba_cache_mode
    result["kv_cache_dtype"] = k4v2.KV_CACHE_DTYPE if k4v2 is not None else config.cache_config.cache_dtype
    result["kv_layout"] = (
        f"{k4v2.KV_CACHE_DTYPE} laid out by the planner from its definition ({k4v2.TOKEN_HEAD_BYTES} B per token "
        f"and KV head, {k4v2.BLOCK_SIZE}-token kernel pages; this vLLM tree does not register the dtype)"
        if k4v2 is not None
        else "vLLM's"
    )
    return result


def layer_cache_dtype(cache_dtype: str, head_size: int, sliding_window: int | None) -> str:
    """The KV cache dtype vLLM gives one attention layer: k4v2_g128 only where the format holds the
    layer (its `holds_layer`, the rule of patch 0047 in attention.py), else the model dtype."""
    if cache_dtype == K4V2_KV_CACHE_DTYPE and not k4v2_format().holds_layer(head_size, sliding_window):
        return "auto"
    return cache_dtype


def k4v2_format():
    """The k4v2_g128 module: vLLM's copy where the tree has it, else the series' source."""
    try:
        from vllm.v1.attention.ops import qwen38_kv_k4v2

        return qwen38_kv_k4v2
    except ImportError:
        pass
    name = "qwen38_kv_k4v2"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, K4V2_SOURCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _k4v2_laid_out_here(kwargs: dict[str, Any]):
    """Where the engine asks for k4v2_g128 and this vLLM does not register it, plan it as the
    series' integration defines it (docs/kv-k4v2.md): the engine config is built with the model
    dtype for the cache (what every layer the format does not cover keeps), and `_k4v2_backend`
    gives the target's attention layers the format's pages. Returns the format's module then
    (``kwargs`` changed), else None (vLLM's own arithmetic throughout)."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    name = kwargs.get("kv_cache_dtype")
    if name in STR_DTYPE_TO_TORCH_DTYPE or name in (None, "auto"):
        return None
    module = k4v2_format()
    if name != module.KV_CACHE_DTYPE:
        return None
    kwargs["kv_cache_dtype"] = "auto"
    return module


def _k4v2_backend(base, k4v2):
    """``base`` (the Triton backend) as the k4v2 integration extends it: a full-attention layer of
    the format's head size stores `TOKEN_HEAD_BYTES` per token and KV head (4-bit K and 2-bit V
    codes, fp16 step and minimum per 128 dims) in kernel pages of the format's `BLOCK_SIZE`
    tokens; any other layer (the DFlash2 drafter's head-128 sliding-window layers) keeps the
    model dtype, as vLLM's ``--kv-cache-dtype-skip-layers`` would leave it."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    class K4V2TritonBackend(base):
        @classmethod
        def customize_spec(cls, spec):
            packed = (
                type(spec) is FullAttentionSpec
                and spec.state_content_bytes is None
                and spec.head_size == spec.head_size_v
                and k4v2.holds_layer(spec.head_size, spec.sliding_window)
            )
            if not packed:
                return base.customize_spec(spec)
            return replace(spec, dtype=torch.uint8, state_content_bytes=k4v2.TOKEN_HEAD_BYTES)

        @staticmethod
        def get_supported_kernel_block_sizes():
            return [k4v2.BLOCK_SIZE]

    return K4V2TritonBackend


_ORIGINAL_PLATFORM_HOOK: dict[str, Any] = {}


def _emulate_cuda(on: bool) -> None:
    """Switch this process between planning for CUDA and planning for what it runs on."""
    import vllm.config.vllm as vllm_config_module
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    platform = type(current_platform)
    if not _ORIGINAL_PLATFORM_HOOK:
        _ORIGINAL_PLATFORM_HOOK["hook"] = platform.__dict__.get("check_and_update_config")
    if on:
        vllm_config_module.HAS_TRITON = True
        platform.check_and_update_config = classmethod(lambda cls, config: None)
    else:
        vllm_config_module.HAS_TRITON = HAS_TRITON
        original = _ORIGINAL_PLATFORM_HOOK["hook"]
        if original is not None:
            platform.check_and_update_config = original
        elif "check_and_update_config" in platform.__dict__:
            del platform.check_and_update_config


def _select_backend(request: dict[str, Any], config, *, drafter: bool = False):
    """The attention backend class the platform would pick for the target's (or the
    drafter's) attention layers."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    if request["platform"] != "cuda":
        return AttentionBackendEnum.CPU_ATTN.get_class(), "CPU_ATTN"
    # vLLM builds the drafter with the speculative config's backend, never the target's
    # (v1/worker/gpu/spec_decode/dflash/utils.py): None means it selects one of its own.
    if drafter and config.speculative_config is not None and config.speculative_config.attention_backend:
        chosen = config.speculative_config.attention_backend
        return chosen.get_class(), chosen.name
    forced = None if drafter else request.get("attention_backend")
    if forced:
        return AttentionBackendEnum[forced].get_class(), forced
    if drafter and config.speculative_config is not None:
        hf = config.speculative_config.draft_model_config.hf_config
        head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        window = getattr(hf, "sliding_window", None)
        non_causal = getattr(hf, "is_causal", True) is False
    else:
        head_size = config.model_config.get_head_size()
        window, non_causal = None, False
    sliding = bool(window)
    selector = AttentionSelectorConfig(
        head_size=head_size,
        dtype=config.model_config.dtype,
        kv_cache_dtype=layer_cache_dtype(config.cache_config.cache_dtype, head_size, window or None),
        block_size=None,
        has_sliding_window=sliding,
        use_non_causal=non_causal,
    )
    capability = DeviceCapability(*request["device_capability"])
    reasons = {}
    for name in CUDA_BACKEND_PRIORITY:
        try:
            backend = AttentionBackendEnum[name].get_class()
            invalid = backend.validate_configuration(device_capability=capability, **selector._asdict())
        except ImportError as exc:
            reasons[name] = f"not importable here ({exc.name})"
            continue
        if not invalid:
            return backend, name
        reasons[name] = "; ".join(invalid)
    raise ValueError(f"no attention backend accepts this layer: {reasons}")


def _align_block_size(config, backend, emulate_cuda: bool) -> None:
    """Run the platform's own `update_block_size_for_backend` (block size from the
    backend, hybrid attention/mamba page alignment) as the worker does once the model
    is built, with ``backend`` as the layers' backend. Planning for CUDA uses the base
    `Platform` implementation, which the CUDA platform does not override."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform

    platform = type(current_platform)
    saved = platform.__dict__.get("_find_non_ssm_backend")
    platform._find_non_ssm_backend = classmethod(lambda cls, vllm_config: backend)
    try:
        if emulate_cuda:
            Platform.update_block_size_for_backend.__func__(platform, config)
        else:
            platform.update_block_size_for_backend(config)
    finally:
        if saved is not None:
            platform._find_non_ssm_backend = saved
        else:
            del platform._find_non_ssm_backend


def _layer_specs(config, backend, drafter_backend) -> dict[str, Any]:
    """One KV-cache spec per layer, as the model runner builds them."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, get_kv_quant_mode

    model = config.model_config
    cache = config.cache_config
    spec_config = config.speculative_config
    num_spec = spec_config.num_speculative_tokens if spec_config else 0
    text = model.hf_text_config
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    specs: dict[str, Any] = {}

    def attention(layer_backend, num_kv_heads, head_size, sliding_window=None):
        stride = layer_backend.indexes_kv_by_block_stride()
        cache_dtype = layer_cache_dtype(cache.cache_dtype, head_size, sliding_window)
        kv_dtype = model.dtype if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
        quant_mode = get_kv_quant_mode(cache_dtype)
        if sliding_window is None:
            spec = FullAttentionSpec(
                block_size=cache.block_size,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                head_size_v=head_size,
                dtype=kv_dtype,
                kv_quant_mode=quant_mode,
            )
        else:
            # Attention.get_kv_cache_spec: a sliding-window layer starts at the
            # smallest kernel block that fits (no shared page: the smallest).
            per_token = layer_backend.customize_spec(
                SlidingWindowSpec(
                    block_size=1,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    head_size_v=head_size,
                    dtype=kv_dtype,
                    kv_quant_mode=quant_mode,
                    sliding_window=sliding_window,
                )
            ).real_page_size_bytes
            spec = SlidingWindowSpec(
                block_size=_largest_kernel_block_within(
                    layer_backend, per_token, cache.skip_page_size_padded, cache.block_size
                ),
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                head_size_v=head_size,
                dtype=kv_dtype,
                kv_quant_mode=quant_mode,
                sliding_window=sliding_window,
                page_size_padded=cache.skip_page_size_padded,
            )
        return layer_backend.customize_spec(replace(spec, indexes_kv_by_block_stride=stride))

    with set_current_vllm_config(config):
        model_cls = None
        if "linear_attention" in layer_types:
            model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
        head_size = model.get_head_size()
        num_kv_heads = model.get_num_kv_heads(config.parallel_config)
        for index, kind in enumerate(layer_types):
            if kind == "linear_attention":
                specs[f"model.layers.{index}.linear_attn"] = MambaSpec(
                    shapes=tuple(model_cls.get_mamba_state_shape_from_config(config)),
                    dtypes=model_cls.get_mamba_state_dtype_from_config(config),
                    block_size=cache.mamba_block_size,
                    page_size_padded=cache.mamba_page_size_padded,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                    mamba_cache_mode=cache.mamba_cache_mode,
                    num_speculative_blocks=num_spec,
                )
            else:
                specs[f"model.layers.{index}.self_attn.attn"] = attention(backend, num_kv_heads, head_size)
        if spec_config is None:
            return specs
        first = len(layer_types)
        if spec_config.method == "mtp":
            for index in range(getattr(text, "mtp_num_hidden_layers", 1)):
                specs[f"mtp.layers.{first + index}.self_attn.attn"] = attention(
                    backend, num_kv_heads, head_size
                )
        elif spec_config.method == "dflash":
            hf = spec_config.draft_model_config.hf_config
            draft_types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
            draft_head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
            # The drafter's heads split over its own TP size (the target's, unless set).
            draft_kv_heads = spec_config.draft_model_config.get_num_kv_heads(spec_config.draft_parallel_config)
            for index, kind in enumerate(draft_types):
                window = hf.sliding_window if kind == "sliding_attention" else None
                specs[f"model.layers.{first + index}.self_attn.attn"] = attention(
                    drafter_backend, draft_kv_heads, draft_head, window
                )
        elif spec_config.method not in ("ngram", "ngram_gpu", "suffix"):
            raise ValueError(f"the planner does not model speculative method {spec_config.method!r}")
    return specs


def _capacity(config, specs: dict[str, Any]) -> dict[str, Any]:
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    pool = config.cache_config.kv_cache_memory_bytes  # per GPU: every worker pins it for itself
    workers = config.parallel_config.world_size
    refusal = None
    try:
        # As the engine core asks it: one spec dict and one pool per worker (all alike here).
        kv_cache_utils.get_kv_cache_configs(config, [dict(specs) for _ in range(workers)], [pool] * workers)
    except (ValueError, NotImplementedError) as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    try:
        groups = kv_cache_utils.get_kv_cache_groups(config, dict(specs))
    except NotImplementedError as exc:
        return {"fits": False, "refusal": refusal or str(exc), "groups": [], "layout_error": str(exc)}
    kv_config = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, pool)
    pool_tokens, max_concurrency = kv_cache_utils.get_kv_cache_capacity(config, kv_config)
    group_size = max(len(g.layer_names) for g in groups)
    page = groups[0].kv_cache_spec.page_size_bytes
    bytes_per_block = page * group_size
    group_rows = []
    blocks_max = blocks_min = 0
    state_bytes = window_bytes = 0
    for group in groups:
        spec = group.kv_cache_spec
        blocks = cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)
        if isinstance(spec, MambaSpec):
            kind, minimum = "gdn-state", blocks
            state_bytes += blocks * bytes_per_block
        elif isinstance(spec, SlidingWindowSpec):
            kind, minimum = "sliding-window", 1
            window_bytes += blocks * bytes_per_block
        else:
            kind, minimum = "attention", 1
        blocks_max += blocks
        blocks_min += minimum
        group_rows.append(
            {
                "kind": kind,
                "layers": len(group.layer_names),
                "block_size": spec.block_size,
                "page_bytes": spec.page_size_bytes,
                "blocks_per_request": blocks,
            }
        )
    num_blocks = kv_config.num_blocks
    max_len = config.model_config.max_model_len
    slots = config.scheduler_config.max_num_seqs
    spare = num_blocks - blocks_max
    lookahead = config.num_lookahead_tokens
    in_flight = 1 if config.scheduler_config.async_scheduling else 0
    peak, longest = _running_peak(group_rows, max_len, lookahead, in_flight, num_blocks)
    stall = None
    if refusal is None and peak > num_blocks:
        extra = ["block 0 is the pool's null block"]
        if lookahead:
            extra.append(f"the attention groups hold {lookahead} lookahead slots more")
        if in_flight:
            extra.append("async scheduling keeps one more state block per GDN group")
        refusal = stall = (
            f"a {max_len:,}-token request needs {peak:,} blocks while it runs, the pool has {num_blocks:,}, "
            f"vLLM admits it at {blocks_max:,} ({'; '.join(extra)}): it would preempt itself and never be "
            "admitted again, and the engine would serve nothing more"
        )
    attention_groups = sum(row["kind"] == "attention" for row in group_rows)
    attention_block = next((row["block_size"] for row in group_rows if row["kind"] == "attention"), 0)
    return {
        "fits": refusal is None,
        "refusal": refusal,
        "pool_bytes": pool,
        "pool_tokens": int(pool_tokens),
        "max_concurrency": float(max_concurrency),
        "num_blocks": num_blocks,
        "block_size": attention_block,
        "bytes_per_block": bytes_per_block,
        "group_size": group_size,
        "groups": group_rows,
        "max_model_len": max_len,
        "max_num_seqs": slots,
        "blocks_per_request_at_max_len": blocks_max,
        "blocks_per_request_minimum": blocks_min,
        "state_bytes_per_request": state_bytes,
        "window_bytes_per_request": window_bytes,
        "context_bytes_per_token": (attention_groups * bytes_per_block / attention_block)
        if attention_block
        else 0.0,
        "slots_resident": min(slots, num_blocks // blocks_min) if blocks_min else slots,
        "slots_resident_with_max_context": (
            min(slots, 1 + spare // blocks_min) if spare >= 0 and blocks_min else 0
        ),
        "fits_with_all_slots_busy": spare >= 0 and spare >= (slots - 1) * blocks_min,
        "blocks_per_request_at_peak": peak,
        "lookahead_tokens": lookahead,
        "stall": stall,
        "max_model_len_that_fits": int(
            min(kv_cache_utils._estimate_max_model_len_from_groups(config, groups, pool), longest)
        ),
    }


def _running_peak(group_rows: list[dict[str, Any]], max_len: int, lookahead: int, in_flight: int,
                  num_blocks: int) -> tuple[int, int]:
    """Blocks one request of ``max_len`` holds at its peak while it runs, and the longest
    request whose peak fits ``num_blocks`` (from `_capacity`'s group rows).

    vLLM 0.28.0 admits a request against ``num_blocks`` with the blocks its specs price
    (`get_max_concurrency_for_kv_cache_config`), but a running one needs more: block 0 is the
    pool's null block and never allocated (`block_pool.py`); `allocate_slots` adds the
    drafter's ``lookahead`` slots past the scheduled tokens; with async scheduling
    (``in_flight`` 1) each GDN group frees its previous state block only after the step in
    flight (`kv_cache_manager.py`), one more per group than the align-mode price. A request
    past that peak preempts itself, and a waiting request must fit whole to be re-admitted
    (`scheduler_reserve_full_isl`): it never is, and the engine serves nothing more. Measured
    on the CPU build on 2026-12-03 (docs/plan.md, "A request must fit while it runs"): at a
    1.00x pool a prompt within one block of max_model_len stalls the server; one block more
    and it finishes.
    """
    peak = 1 + request_blocks(group_rows, max_len, lookahead, in_flight)  # block 0: the null block
    if not any(row["kind"] == "attention" for row in group_rows):
        return peak, max_len
    return peak, longest_request(group_rows, num_blocks, lookahead, in_flight)


def _fixed_blocks(group_rows: list[dict[str, Any]], in_flight: int) -> int:
    """A running request's blocks in the groups that do not grow with its context."""
    state = sum(row["blocks_per_request"] + in_flight for row in group_rows if row["kind"] == "gdn-state")
    return state + sum(row["blocks_per_request"] for row in group_rows if row["kind"] == "sliding-window")


def request_blocks(group_rows: list[dict[str, Any]], tokens: int, lookahead: int, in_flight: int) -> int:
    """Blocks one request of ``tokens`` holds at its peak while it runs (see `_running_peak`;
    the pool's null block not included)."""
    attention = [row["block_size"] for row in group_rows if row["kind"] == "attention"]
    return _fixed_blocks(group_rows, in_flight) + sum((tokens + lookahead + size - 1) // size for size in attention)


def longest_request(group_rows: list[dict[str, Any]], num_blocks: int, lookahead: int, in_flight: int,
                    requests: int = 1) -> int:
    """The longest request of which ``requests`` run side by side within ``num_blocks``, each at
    its peak (0: not even one token each); without attention groups, unbounded by the pool."""
    attention = [row["block_size"] for row in group_rows if row["kind"] == "attention"]
    each = (num_blocks - 1) // max(1, requests) - _fixed_blocks(group_rows, in_flight)
    if not attention:
        return 0 if each < 0 else sys.maxsize
    per_group = max(0, each) // len(attention)
    return max(0, per_group * min(attention) - lookahead)


def _inspect_in_this_process() -> None:
    """Let vLLM's model registry run its model-class inspection here, not in a child
    Python that imports vLLM a second time (with a cold model-info cache that child is
    as slow as the whole plan)."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


@contextmanager
def _environment(values: dict[str, str]):
    """The profile's environment for vLLM, as the engine will have it, for one request."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> int:
    """Answer ``{"requests": [...]}`` from stdin with ``{"results": [...]}`` on the
    last line of stdout (vLLM may log before it); one import of vLLM serves all."""
    # Importing vLLM creates millions of objects and the cyclic collector keeps walking
    # them (~1,600 passes, about a tenth of the import); this process lives for one answer.
    gc.disable()
    requests = json.loads(sys.stdin.read())["requests"]
    _inspect_in_this_process()
    results = []
    for request in requests:
        try:
            with _environment(request.get("env") or {}):
                results.append(plan_request(request))
        except Exception as exc:  # reported to the parent as one line, not a traceback
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    sys.stdout.write("\n" + json.dumps({"results": results}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
