"""The converter on a tiny model stored like the Spark target (ModelOpt MIXED_PRECISION)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from core.checkpoint import open_checkpoint
from prepare.adapter import build_adapter
from prepare.directions import random_directions, read_directions, target_modules
from tests.support.identified import seal
from tests.support.spark_like import quantize_like_spark, with_vl_names


def test_adapter_from_a_modelopt_mixed_precision_tiny_model_uses_the_dequantized_weights(tiny_root, tmp_path):
    base = with_vl_names(tiny_root / "tiny" / "target", tmp_path / "tiny")
    modules = target_modules(open_checkpoint(base))
    assert modules[0].startswith("model.language_model.layers.0.")
    dequantized = quantize_like_spark(base, tmp_path / "q", modules)
    seal(tmp_path / "q", like="spark")
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_algo"] == "MIXED_PRECISION" and set(config["quantized_layers"]) == set(modules)
    directions_path = random_directions(tmp_path / "q", tmp_path / "directions" / "d.safetensors", seed=1)
    seal(directions_path.parent)
    record = build_adapter(tmp_path / "q", directions_path, tmp_path / "lora")
    assert record["formats"] == {"fp8-tensor": 4, "nvfp4-modelopt": 4}
    directions = read_directions(directions_path)
    lora = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    for module in modules:
        a = lora[f"base_model.model.{module}.lora_A.weight"][0].double()
        expected = directions.vectors[module].double() @ dequantized[module].double()
        torch.testing.assert_close(a, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
