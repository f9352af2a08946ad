"""GPU proofs for the patches whose code only runs on a GPU (Triton kernels, Marlin).

Each test runs in a child Python whose `vllm` is the patched view of the installed
CUDA vLLM 0.28.0 (nothing is written to the installed tree) and compares against a
torch reference. Run on the lent GPU box:

    PYTHONPATH=.:$VLLM_STAGE python -m pytest -q -m gpu tests/gpu

where $VLLM_STAGE holds the unpacked CUDA vLLM 0.28.0 (tools/gpu-payload.sh).
"""

from __future__ import annotations

import pytest

from tests.support.vllm_views import last_json_line, run_python

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session", autouse=True)
def needs_cuda():
    # Session scope: checked before the (session-scoped) views and plans are built.
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: these tests run on the lent H100/H200")
    pytest.importorskip("triton")


def run(vllm_views, code: str, view: str = "patched") -> dict:
    done = run_python(code, vllm_views[view], timeout=900)
    return last_json_line(done)


# ---- 0010: the Triton gather of a quantized embedding ----------------------------------

EMBED = r"""
import json, torch
from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors_embedding as cte
torch.manual_seed(0)
out = {}
for bits, groups in ((8, 40), (8, 1), (4, 40)):
    vocab, hidden = 4099, 5120
    packed = torch.randint(-2**31, 2**31 - 1, (vocab, hidden * bits // 32), dtype=torch.int32, device="cuda")
    scale = (torch.rand(vocab, groups, device="cuda") * 0.01).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (777,), device="cuda")
    triton_rows = cte._dequant_gather_triton(ids, packed, scale, hidden, bits)
    torch_rows = cte._dequant_gather_torch(ids, packed, scale, hidden, bits)
    out[f"{bits}x{groups}"] = bool(torch.equal(triton_rows, torch_rows))
print(json.dumps(out))
"""


def test_embed_gather_triton_matches_torch(vllm_views):
    assert run(vllm_views, EMBED) == {"8x40": True, "8x1": True, "4x40": True}


# ---- 0020: dequantized K/V rows agree with the Marlin layer --------------------------------

DFLASH = r"""
import json, tempfile, torch
from compressed_tensors.compressors.pack_quantized import pack_to_int32
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.linear import QKVParallelLinear
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
from vllm.model_executor.models.qwen3_dflash import dense_linear_rows

torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
HIDDEN, HEAD, NQ, NKV, GROUP = 1024, 128, 8, 2, 128
Q_SIZE, KV = NQ * HEAD, NKV * HEAD
OUT = Q_SIZE + 2 * KV
config = VllmConfig()
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="nccl",
                                 distributed_init_method="file://" + tempfile.mkdtemp() + "/d")
    initialize_model_parallel(1, 1)

def quantized_weight():
    weight = torch.randn(OUT, HIDDEN, device="cuda", dtype=torch.float32) * 0.02
    scale = (weight.view(OUT, -1, GROUP).abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(weight.view(OUT, -1, GROUP) / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8).view(OUT, HIDDEN)
    return q, scale

results = {}
with set_current_vllm_config(config), torch.device("cuda"):
    ct = CompressedTensorsConfig.from_config({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
        "ignore": [],
    })
    # modules_in_block_to_quantize: without it (or a checkpoint to read it from) AutoGPTQ leaves every layer unquantized.
    gptq = AutoGPTQConfig.from_config({"bits": 4, "group_size": GROUP, "desc_act": False, "sym": True, "lm_head": False,
                                       "modules_in_block_to_quantize": [["self_attn.qkv_proj"]]})
    for name, quant in (("compressed-tensors", ct), ("gptq", gptq)):
        layer = QKVParallelLinear(HIDDEN, HEAD, NQ, NKV, bias=False, quant_config=quant, prefix="layers.0.self_attn.qkv_proj")
        q, scale = quantized_weight()
        if name == "compressed-tensors":
            layer.weight_packed.data.copy_(pack_to_int32(q.cpu(), 4).cuda())
            layer.weight_scale.data.copy_(scale)
            layer.weight_shape.data.copy_(torch.tensor([OUT, HIDDEN]))
        else:
            layer.qweight.data.copy_(pack_to_int32(q.t().contiguous().cpu(), 4, packed_dim=0).cuda())
            layer.scales.data.copy_(scale.t().contiguous())
            layer.g_idx.data.copy_(torch.arange(HIDDEN, dtype=torch.int32) // GROUP)
        dense = dense_linear_rows(layer, Q_SIZE, torch.bfloat16)   # read before repacking, as at load time
        layer.quant_method.process_weights_after_loading(layer)    # Marlin repack
        x = torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16)
        marlin = layer(x)[0][:, Q_SIZE:].float()
        ours = (x.float() @ dense.float().t())
        results[name] = float((marlin - ours).norm() / ours.norm())
print(json.dumps(results))
"""


