"""Decoding stored weights: our rows equal independent encoders' / decoders' values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.checkpoint import open_checkpoint
from core.errors import PrepareError
from prepare.checkpoint_writer import CheckpointWriter, write_checkpoint
from prepare.weight_formats import (
    LinearReader,
    WeightFormatError,
    decode_e2m1,
    describe_linear,
    fp8_block_size,
    linear_modules,
)
from tests.support.quantize import stored_module

FORMATS = ["bf16", "fp8-tensor", "fp8-channel", "fp8-block", "nvfp4-modelopt", "nvfp4-ct"]


def _write(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    """One shard of a weights-only checkpoint (no config.json, no index)."""
    CheckpointWriter(directory).write_shard(name, tensors)
    return directory


def _decode_all(directory: Path, module: str, row_chunk: int) -> tuple[str, torch.Tensor]:
    ckpt = open_checkpoint(directory, require_config=False)
    linear = describe_linear(ckpt, module)
    with LinearReader(ckpt, linear) as reader:
        rows = [block for _s, _e, block in reader.row_blocks(row_chunk)]
    return linear.format, torch.cat(rows)


def test_e2m1_nibbles_unpack_like_compressed_tensors_low_nibble_first():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    every_byte = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    ours = decode_e2m1(every_byte)
    theirs = unpack_fp4_from_uint8(every_byte, 8, 64, dtype=torch.float32)
    assert torch.equal(ours, theirs)
    # byte 0x71: low nibble 1 -> 0.5 comes first, high nibble 7 -> 6.0 second; 0x8F: -6.0 then -0.0
    assert decode_e2m1(torch.tensor([[0x71, 0x9F]], dtype=torch.uint8)).tolist() == [[0.5, 6.0, -6.0, -0.5]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("row_chunk", [1, 77, 4096])
def test_rows_decode_to_the_reference_dequantization(tmp_path, fmt, row_chunk):
    torch.manual_seed(1)
    # 300 rows: not a multiple of 128 (block FP8 tiles) nor of the odd row chunk
    w = torch.randn(300, 384) * 0.05
    tensors, reference = stored_module("model.layers.0.mlp.down_proj", fmt, w)
    found_fmt, decoded = _decode_all(_write(tmp_path, tensors), "model.layers.0.mlp.down_proj", row_chunk)
    assert found_fmt == fmt
    torch.testing.assert_close(decoded, reference, rtol=1e-6, atol=0)


def test_modelopt_nvfp4_matches_vllm_reference_bit_for_bit(tmp_path):
    torch.manual_seed(2)
    w = torch.randn(64, 512) * 0.02
    tensors, reference = stored_module("m", "nvfp4-modelopt", w)
    _fmt, decoded = _decode_all(_write(tmp_path, tensors), "m", 16)
    assert torch.equal(decoded, reference)
    # and the encoder is a faithful NVFP4 one: within FP4 rounding of the original
    assert float((decoded - w).abs().max()) < 0.2 * float(w.abs().max())


def test_modelopt_global_scale_multiplies_and_compressed_tensors_global_scale_divides(tmp_path):
    torch.manual_seed(3)
    w = torch.randn(32, 64)
    mo, _ = stored_module("m", "nvfp4-modelopt", w)
    ct, _ = stored_module("n", "nvfp4-ct", w)
    assert float(mo["m.weight_scale_2"]) < 1e-2  # amax / 2688
    assert float(ct["n.weight_global_scale"]) > 100  # 2688 / amax
    _write(tmp_path, {**mo, **ct})
    _f, a = _decode_all(tmp_path, "m", 8)
    _f, b = _decode_all(tmp_path, "n", 8)
    # both decode close to the same original weight (different rounding paths)
    assert float((a - w).abs().max()) < 0.2 * float(w.abs().max())
    assert float((b - w).abs().max()) < 0.2 * float(w.abs().max())


def test_index_is_followed_across_shards_when_present(tmp_path):
    torch.manual_seed(4)
    tensors, reference = stored_module("model.layers.0.self_attn.o_proj", "nvfp4-modelopt", torch.randn(16, 32))
    names = sorted(tensors)
    # weight in one shard, scales in another: the index says where each lives
    first = {names[0]: tensors[names[0]]}
    rest = {n: tensors[n] for n in names[1:]}
    write_checkpoint(
        tmp_path, {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": rest}, index=True
    )
    ckpt = open_checkpoint(tmp_path, require_config=False)
    assert ckpt.source == "index"
    _fmt, decoded = _decode_all(tmp_path, "model.layers.0.self_attn.o_proj", 5)
    assert torch.equal(decoded, reference)


def test_shards_are_scanned_without_an_index(tmp_path):
    _write(tmp_path, {"a.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, "one.safetensors")
    _write(tmp_path, {"b.weight": torch.ones(2, 2, dtype=torch.bfloat16)}, "two.safetensors")
    ckpt = open_checkpoint(tmp_path, require_config=False)
    assert ckpt.source == "scan"
    assert ckpt.weight_map == {"a.weight": "one.safetensors", "b.weight": "two.safetensors"}
    assert linear_modules(ckpt) == ["a", "b"]
    assert ckpt.config == {} and fp8_block_size(ckpt) == (128, 128)
    with pytest.raises(PrepareError, match="config.json: missing"):
        open_checkpoint(tmp_path)  # a checkpoint to transform needs its config


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    _write(tmp_path, {"a.weight": torch.zeros(2, 2)}, "one.safetensors")
    _write(tmp_path, {"a.weight": torch.zeros(2, 2)}, "two.safetensors")
    with pytest.raises(PrepareError, match="a.weight.*both"):
        open_checkpoint(tmp_path, require_config=False)


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "gone.safetensors"}}))
    with pytest.raises(PrepareError, match="gone.safetensors"):
        open_checkpoint(tmp_path, require_config=False)


def _refusal(tmp_path: Path, tensors: dict[str, torch.Tensor], module: str = "m") -> str:
    _write(tmp_path, tensors)
    with pytest.raises(WeightFormatError) as info:
        describe_linear(open_checkpoint(tmp_path, require_config=False), module)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_fp8_without_a_scale_is_refused(tmp_path):
    msg = _refusal(tmp_path, {"m.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)})
    assert "neither `weight_scale` nor `weight_scale_inv`" in msg


def test_nvfp4_without_global_scale_is_refused(tmp_path):
    tensors, _ = stored_module("m", "nvfp4-modelopt", torch.randn(8, 32))
    del tensors["m.weight_scale_2"]
    assert "no `weight_scale_2`" in _refusal(tmp_path, tensors)


def test_nvfp4_with_a_wrong_block_scale_shape_is_refused(tmp_path):
    tensors, _ = stored_module("m", "nvfp4-modelopt", torch.randn(8, 32))
    tensors["m.weight_scale"] = tensors["m.weight_scale"][:, :1].contiguous()
    assert "block scale shape must be [8, 2]" in _refusal(tmp_path, tensors)


def test_nvfp4_block_scale_in_a_non_fp8_dtype_is_refused(tmp_path):
    tensors, _ = stored_module("m", "nvfp4-modelopt", torch.randn(8, 32))
    tensors["m.weight_scale"] = tensors["m.weight_scale"].float()
    assert "must be F8_E4M3, found F32" in _refusal(tmp_path, tensors)


def test_block_fp8_scale_grid_that_does_not_tile_the_weight_is_refused(tmp_path):
    tensors = {
        "m.weight": torch.zeros(256, 256).to(torch.float8_e4m3fn),
        "m.weight_scale_inv": torch.ones(3, 2),
    }
    assert "must be [2, 2]" in _refusal(tmp_path, tensors)


@pytest.mark.parametrize(
    ("tensor", "found"),
    [
        (torch.zeros(4, 4, dtype=torch.int8), "I8"),
        (torch.zeros(4, 4).to(torch.float8_e5m2), "F8_E5M2"),
        (torch.zeros(4, 4, dtype=torch.float64), "F64"),
    ],
)
def test_unknown_weight_dtype_is_refused(tmp_path, tensor, found):
    assert f"unknown weight dtype {found}" in _refusal(tmp_path, {"m.weight": tensor})


def test_int4_pack_quantized_weight_is_refused_by_name(tmp_path):
    msg = _refusal(tmp_path, {"m.weight_packed": torch.zeros(4, 1, dtype=torch.int32)})
    assert "packed I32 weights" in msg
