"""Make a tiny model stored like the Spark target: ModelOpt MIXED_PRECISION.

RadixArk/Qwen3.8-27B-NVFP4 keeps the residual-writing attention/GDN output projections in
static FP8 and the MLP down projections in packed NVFP4 (W4A4), under the VL checkpoint's
names (``model.language_model.layers.N...``). This writes the tiny target of
``qwen38 tiny`` (`prepare.generate.build_tiny_models`) the same way - weights with `tests.support.quantize`'s
encoders, static activation scales calibrated on a few prompts with transformers - plus two
bf16 reference models: the dequantized base and the dequantized base with each target
weight projected (W_deq - c r r^T W_deq). Used by the GPU test (vLLM has no ModelOpt kernels
on CPU) and, on CPU, as the stand-in for the Spark target in the verification tests.

Copies never carry the source's ``qwen38-manifest.json``: they are other directories, and
the caller gives them their own identity (a pinned artifact, or `tests.support.identified`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from core.manifest import MANIFEST_NAME
from prepare.checkpoint_writer import write_checkpoint
from tests.support.quantize import (
    E2M1_MAX,
    FP8_MAX,
    fp8_per_tensor,
    fp8_reference,
    modelopt_nvfp4,
    modelopt_nvfp4_reference,
)

CALIBRATION = [
    "Write one sentence about caches.",
    "The model reads the prefix from the cache and drafts the next token.",
    "def verify(slot, file):\n    return json.dumps({'model': slot})",
]
_VL_PREFIX = "model.language_model."


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(MANIFEST_NAME))


def with_vl_names(src: Path, dst: Path) -> Path:
    """`src` with its decoder tensors named as in the VL checkpoints (``model.language_model.*``).

    vLLM's and transformers' Qwen3_5ForCausalLM both strip ``language_model.`` on load.
    """
    _copy(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {(_VL_PREFIX + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()}
    write_checkpoint(dst, {"model.safetensors": renamed})
    return dst


def input_amax(model_dir: Path, modules: list[str]) -> dict[str, float]:
    """Largest |input| each module sees on the calibration prompts (transformers, fp32)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    amax = dict.fromkeys(modules, 0.0)
    names = {m.replace(_VL_PREFIX, "model.", 1): m for m in modules}
    hooks = []
    for name, module in model.named_modules():
        if name in names:
            key = names[name]

            def record(_mod, args, _out, key=key):
                amax[key] = max(amax[key], float(args[0].abs().max()))

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for prompt in CALIBRATION:
            model(**tok(prompt, return_tensors="pt"))
    for hook in hooks:
        hook.remove()
    return amax


def quantize_like_spark(src: Path, dst: Path, modules: list[str]) -> dict[str, torch.Tensor]:
    """Write `dst`: `src` with `modules` in ModelOpt FP8 / NVFP4; returns their dequantized W."""
    _copy(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    amax = input_amax(src, modules)
    layers: dict[str, dict] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for module in modules:
        w = tensors.pop(f"{module}.weight").float()
        # 1.5x headroom over the calibration prompts' activations
        act = max(amax[module], 1e-6) * 1.5
        if module.endswith("mlp.down_proj"):
            stored = modelopt_nvfp4(w)
            dequantized[module] = modelopt_nvfp4_reference(stored)
            stored["input_scale"] = torch.tensor(act / (E2M1_MAX * FP8_MAX))
            layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
        else:
            stored = fp8_per_tensor(w)
            dequantized[module] = fp8_reference(stored)
            stored["input_scale"] = torch.tensor(act / FP8_MAX)
            layers[module] = {"quant_algo": "FP8"}
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in stored.items()})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
        "quantized_layers": layers,
        "producer": {"name": "modelopt", "version": "qwen38-test"},
    }
    write_checkpoint(dst, {"model.safetensors": tensors}, config=config)
    return dequantized


def bf16_variant(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`src` (unquantized) with the given module weights replaced (stored fp32, served bf16)."""
    _copy(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for module, w in weights.items():
        tensors[f"{module}.weight"] = w.float().contiguous()
    write_checkpoint(dst, {"model.safetensors": tensors})
    return dst


def projected(weights: dict[str, torch.Tensor], directions) -> dict[str, torch.Tensor]:
    """W - c r (r^T W) for every module of a `prepare.directions.Directions`, in fp64."""
    out = {}
    for module, w in weights.items():
        r = directions.vectors[module].double()
        wd = w.double()
        out[module] = (wd - directions.coefs[module] * torch.outer(r, r @ wd)).float()
    return out
