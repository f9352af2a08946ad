"""Patch 0079: where oneDNN has no bf16 convolution (AVX2-only CPUs), the CPU prefill's causal
conv runs as fp32 taps rounded once, with the bits oneDNN's bf16 kernel gives, and makes no
bf16 ``F.conv1d`` call (torch's own bf16 fallback is what made forced-AVX2 runs slow)."""

from __future__ import annotations

import pytest

from tests.support.vllm_views import json_in_views, last_json_line, run_python

pytestmark = pytest.mark.slow  # imports vLLM in child processes

# A batch of the prefill function's real shapes: sequences of 5 to 3,000 tokens, some resuming
# from a cached state, an empty one, one on the pad slot; with and without bias, silu and none.
# The tiny model's 1,024 channels and 6,000 tokens.
BATCH = r"""
import json, torch
import torch.nn.functional as F
from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as cc
from vllm.v1.attention.backends.utils import PAD_SLOT_ID

torch.manual_seed(0)
CHANNELS, WIDTH, SLOTS = 1024, 4, 6
LENGTHS = [5, 1, 0, 37, 3000, 9, 2948]
SLOT_OF = [3, 0, 1, PAD_SLOT_ID, 5, 2, 4]
RESUMES = [True, False, False, True, True, False, False]
starts = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
x = torch.randn(CHANNELS, int(starts[-1]), dtype=torch.bfloat16)
weight = torch.randn(CHANNELS, WIDTH, dtype=torch.bfloat16)
bias = torch.randn(CHANNELS, dtype=torch.bfloat16)
states = torch.randn(SLOTS, CHANNELS, WIDTH - 1, dtype=torch.bfloat16)


def prefill(use_bias, activation):
    conv_states = states.clone()
    out = cc.causal_conv1d_fn_cpu(
        x, weight, bias if use_bias else None, conv_states, starts,
        cache_indices=torch.tensor(SLOT_OF, dtype=torch.int32),
        has_initial_state=torch.tensor(RESUMES), activation=activation, pad_slot_id=PAD_SLOT_ID,
    )
    return out, conv_states


CASES = [(True, "silu"), (False, "silu"), (True, None)]
# The columns written (the pad slot's sequence leaves its columns as torch.empty made them).
live = torch.zeros(x.shape[1], dtype=torch.bool)
for i, (b, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
    live[b:e] = SLOT_OF[i] != PAD_SLOT_ID
"""

# On this machine's oneDNN: the patched function with the check forced False (fp32 taps) against
# the same function's F.conv1d path (the stock code), bit for bit; and both against a float64
# reference, within one bf16 rounding.
SAME_BITS = BATCH + r"""
onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
by_conv = [prefill(*case) for case in CASES]
cc.onednn_takes_bf16 = lambda: False
by_taps = [prefill(*case) for case in CASES]

def reference(use_bias):
    # The pre-activation conv in float64, and the size of its terms (fp32's rounding scale).
    out = torch.zeros(CHANNELS, x.shape[1], dtype=torch.float64)
    size = torch.zeros_like(out)
    for i, (b, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        if b == e or SLOT_OF[i] == PAD_SLOT_ID:
            continue
        head = states[SLOT_OF[i]] if RESUMES[i] else torch.zeros(CHANNELS, WIDTH - 1)
        seq = torch.cat([head.double(), x[:, b:e].double()], dim=-1)
        terms = seq.unfold(-1, WIDTH, 1) * weight.double().unsqueeze(1)  # (channel, token, tap)
        out[:, b:e] = terms.sum(-1)
        size[:, b:e] = terms.abs().sum(-1)
        if use_bias:
            out[:, b:e] += bias.double().unsqueeze(-1)
            size[:, b:e] += bias.double().abs().unsqueeze(-1)
    return out, size

result = {"onednn_bf16": onednn, "cases": []}
for (use_bias, activation), (conv_out, conv_st), (taps_out, taps_st) in zip(CASES, by_conv, by_taps):
    ref, size = reference(use_bias)
    # One bf16 rounding of the fp32 sum: within half a bf16 step (at most 2**-8 of the value)
    # plus fp32's own error (a few 2**-24 of the terms' size).
    step = ref.abs() * 2.0 ** -8 + size * 2.0 ** -20
    pre = taps_out if activation is None else None
    result["cases"].append({
        "bias": use_bias, "activation": activation,
        "out_equal": bool(torch.equal(conv_out[:, live], taps_out[:, live])),
        "states_equal": bool(torch.equal(conv_st, taps_st)),
        "differing": int((conv_out[:, live] != taps_out[:, live]).sum()),
        "taps_within_one_rounding": None if pre is None else
            bool(((pre[:, live].double() - ref[:, live]).abs() <= step[:, live]).all()),
    })
# The real model's 10,240 channels over 2,048 tokens, the taps against oneDNN's conv directly:
# 21 million elements, where a sum in another order differs in about ten.
torch.manual_seed(1)
wide_weight = torch.randn(10240, 1, WIDTH, dtype=torch.bfloat16)
wide_bias = torch.randn(10240, dtype=torch.bfloat16)
wide_x = torch.randn(1, 10240, 2048 + WIDTH - 1, dtype=torch.bfloat16)
wide_conv = F.conv1d(wide_x, wide_weight, wide_bias, groups=10240)
result["wide_differing"] = int((cc._depthwise_conv_fp32(wide_x, wide_weight, wide_bias) != wide_conv).sum())
print(json.dumps(result))
"""

# Which dtypes reach F.conv1d when oneDNN is limited to AVX2 (what an AVX2-only CPU gets).
CONV_CALLS = BATCH + r"""
calls = []
conv1d = F.conv1d
def recording(input, *args, **kwargs):
    calls.append(str(input.dtype))
    return conv1d(input, *args, **kwargs)
F.conv1d = recording
outputs = [prefill(*case)[0] for case in CASES]
print(json.dumps({
    "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    "conv1d_dtypes": sorted(set(calls)),
    "finite": all(bool(o[:, live].float().isfinite().all()) for o in outputs),
}))
"""


def test_fp32_taps_give_the_bits_of_the_bf16_conv(vllm_views):
    result = last_json_line(run_python(SAME_BITS, vllm_views["patched"]))
    for case in result["cases"]:
        if case["taps_within_one_rounding"] is not None:
            assert case["taps_within_one_rounding"], case
    if not result["onednn_bf16"]:
        pytest.skip("this CPU's oneDNN has no bf16 convolution (no AVX-512): nothing to compare bits with")
    for case in result["cases"]:
        assert case["out_equal"] and case["states_equal"], case
        assert case["differing"] == 0, case
    assert result["wide_differing"] == 0


def test_onednn_limited_to_avx2_gets_no_bf16_conv_call(vllm_views):
    result = json_in_views(CONV_CALLS, vllm_views, ONEDNN_MAX_CPU_ISA="AVX2")
    assert result["stock"]["onednn_bf16"] is False and result["patched"]["onednn_bf16"] is False
    assert result["stock"]["conv1d_dtypes"] == ["torch.bfloat16"]
    assert result["patched"]["conv1d_dtypes"] == []
    assert result["stock"]["finite"] and result["patched"]["finite"]
