"""Patch 0020: a W4A16 DFlash drafter's context-KV weights are the dequantized K/V
rows of its qkv_proj, read from the checkpoint layout.

The oracle packs with compressed-tensors' own `pack_to_int32` (GPTQ's symmetric 4-bit
layout is the same packing along the input dim) and dequantizes independently; the
real `DFlashQwen3Model._build_context_kv_buffers` of the patched tree must produce
exactly those rows, and the stock one must fail on a layer without `.weight`.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_views import json_in_views

pytestmark = pytest.mark.slow  # starts vLLM in a child process

CHECK = r"""
import json
from types import SimpleNamespace
import torch
from compressed_tensors.compressors.pack_quantized import pack_to_int32
from vllm.model_executor.parameter import (
    BasevLLMParameter, GroupQuantScaleParameter, PackedvLLMParameter, RowvLLMParameter,
)
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
import tempfile
from vllm.distributed import init_distributed_environment, initialize_model_parallel

# vLLM's parameter classes read the tensor-parallel rank: a one-process group.
init_distributed_environment(
    world_size=1, rank=0, local_rank=0, backend="gloo",
    distributed_init_method="file://" + tempfile.mkdtemp() + "/dist",
)
from vllm.config import VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig()):
    initialize_model_parallel(1, 1)
torch.manual_seed(0)
HIDDEN, HEAD, NQ, NKV, GROUP = 256, 32, 4, 2, 64
Q_SIZE, KV = NQ * HEAD, NKV * HEAD
OUT = Q_SIZE + 2 * KV
loader = lambda *a, **k: None

def quantize(weight, zero_point=False, g_idx=None):
    # symmetric (or asymmetric) int4, one scale per (row, group of the input dim)
    groups = HIDDEN // GROUP
    g = g_idx if g_idx is not None else torch.arange(HIDDEN) // GROUP
    scale = torch.stack([weight[:, g == k].abs().amax(1) for k in range(groups)], 1) / 7
    scale = scale.clamp(min=1e-8).to(torch.bfloat16)
    zp = torch.randint(-2, 3, (OUT, groups), dtype=torch.int8) if zero_point else torch.zeros(OUT, groups, dtype=torch.int8)
    q = torch.round(weight / scale.float()[:, g]) + zp.float()[:, g]
    q = q.clamp(-8, 7).to(torch.int8)
    dense = ((q.float() - zp.float()[:, g]) * scale.float()[:, g]).to(torch.bfloat16)
    return q, scale, zp, dense

def ct_linear(q, scale, zp=None, g_idx=None):
    m = torch.nn.Module()
    m.prefix, m.output_size_per_partition, m.input_size_per_partition = "layers.0.self_attn.qkv_proj", OUT, HIDDEN
    m.weight_packed = PackedvLLMParameter(data=pack_to_int32(q, 4), input_dim=1, output_dim=0, packed_dim=1, packed_factor=8, weight_loader=loader)
    m.weight_scale = GroupQuantScaleParameter(data=scale, output_dim=0, input_dim=1, weight_loader=loader)
    m.weight_shape = BasevLLMParameter(data=torch.tensor([OUT, HIDDEN]), weight_loader=loader)
    if zp is not None:
        m.weight_zero_point = PackedvLLMParameter(data=pack_to_int32(zp, 4, packed_dim=0), input_dim=1, output_dim=0, packed_dim=0, packed_factor=8, weight_loader=loader)
    if g_idx is not None:
        m.weight_g_idx = RowvLLMParameter(data=g_idx.to(torch.int32), input_dim=0, weight_loader=loader)
    return m

def gptq_linear(q, scale, g_idx, desc_act):
    m = torch.nn.Module()
    m.prefix, m.output_size_per_partition, m.input_size_per_partition = "layers.0.self_attn.qkv_proj", OUT, HIDDEN
    m.qweight = PackedvLLMParameter(data=pack_to_int32(q.t().contiguous(), 4, packed_dim=0), input_dim=0, output_dim=1, packed_dim=0, packed_factor=8, weight_loader=loader)
    m.scales = GroupQuantScaleParameter(data=scale.t().contiguous(), output_dim=1, input_dim=0, weight_loader=loader)
    m.g_idx = RowvLLMParameter(data=g_idx.to(torch.int32), input_dim=0, weight_loader=loader)
    m.quant_method = SimpleNamespace(quant_config=SimpleNamespace(desc_act=desc_act))
    return m

def build(linears):
    owner = SimpleNamespace(hidden_norm=SimpleNamespace(weight=torch.nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16))))
    layers = [SimpleNamespace(qkv_proj=l, q_size=Q_SIZE, k_norm=SimpleNamespace(weight=torch.nn.Parameter(torch.ones(HEAD)))) for l in linears]
    DFlashQwen3Model._build_context_kv_buffers(owner, layers, False)
    return owner._fused_kv_weight

results = {}
shuffled = torch.randperm(HIDDEN) // GROUP  # act-order: columns in any group
cases = {
    "ct_sym": lambda w: (lambda q, s, z, d: (ct_linear(q, s), d))(*quantize(w)),
    "ct_asym": lambda w: (lambda q, s, z, d: (ct_linear(q, s, zp=z), d))(*quantize(w, zero_point=True)),
    "ct_actorder": lambda w: (lambda q, s, z, d: (ct_linear(q, s, g_idx=shuffled), d))(*quantize(w, g_idx=shuffled)),
    "gptq": lambda w: (lambda q, s, z, d: (gptq_linear(q, s, torch.arange(HIDDEN) // GROUP, False), d))(*quantize(w)),
    "gptq_desc_act": lambda w: (lambda q, s, z, d: (gptq_linear(q, s, shuffled, True), d))(*quantize(w, g_idx=shuffled)),
}
for name, make in cases.items():
    linears, expected = [], []
    for _ in range(3):  # three drafter layers, fused into one GEMM weight
        linear, dense = make(torch.randn(OUT, HIDDEN) * 0.02)
        linears.append(linear)
        expected.append(dense[Q_SIZE:])
    try:
        fused = build(linears)
        results[name] = bool(fused.dtype == torch.bfloat16 and torch.equal(fused, torch.cat(expected)))
    except Exception as exc:
        results[name] = type(exc).__name__
# An unquantized drafter keeps the stock path: the weight rows themselves.
plain = torch.nn.Module(); plain.weight = torch.nn.Parameter(torch.randn(OUT, HIDDEN, dtype=torch.bfloat16))
results["dense"] = bool(torch.equal(build([plain]), plain.weight[Q_SIZE:]))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def built(vllm_views) -> dict[str, dict]:
    return json_in_views(CHECK, vllm_views, timeout=600)


def test_context_kv_weight_is_the_dequantized_kv_rows(built):
    result = built["patched"]
    assert result == {
        "ct_sym": True,
        "ct_asym": True,
        "ct_actorder": True,
        "gptq": True,
        "gptq_desc_act": True,
        "dense": True,
    }


def test_stock_vllm_cannot_build_context_kv_from_a_quantized_layer(built):
    result = built["stock"]
    assert result["ct_sym"] == "AttributeError" and result["gptq"] == "AttributeError"
    assert result["dense"] is True
