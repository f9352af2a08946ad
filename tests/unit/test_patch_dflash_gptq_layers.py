"""Patch 0022: a GPTQ-format DFlash2 drafter loads with its layer Linears quantized.

The drafter's layers are built as ``layers.{i + start_layer_id}`` and its own quantization
config never received the model's fused modules, so on stock 0.28.0 every layer Linear of
a GPTQ drafter is built unquantized and its ``g_idx`` fails to load (seen at full size on
the H200, 2026-12-02). The real `DFlash2Qwen3ForCausalLM`, built from the real engine
config over a generated target and GPTQ drafter (the generator's `small` preset, the real
formats), must load the checkpoint's tensors on the patched tree and fail on stock.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_views import json_in_views

pytestmark = pytest.mark.slow  # starts vLLM in a child process

CHECK = r"""
import glob, json, tempfile
from entrypoint.kv_capacity import _emulate_cuda
_emulate_cuda(True)  # DFlash2 forces the V2 runner, which a CPU platform refuses to configure
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

config = EngineArgs(
    model=target, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
    kv_cache_memory_bytes=1 << 30,
    speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 7},
).create_engine_config()
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method="file://" + tempfile.mkdtemp() + "/dist")
result = {}
with set_current_vllm_config(config):
    initialize_model_parallel(1, 1)
    with torch.device("cpu"):
        model = DFlash2Qwen3ForCausalLM(vllm_config=config)
    result["methods"] = {name: type(m.quant_method).__name__ for name, m in model.named_modules()
                         if getattr(m, "quant_method", None) is not None}
    try:
        model.load_weights(safetensors_weights_iterator(sorted(glob.glob(drafter + "/*.safetensors")), False))
        result["loaded"] = True
        down = model.model.layers[0].mlp.down_proj
        result["down_proj_params"] = sorted(name for name, _ in down.named_parameters())
    except Exception as exc:
        result["loaded"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"[:400]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, vllm_views) -> dict[str, dict]:
    """The check's result on the patched and the stock tree, over one generated target and drafter."""
    from prepare.generate import generate_model

    root = tmp_path_factory.mktemp("gptq-drafter")
    target = generate_model(root / "target", "small", "qwen3.8-27b-w4a16")
    drafter = generate_model(root / "drafter", "small", "qwen3.8-27b-dflash2-w4a16")
    return json_in_views(f"target, drafter = {str(target)!r}, {str(drafter)!r}\n" + CHECK, vllm_views)


def test_patched_drafter_quantizes_every_layer_linear_and_loads_the_gptq_checkpoint(loaded):
    result = loaded["patched"]
    layer_linears = {name: method for name, method in result["methods"].items()
                     if ".layers." in name and name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert layer_linears and set(layer_linears.values()) == {"AutoGPTQLinearMethod"}, layer_linears
    assert result["methods"]["model.fc"] == "AutoGPTQLinearMethod"
    # What the generator stores bf16 (the conv kernel projections, the candidate selector) stays unquantized.
    assert result["methods"]["model.candidate_selector.hidden_projection"] == "UnquantizedLinearMethod"
    assert result["loaded"], result.get("error")
    assert {"qweight", "scales", "g_idx"} <= set(result["down_proj_params"])


def test_stock_drafter_builds_its_layers_unquantized_and_fails_on_g_idx(loaded):
    result = loaded["stock"]
    assert result["methods"]["model.layers.0.mlp.down_proj"] == "UnquantizedLinearMethod"
    assert not result["loaded"] and "g_idx" in result["error"], result
