"""Patch 0025: which layers Marlin gives int8 activations (W4A8) under VLLM_MARLIN_INPUT_DTYPE=int8.

The decision runs in the patched vLLM on this CPU (Marlin itself needs CUDA: the GPU tier's
`test_w4a8_marlin_answers_as_w4a16` serves it): 4-bit layers take int8 activations, 8-bit
ones (our int8 lm_head, embed_tokens, MTP) never do, since Marlin has no W8A8 kernel and the
load failed on the lent H200 with them; QWEN38_W4A8_LAYERS=mlp keeps it to the MLP."""

from __future__ import annotations

import pytest

from tests.support.vllm_views import last_json_line, run_python

pytestmark = pytest.mark.slow  # imports vLLM in a child process

CHECK = r"""
import inspect, json, os
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16 as w

layers = {
    "mlp": "language_model.model.layers.3.mlp.down_proj",
    "attention": "language_model.model.layers.3.self_attn.qkv_proj",
    "gdn": "language_model.model.layers.0.linear_attn.in_proj_qkvz",
    "lm_head": "lm_head",
}
results = {}
# Without the switch first (vLLM reads its environment at each access until an engine caches it).
os.environ.pop("VLLM_MARLIN_INPUT_DTYPE", None)
results["without_switch"] = sorted({str(w.qwen38_marlin_input_dtype(name, bits))
                                    for name in layers.values() for bits in (4, 8)})
os.environ["VLLM_MARLIN_INPUT_DTYPE"] = "int8"
for scope in ("", "all", "mlp"):
    os.environ["QWEN38_W4A8_LAYERS"] = scope
    for bits in (4, 8):
        for kind, name in layers.items():
            results[f"{scope or 'unset'}/{bits}/{kind}"] = str(w.qwen38_marlin_input_dtype(name, bits))
os.environ["QWEN38_W4A8_LAYERS"] = "attention"
try:
    w.qwen38_marlin_input_dtype(layers["mlp"], 4)
except ValueError as exc:
    results["bad_scope"] = str(exc)
results["create_weights_uses_it"] = "qwen38_marlin_input_dtype(self.layer_name, self.num_bits)" in inspect.getsource(
    w.CompressedTensorsWNA16.create_weights)
print(json.dumps(results))
"""


def test_int8_activations_go_to_4_bit_layers_only_and_to_the_mlp_only_when_asked(vllm_views):
    got = last_json_line(run_python(CHECK, vllm_views["patched"], timeout=600))
    assert got["without_switch"] == ["None"]  # no VLLM_MARLIN_INPUT_DTYPE: no layer takes int8 activations
    for scope in ("unset", "all", "mlp"):
        for kind in ("mlp", "attention", "gdn", "lm_head"):
            assert got[f"{scope}/8/{kind}"] == "None"  # Marlin has no W8A8: an 8-bit layer keeps 16-bit inputs
            wanted = "torch.int8" if scope != "mlp" or kind == "mlp" else "None"
            assert got[f"{scope}/4/{kind}"] == wanted, (scope, kind)
    assert got["bad_scope"] == "QWEN38_W4A8_LAYERS='attention': expected all or mlp"
    assert got["create_weights_uses_it"] is True
