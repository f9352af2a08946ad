"""int8 group quantization and packing, checked against compressed-tensors as the oracle."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

from prepare.int8_pack import (
    SCALE_FLOOR,
    GroupQuantizer,
    dequantize_rows,
    quantize_rows,
    round_up_to,
    unpack_codes,
)

GROUP = 128
ARGS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=GROUP)


def weights(rows: int, cols: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.02
    w[0, :GROUP] = 0.0  # an all-zero group
    w[1, 5] = 3.0  # an outlier group
    w[2, 7] = -3.0  # a negative absmax
    w[3, GROUP : 2 * GROUP] = 1e-9  # a group below the scale floor
    return w.to(dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_codes_and_scales_round_trip_exactly_through_compressed_tensors(scale_dtype, source_dtype):
    w = weights(37, 4 * GROUP, dtype=source_dtype)
    out = quantize_rows(w, GROUP, scale_dtype)
    assert out.packed.dtype == torch.int32 and out.packed.shape == (37, GROUP)
    assert out.scale.dtype == scale_dtype and out.scale.shape == (37, 4)

    codes = unpack_from_int32(out.packed, 8, torch.Size([37, 4 * GROUP]))
    assert torch.equal(codes, unpack_codes(out.packed))
    assert torch.equal(pack_to_int32(codes, 8), out.packed)
    # compressed-tensors' own quantize, given our scale, gives our codes.
    oracle = quantize(x=w.float(), scale=out.scale, zero_point=None, args=ARGS, dtype=torch.int8)
    assert torch.equal(oracle, codes)
    # ... and its dequantize is ours (it multiplies in the scale's dtype unless given fp32).
    ours = dequantize_rows(out.packed, out.scale, GROUP)
    assert torch.equal(dequantize(codes, out.scale.float(), args=ARGS), ours)
    assert torch.allclose(dequantize(codes, out.scale, args=ARGS).float(), ours, rtol=1e-2, atol=0)


def test_scale_is_absmax_over_127_rounded_up_to_the_scale_dtype():
    w = weights(8, 2 * GROUP, seed=3)
    out = quantize_rows(w, GROUP, torch.float16)
    exact = w.float().reshape(8, 2, GROUP).abs().amax(dim=2) / 127
    stored = out.scale.float()
    assert torch.all(stored >= torch.clamp(exact, min=SCALE_FLOOR))
    # the next smaller fp16 value would be below absmax / 127: rounded up by at most one step
    below = torch.nextafter(out.scale, torch.zeros_like(out.scale)).float()
    assert torch.all(below < torch.clamp(exact, min=SCALE_FLOOR))


def test_floor_keeps_zero_and_tiny_groups_at_a_positive_scale():
    w = weights(4, 2 * GROUP)
    fp16 = quantize_rows(w, GROUP, torch.float16)
    bf16 = quantize_rows(w, GROUP, torch.bfloat16)
    assert torch.all(fp16.scale > 0) and torch.all(bf16.scale > 0)
    assert bf16.scale[0, 0].item() == pytest.approx(SCALE_FLOOR, rel=1e-2)  # zero group: floored
    assert fp16.scale[0, 0].item() == 2.0**-24  # 1e-10 is below fp16's range: smallest subnormal
    assert torch.all(unpack_codes(fp16.packed)[0, :GROUP] == 0)


def test_group_extremes_map_to_plus_minus_127_without_clipping():
    w = weights(4, 2 * GROUP, dtype=torch.float32)
    codes = unpack_codes(quantize_rows(w, GROUP, torch.float16).packed)
    assert codes[1, 5] == 127 and codes[2, 7] == -127
    assert codes.min() >= -127  # -128 is never used: symmetric


def test_round_up_never_returns_a_smaller_value():
    values = torch.rand(10_000) * torch.logspace(-12, 2, 10_000)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.all(round_up_to(values, dtype).float() >= values.clamp(max=6e4))


def test_reported_error_is_the_dequantization_error():
    w = (torch.randn(64, 3 * GROUP, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    out = quantize_rows(w, GROUP, torch.bfloat16)
    direct = torch.linalg.vector_norm(w.double() - dequantize_rows(out.packed, out.scale, GROUP).double()) ** 2
    assert out.sq_error == pytest.approx(float(direct), rel=1e-3)
    assert out.sq_norm == pytest.approx(float(torch.linalg.vector_norm(w.double()) ** 2), rel=1e-4)
    assert (out.sq_error / out.sq_norm) ** 0.5 < 0.01  # REFERENCE section 5: < 1 %


def test_blocks_through_one_quantizer_equal_the_whole_matrix():
    w = weights(100, 2 * GROUP, seed=9)
    whole = quantize_rows(w, GROUP, torch.float16)
    quantizer = GroupQuantizer(2 * GROUP, GROUP, torch.float16, max_rows=32)
    packed, scales = [], []
    for start in range(0, 100, 32):
        block = quantizer.quantize(w[start : start + 32])
        packed.append(block.packed.clone())
        scales.append(block.scale.clone())
    assert torch.equal(torch.cat(packed), whole.packed)
    assert torch.equal(torch.cat(scales), whole.scale)


def test_non_finite_weights_and_bad_shapes_are_refused():
    w = weights(4, GROUP, dtype=torch.float32)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_rows(w, GROUP, torch.float16)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_rows(torch.zeros(2, GROUP + 4), GROUP, torch.float16)
