"""Patch 0010: the torch gather of a pack-quantized embedding equals compressed-tensors'
own unpacking and dequantization (the oracle), and the CPU engine uses it."""

from __future__ import annotations

import pytest

from tests.support.vllm_views import last_json_line, run_python

pytestmark = pytest.mark.slow  # starts vLLM in a child process

CHECK = r"""
import json, torch
from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors_embedding as cte
from compressed_tensors.quantization import QuantizationArgs

torch.manual_seed(0)
results = {}
for bits, group in ((8, 128), (8, None), (4, 128)):
    vocab, hidden = 300, 512
    weight = torch.randn(vocab, hidden) * 0.05
    qmax = (1 << (bits - 1)) - 1
    blocks = weight.view(vocab, -1, group or hidden)
    scale = (blocks.abs().amax(-1) / qmax).clamp(min=1e-10).to(torch.bfloat16)
    q = torch.clamp(torch.round(blocks / scale.float().unsqueeze(-1)), -qmax - 1, qmax).to(torch.int8).view(vocab, hidden)
    packed = pack_to_int32(q, bits)
    # Oracle: compressed-tensors unpacks, we scale per group in float32, cast like the kernel.
    unpacked = unpack_from_int32(packed, bits, torch.Size([vocab, hidden]))
    assert torch.equal(unpacked, q)
    expected = (unpacked.float().view(vocab, -1, group or hidden) * scale.float().unsqueeze(-1)).view(vocab, hidden).to(torch.bfloat16)
    ids = torch.tensor([0, 7, 299, 7, 150])
    got = cte._dequant_gather_torch(ids, packed, scale, hidden, bits)
    results[f"{bits}-{group}"] = bool(torch.equal(got, expected[ids]))

# The quantized embedding method itself, on CPU tensors (no Triton here).
args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=128)
method = cte.CompressedTensorsEmbeddingWNA16Int(args)
layer = torch.nn.Module()
layer.hidden_size = 512
layer.weight_packed = pack_to_int32(torch.randint(-128, 128, (10, 512), dtype=torch.int8), 8)
layer.weight_scale = torch.rand(10, 4).to(torch.bfloat16)
out = method.embedding(layer, torch.tensor([[1, 2], [3, 9]]))
results["method_shape"] = list(out.shape)
print(json.dumps(results))
"""


def test_torch_gather_matches_compressed_tensors_dequantization(vllm_views):
    done = run_python(CHECK, vllm_views["patched"], timeout=600)
    result = last_json_line(done)
    assert result == {"8-128": True, "8-None": True, "4-128": True, "method_shape": [2, 2, 512]}


def test_stock_vllm_has_no_gather_without_triton(vllm_views):
    done = run_python(
        "from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors_embedding as c;"
        "import json; print(json.dumps({'has_torch_gather': hasattr(c, '_dequant_gather_torch')}))",
        vllm_views["stock"],
    )
    assert last_json_line(done) == {"has_torch_gather": False}