def test_dflash_kv_rows_match_marlin_layer(vllm_views):
    """The K/V rows patch 0020 dequantizes give the same projection as vLLM's own
    Marlin W4A16 layer built from the same checkpoint tensors."""
    errors = run(vllm_views, DFLASH)
    assert errors["compressed-tensors"] < 1e-2, errors
    assert errors["gptq"] < 1e-2, errors


# ---- 0050: bounded state-slot indexing in the GDN speculative kernels -------------------------

GDN = r"""
import json, torch, torch.nn.functional as F
from vllm.third_party.flash_linear_attention.ops.fused_recurrent import fused_recurrent_gated_delta_rule_fwd
from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import fused_sigmoid_gating_delta_rule_update

torch.manual_seed(0)
N, T, H, HV, DK, DV = 4, 4, 2, 4, 128, 128          # 4 requests, 1 + 3 speculative tokens each
accepted = torch.tensor([1, 0, 3, 9], dtype=torch.int32, device="cuda")  # 0: padded row, 9: oversized
POOL = 1 + N * T
slots = torch.arange(1, POOL, dtype=torch.int32, device="cuda").view(N, T)
cu = torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device="cuda")
q = F.normalize(torch.randn(1, N * T, H, DK, device="cuda"), dim=-1)
k = F.normalize(torch.randn(1, N * T, H, DK, device="cuda"), dim=-1)
v = torch.randn(1, N * T, HV, DV, device="cuda")
scale = DK ** -0.5

def reference(pool, g, beta):
    # Per request: start from the slot of the last accepted token (a zero count
    # reads the row's first slot); store every token's state in its own slot.
    out = torch.zeros(N * T, HV, DV, device="cuda")
    pool = pool.clone()
    for n in range(N):
        start = max(int(accepted[n]) - 1, 0)
        if start >= T:
            continue                       # oversized: the row is skipped
        h = pool[slots[n, start]].clone()  # [HV, DV, DK]
        for t in range(T):
            i = n * T + t
            kk = k[0, i].repeat_interleave(HV // H, 0)
            qq = q[0, i].repeat_interleave(HV // H, 0) * scale
            h = h * torch.exp(g[i])[:, None, None]
            vv = (v[0, i] - (h * kk[:, None, :]).sum(-1)) * beta[i][:, None]
            h = h + vv[:, :, None] * kk[:, None, :]
            out[i] = (h * qq[:, None, :]).sum(-1)
            pool[slots[n, t]] = h
    return out, pool

initial = torch.randn(POOL, HV, DV, DK, device="cuda") * 0.1
results = {}

# fused_recurrent: gates given directly
g = -torch.rand(N * T, HV, device="cuda")
beta = torch.rand(N * T, HV, device="cuda")
pool = initial.clone()
o, _ = fused_recurrent_gated_delta_rule_fwd(
    q, k, v, g[None], beta[None], scale, pool, inplace_final_state=True,
    cu_seqlens=cu, ssm_state_indices=slots, num_accepted_tokens=accepted,
)
torch.cuda.synchronize()
ref_o, ref_pool = reference(initial, g, beta)
valid = [n for n in range(N) if int(accepted[n]) - 1 < T]
rows = torch.cat([torch.arange(n * T, (n + 1) * T) for n in valid])
results["recurrent_out"] = float((o[0, rows] - ref_o[rows]).abs().max())
results["recurrent_state"] = float((pool - ref_pool).abs().max())
results["recurrent_oversized_untouched"] = bool(torch.equal(pool[slots[3].long()], initial[slots[3].long()]))

# fused_sigmoid_gating: gates from A_log, a, dt_bias, b
A_log = torch.rand(HV, device="cuda")
a = torch.randn(N * T, HV, device="cuda")
b = torch.randn(N * T, HV, device="cuda")
dt_bias = torch.rand(HV, device="cuda")
g2 = -torch.exp(A_log) * F.softplus(a + dt_bias)
beta2 = torch.sigmoid(b)
pool = initial.clone()
o, _ = fused_sigmoid_gating_delta_rule_update(
    A_log, a[None], b[None], dt_bias, q, k, v, scale=scale, initial_state=pool,
    inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots, num_accepted_tokens=accepted,
)
torch.cuda.synchronize()
ref_o, ref_pool = reference(initial, g2, beta2)
results["sigmoid_out"] = float((o[0, rows] - ref_o[rows]).abs().max())
results["sigmoid_state"] = float((pool - ref_pool).abs().max())
results["sigmoid_oversized_untouched"] = bool(torch.equal(pool[slots[3].long()], initial[slots[3].long()]))
print(json.dumps(results))
"""


def test_gdn_spec_state_indexing_is_bounded(vllm_views):
    """A zero accepted count reads the row's first slot, an oversized one skips the
    row, and every valid row matches the torch recurrence exactly as before."""
    result = run(vllm_views, GDN)
    for kernel in ("recurrent", "sigmoid"):
        assert result[f"{kernel}_out"] < 2e-3, result
        assert result[f"{kernel}_state"] < 2e-3, result
        assert result[f"{kernel}_oversized_untouched"] is True, result
