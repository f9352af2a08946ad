"""`qwen38 generate`: the real formats, read back by compressed-tensors, safetensors, vLLM's
own dequantizers and our preparation steps, at reduced sizes; the full size as arithmetic."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.checkpoint import INDEX_NAME, indexed_shards, open_checkpoint
from core.errors import PrepareError
from core.manifest import MANIFEST_NAME, read_manifest, sha256_file
from prepare import generate as gen
from prepare.generate import DEFAULT_SEED
from prepare.synthetic import MODEL_CONFIGS, PRESETS, plan_shards, stored_bytes, target_config, variant_tensors

GB = 1e9


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generated")
    gen.generate(root, "small", only=["qwen3.8-27b-w4a16", "qwen3.8-27b-dflash2-w4a16", "qwen3.8-27b-nvfp4",
                                      "qwen3.8-27b-dflash2", "qwen3.8-27b-mode-b-directions", "qwen3.8-27b-bf16"])
    return root


def tensors(directory: Path, *names: str) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(directory)
    assert checkpoint.source == "index"
    out = {}
    for name in names:
        with safe_open(str(checkpoint.shard_path(name)), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _tree(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ---- the full size, as arithmetic -------------------------------------------------------


def test_full_preset_has_the_shapes_of_the_model_configs():
    real = json.loads((MODEL_CONFIGS / "qwen3.8-27b-w4a16" / "config.json").read_text())
    vision_ids = {"vision_start": 248316, "vision_end": 248317, "image_pad": 248318, "video_pad": 248319}
    ours = target_config(PRESETS["full"], "w4a16", {"eos": 2, "pad": 0, "mask": 9, **vision_ids})
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "layer_types", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "vocab_size",
                "rope_parameters"):
        assert ours["text_config"][key] == real["text_config"][key], key
    assert ours["architectures"] == real["architectures"] and ours["quantization_config"] == real["quantization_config"]
    # The real tower's config, the vision tokens' ids (the generated tokenizer's last four).
    assert ours["vision_config"] == real["vision_config"] and ours["image_token_id"] == 248318


def test_full_artifacts_weigh_what_the_hub_checkpoints_do():
    full = PRESETS["full"]
    sizes = {v: sum(t.nbytes for t in variant_tensors(full, v)) for v in full.variants}
    # REFERENCE.md: W4A16 target ~19.5 GB (its vision tower included, as here), GPTQ drafter
    # 1.19 GB, bf16 drafter 3.85 GB, NVFP4 target 20.42 GiB (8.56 NVFP4 + 7.79 FP8 + 4.07 BF16).
    assert 17.5 * GB < sizes["qwen3.8-27b-w4a16"] < 19.5 * GB
    assert 1.0 * GB < sizes["qwen3.8-27b-dflash2-w4a16"] < 1.3 * GB
    assert 3.6 * GB < sizes["qwen3.8-27b-dflash2"] < 3.9 * GB
    nvfp4 = stored_bytes(variant_tensors(full, "qwen3.8-27b-nvfp4"))
    assert 8.5 < nvfp4["nvfp4"] / 2**30 < 9.5 and 6.5 < nvfp4["fp8"] / 2**30 < 7.8
    shards = plan_shards(full, variant_tensors(full, "qwen3.8-27b-w4a16")).shards
    assert all(sum(t.nbytes for t in s) < 2.6 * GB for s in shards.values()) and len(shards) >= 8


def test_an_unknown_preset_or_model_is_one_clear_error(tmp_path):
    with pytest.raises(PrepareError, match="--size huge: unknown preset; expected one of tiny, full"):
        gen.generate(tmp_path, "huge")
    with pytest.raises(PrepareError, match="--only qwen3.8-27b-fp16: unknown model"):
        gen.generate(tmp_path, "small", only=["qwen3.8-27b-fp16"])
    assert not any(tmp_path.iterdir())


# ---- the formats, read back -------------------------------------------------------------


def test_w4a16_target_decompresses_through_compressed_tensors(small):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    target = small / "qwen3.8-27b-w4a16"
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    for module in ("model.language_model.layers.0.linear_attn.in_proj_qkv", "model.language_model.layers.3.self_attn.o_proj",
                   "model.language_model.layers.7.mlp.down_proj"):
        stored = tensors(target, *(f"{module}.weight_{s}" for s in ("packed", "scale", "shape")))
        w = PackedQuantizationCompressor.decompress({k.rsplit(".", 1)[1]: v for k, v in stored.items()}, scheme)["weight"]
        w = w.float()
        assert torch.isfinite(w).all() and abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.001
        assert float(w.abs().max()) <= 7 * float(stored[f"{module}.weight_scale"].float().max()) + 1e-6  # codes in [-7, 7]
    kept = tensors(target, "lm_head.weight", "model.language_model.layers.0.linear_attn.in_proj_a.weight",
                   "mtp.layers.0.mlp.down_proj.weight")
    assert all(t.dtype == torch.bfloat16 for t in kept.values())  # the hub checkpoint's ignore list


def test_vllm_compressed_tensors_config_reads_the_w4a16_target(small):
    from torch import nn
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    qc = json.loads((small / "qwen3.8-27b-w4a16" / "config.json").read_text())["quantization_config"]
    config = CompressedTensorsConfig.from_config(qc)
    config.apply_vllm_mapper(Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper)
    layer = nn.Linear(1, 1)
    down = config.get_scheme_dict(layer, "language_model.model.layers.0.mlp.down_proj")["weights"]
    assert (down.num_bits, down.group_size, down.symmetric) == (4, 128, True)
    assert config.get_scheme_dict(layer, "language_model.model.layers.0.linear_attn.in_proj_a") is None


def test_gptq_drafter_unpacks_to_the_scaled_codes(small):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    drafter = small / "qwen3.8-27b-dflash2-w4a16"
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["quantization_config"]["quant_method"] == "gptq"
    m = "layers.1.mlp.down_proj"
    t = tensors(drafter, *(f"{m}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")))
    in_f, out_f = t[f"{m}.qweight"].shape[0] * 8, t[f"{m}.qweight"].shape[1]
    # GPTQ packs 8 unsigned nibbles per int32 along the input dim; symmetric: zero point 8 (stored 7)
    codes = unpack_from_int32(t[f"{m}.qweight"].t().contiguous(), 4, torch.Size([out_f, in_f]), packed_dim=1)
    zeros = unpack_from_int32(t[f"{m}.qzeros"], 4, torch.Size([in_f // 128, out_f]), packed_dim=1)
    assert set(zeros.unique().tolist()) == {7 - 8} and t[f"{m}.g_idx"].tolist() == [i // 128 for i in range(in_f)]
    w = codes.float() * t[f"{m}.scales"].float().t()[:, t[f"{m}.g_idx"].long()]  # codes are already centred
    assert codes.min() >= -7 and codes.max() <= 7
    assert abs(float(w.std()) - min(0.05, in_f ** -0.5)) < 0.003


def test_nvfp4_target_decodes_like_vllm_and_carries_the_modelopt_table(small):
    from prepare.weight_formats import LinearReader, describe_linear
    from tests.support.quantize import modelopt_nvfp4_reference

    target = small / "qwen3.8-27b-nvfp4"
    quant = json.loads((target / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "modelopt" and quant["quant_algo"] == "MIXED_PRECISION"
    table = quant["quantized_layers"]
    ckpt = open_checkpoint(target)
    formats = {}
    for module, entry in table.items():
        formats.setdefault(entry["quant_algo"], set()).add(describe_linear(ckpt, module).format)
    assert formats == {"NVFP4": {"nvfp4-modelopt"}, "FP8": {"fp8-tensor"}}
    down = "model.language_model.layers.4.mlp.down_proj"
    stored = tensors(target, *(f"{down}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")))
    reference = modelopt_nvfp4_reference({k.rsplit(".", 1)[1]: v for k, v in stored.items()})  # vLLM's emulation
    with LinearReader(ckpt, describe_linear(ckpt, down)) as reader:
        ours = reader.rows(0, reference.shape[0])
    assert torch.equal(ours, reference) and abs(float(ours.std()) - 0.02) < 0.002
    o_proj = describe_linear(ckpt, "model.language_model.layers.3.self_attn.o_proj")
    with LinearReader(ckpt, o_proj) as reader:
        w = reader.rows(0, o_proj.out_features)
    assert torch.isfinite(w).all() and abs(float(w.std()) - 0.02) < 0.002


def test_every_model_has_a_manifest_that_matches_and_names_its_preset(small):
    for name in ("qwen3.8-27b-w4a16", "qwen3.8-27b-nvfp4", "qwen3.8-27b-dflash2", "qwen3.8-27b-mode-b-directions"):
        manifest = read_manifest(small / name)
        assert manifest.identity.generator == "tiny"
        assert manifest.identity.params == {"model": name, "preset": "small", "seed": DEFAULT_SEED}
        for entry in manifest.files:
            assert sha256_file(small / name / entry.path) == entry.sha256
        index = small / name / INDEX_NAME
        if index.exists():
            assert indexed_shards(index) <= {f.path for f in manifest.files}


def test_the_tokenizer_decodes_every_id_of_the_vocabulary(small):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small / "qwen3.8-27b-w4a16")
    assert len(tok) == 2048
    assert tok.decode([2047, 1500, 5]) and "<t2047>" in tok.decode([2047])
    assert all(i < 1000 for i in tok("def verify(slot): return the cache")["input_ids"])


def test_bytes_do_not_depend_on_the_number_of_writers(tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "INLINE_BYTES", 0)  # the pool, even for a small model
    monkeypatch.setattr(gen, "BLOCK_BYTES", 64 << 10)  # many blocks a tensor
    one = gen.generate(tmp_path / "one", "tiny-vl", only=["qwen3.8-27b-w4a16"], workers=1)
    two = gen.generate(tmp_path / "two", "tiny-vl", only=["qwen3.8-27b-w4a16"], workers=2)
    assert _tree(one.models["qwen3.8-27b-w4a16"].path) == _tree(two.models["qwen3.8-27b-w4a16"].path)


# ---- the preparation steps on generated models -------------------------------------------


def test_requantize_runs_on_the_generated_w4a16_target(small, tmp_path):
    from prepare.requantize import requantize_checkpoint

    result = requantize_checkpoint(small / "qwen3.8-27b-w4a16", tmp_path / "int8", ["lm_head", "embed_tokens"])
    assert {r.name for r in result.tensors} == {"lm_head.weight", "model.language_model.embed_tokens.weight"}
    assert max(r.relative_error for r in result.tensors) < 0.01
    assert read_manifest(tmp_path / "int8").identity.inputs[0].identity == read_manifest(small / "qwen3.8-27b-w4a16").identity
    assert result.placed and set(result.placed.values()) <= {"hardlink", "reflink", "copy"}  # untouched shards linked


def test_adapter_build_runs_on_the_generated_nvfp4_target(small, tmp_path):
    from prepare.adapter import build_adapter, verify_adapter_binding

    record = build_adapter(small / "qwen3.8-27b-nvfp4", small / "qwen3.8-27b-mode-b-directions", tmp_path / "adapter")
    assert record["formats"] == {"nvfp4-modelopt": 8, "fp8-tensor": 8}  # 8 down_proj, 6 out_proj + 2 o_proj
    verify_adapter_binding(tmp_path / "adapter", small / "qwen3.8-27b-nvfp4")


def test_verify_accepts_the_generated_directories_through_derived_profiles(small, tmp_path):
    """The fullscale profiles (real engine settings, generated slots) pass `qwen38 verify`."""
    import shutil
    import subprocess
    import sys

    import tomli_w

    from bench.fullscale_steps import derive_profile
    from prepare.adapter import build_adapter
    from prepare.requantize import requantize_checkpoint
    from tests.conftest import clean_env

    models = tmp_path / "models"
    shutil.copytree(small, models / "artifacts", symlinks=False, copy_function=shutil.copy2)
    requantize_checkpoint(models / "artifacts" / "qwen3.8-27b-w4a16", models / "prepared" / "qwen3.8-27b-w4a16-int8")
    build_adapter(models / "artifacts" / "qwen3.8-27b-nvfp4", models / "artifacts" / "qwen3.8-27b-mode-b-directions",
                  models / "prepared" / "qwen3.8-27b-mode-b")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for name in ("single", "long", "spark-lora"):
        data = derive_profile(name, cap_fraction=0.17 if name != "spark-lora" else None)
        (profiles / f"{name}-full.toml").write_bytes(tomli_w.dumps(data).encode())
    from core.errors import PatchError
    from entrypoint.patches import all_present, check_series, find_vllm_dir

    try:
        vllm_dir = find_vllm_dir()
    except PatchError:
        vllm_dir = None
    if vllm_dir is None or not all_present(check_series(vllm_dir)):
        pytest.skip("the GPU profiles require every patch delivered; this vLLM is not patched (make setup)")
    for name in ("single-full", "long-full", "spark-lora-full"):
        env = clean_env(PROFILES_DIR=str(profiles), MODELS_DIR=str(models), CACHE_DIR=str(tmp_path / "cache"))
        done = subprocess.run([sys.executable, "-m", "entrypoint.cli", "verify", "--profile", name], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert f"identity profile={name}" in done.stdout and "tiny-v" in done.stdout
    assert (models / "artifacts" / "qwen3.8-27b-w4a16" / MANIFEST_NAME).exists()
