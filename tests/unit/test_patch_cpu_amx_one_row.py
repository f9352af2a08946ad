"""Patch 0085: a one-token batch reaches vLLM-CPU's causal conv kernel with rows at their own
width. The rows of a prefill are a slice of the fused qkvz projection; with one token,
`.contiguous()` keeps the projection's row stride and the kernel (the AMX CPUs' prefill conv)
refuses it, which killed the engine on a one-token prompt (patch 0057 makes it a prefill)."""

from __future__ import annotations

import pytest

from tests.support.vllm_views import json_in_views

pytestmark = pytest.mark.slow  # imports vLLM in child processes

# One token of the tiny Qwen3.5's in_proj_qkvz split as forward_cpu splits it (qkv, then z), the
# kernel called as the GDN core calls it, on a fresh state (slot 1 of 2), with a plain weight.
ONE_ROW = r"""
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
import vllm._custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as ga

torch.manual_seed(0)
QKV, Z, WIDTH = 1024, 512, 4
fused = torch.randn(1, QKV + Z, dtype=torch.bfloat16)
weight = torch.randn(QKV, WIDTH, dtype=torch.bfloat16)
rows = fused.split([QKV, Z], dim=-1)[0].contiguous()
compact = torch.zeros(1, QKV, dtype=torch.bfloat16).copy_(rows)


def conv(x):
    return ops.causal_conv1d_fwd_cpu(
        x=x.transpose(0, 1), weight=weight, bias=None,
        conv_states=torch.zeros(2, QKV, WIDTH - 1, dtype=torch.bfloat16),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), cache_indices=torch.tensor([1], dtype=torch.int32),
        has_initial_state=torch.tensor([False]), silu_activation=True, is_vnni=False,
    ).transpose(0, 1)


result = {"has_op": hasattr(torch.ops._C, "causal_conv1d_fwd_cpu"), "amx": torch.cpu._is_amx_tile_supported(),
          "slice_stride": list(rows.stride())}
patched = getattr(ga, "_rows_at_own_width", None)
if patched is not None:
    fixed = patched(rows)
    many = fused.new_zeros(3, QKV + Z).split([QKV, Z], dim=-1)[0].contiguous()
    result.update(fixed_stride=list(fixed.stride()), fixed_equal=bool(torch.equal(fixed, rows)),
                  compact_kept=patched(compact) is compact, many_kept=patched(many) is many)
print(json.dumps(result), flush=True)  # what holds whether or not the kernel runs here
if result["has_op"]:
    try:
        conv(rows)
        result["slice_refused"] = None
    except RuntimeError as error:
        result["slice_refused"] = str(error)
    if patched is not None:
        result["same_as_compact"] = bool(torch.equal(conv(fixed), conv(compact)))
    print(json.dumps(result))
"""


def test_one_token_rows_reach_the_conv_kernel_at_their_own_width(vllm_views):
    got = json_in_views(ONE_ROW, vllm_views)
    stock, patched = got["stock"], got["patched"]
    # torch calls the one-row slice contiguous and leaves it at the projection's row stride
    assert stock["slice_stride"] == [1536, 1] and "fixed_stride" not in stock
    # the patch copies exactly that case: a row at its own width, the same values; a compact
    # row and a batch of several rows (made compact by `.contiguous()`) pass through as they are
    assert patched["fixed_stride"] == [1024, 1] and patched["fixed_equal"], patched
    assert patched["compact_kept"] and patched["many_kept"], patched
    if not patched["has_op"]:
        pytest.skip("this CPU's vLLM-CPU build has no causal_conv1d_fwd_cpu (no AVX-512): its prefill conv is torch's")
    if "slice_refused" not in stock or "same_as_compact" not in patched:
        # the GDN core calls the kernel only on AMX CPUs, where it must run; elsewhere it may not
        assert not patched["amx"], ("causal_conv1d_fwd_cpu did not return on this AMX CPU", stock, patched)
        pytest.skip("vLLM-CPU's causal_conv1d_fwd_cpu did not return on this CPU without AMX "
                    "(its prefill conv is torch's)")
    # the kernel checks the row stride: it refuses the slice, and takes the patch's rows
    assert "expect x to be transposed" in (stock["slice_refused"] or ""), stock
    assert patched["same_as_compact"], patched
