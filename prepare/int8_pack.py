"""int8 symmetric group quantization in compressed-tensors' pack-quantized layout (pure).

Each row is split into groups of ``group_size`` consecutive input columns. A group's scale
is ``absmax / 127`` (floored at 1e-10) stored in the scale dtype, rounded *up* to the next
representable value when the cast would shrink it: then every ``|w| / scale <= 127``, so
codes never clip and every stored scale is positive (a 1e-10 floor would underflow to 0
in fp16). Codes are ``round(w / scale)`` (half to even) computed in fp32 - what
compressed-tensors' own ``quantize`` returns for the same scale.

Packing: compressed-tensors' ``pack_to_int32`` for 8 bits adds 128 to each code and puts
four consecutive columns into one int32, the first in the low byte. On a little-endian
machine those int32 words are byte for byte the codes with their top bit flipped, so
packing is an XOR on the int8 buffer viewed as int32 (columns are a multiple of the group
size, hence of 4: no padding). tests/unit/test_int8_pack.py checks both directions against
compressed-tensors.

Speed: a block is processed in place in buffers allocated once per quantizer (fresh
multi-MB allocations cost a page fault per 4 KiB on every block), in blocks of about a
million elements so the working set stays in cache.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

SCALE_FLOOR = 1e-10
CODE_MAX = 127
PACK_FACTOR = 4  # int8 codes per int32 word
BLOCK_ELEMENTS = 1 << 20

if sys.byteorder != "little":  # the XOR packing above assumes little-endian words
    raise ImportError("prepare.int8_pack needs a little-endian machine")


@dataclass
class PackedRows:
    """One row block in the stored layout (views into the quantizer's buffers)."""

    packed: torch.Tensor  # int32 [rows, cols / 4]
    scale: torch.Tensor  # scale dtype [rows, cols / group_size]
    sq_error: float  # sum over the block of (w - dequantized w)^2
    sq_norm: float  # sum over the block of w^2


def round_up_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (fp32) cast to ``dtype``, never smaller than the fp32 value."""
    cast = values.to(dtype)
    low = cast.to(torch.float32) < values
    if bool(low.any()):
        cast = torch.where(low, torch.nextafter(cast, torch.full_like(cast, float("inf"))), cast)
    return cast


def rows_per_block(cols: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(cols, 1))


class GroupQuantizer:
    """Quantizes row blocks of a ``cols``-wide matrix; reuses its buffers across blocks."""

    def __init__(self, cols: int, group_size: int, scale_dtype: torch.dtype, max_rows: int) -> None:
        if group_size <= 0 or group_size % PACK_FACTOR:
            raise ValueError(f"group size {group_size} is not a positive multiple of {PACK_FACTOR}")
        if cols % group_size:
            raise ValueError(f"{cols} columns are not a multiple of the group size {group_size}")
        self.cols = cols
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.max_rows = max_rows
        self._work = torch.empty(max_rows * cols, dtype=torch.float32)
        self._rounded = torch.empty(max_rows * cols, dtype=torch.float32)
        self._codes = torch.empty(max_rows * cols, dtype=torch.int8)

    def quantize(self, rows: torch.Tensor, *, measure: bool = True) -> PackedRows:
        count = rows.shape[0]
        if rows.ndim != 2 or rows.shape[1] != self.cols or count > self.max_rows:
            raise ValueError(f"block of shape {tuple(rows.shape)} does not fit [<= {self.max_rows}, {self.cols}]")
        groups = self.cols // self.group_size
        size = count * self.cols
        work = self._work[:size].view(count, groups, self.group_size)
        work.view(count, self.cols).copy_(rows)
        # amax and amin separately: torch's fused aminmax over a short inner dim is ~20x slower
        absmax = torch.maximum(work.amax(dim=2), work.amin(dim=2).neg_())
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("block holds NaN or infinite weights")
        scale = round_up_to(absmax.div_(CODE_MAX).clamp_min_(SCALE_FLOOR), self.scale_dtype)
        scale_f32 = scale.to(torch.float32).unsqueeze(2)
        sq_norm = float(torch.linalg.vector_norm(work)) ** 2 if measure else 0.0
        # |w / scale| <= 127 by construction of the scale, so rounding never needs a clamp.
        work.div_(scale_f32)
        sq_error = 0.0
        if measure:
            rounded = torch.round(work, out=self._rounded[:size].view(count, groups, self.group_size))
            # per group: sum (w/s - q)^2, times s^2 -> squared error in weight units
            frac = work.sub_(rounded)
            per_group = torch.linalg.vector_norm(frac, dim=2).square_().mul_(scale_f32.squeeze(2).square())
            sq_error = float(per_group.sum())
        else:
            rounded = work.round_()
        codes = self._codes[:size].view(count, self.cols)
        codes.copy_(rounded.view(count, self.cols))
        packed = codes.view(torch.uint8).bitwise_xor_(0x80).view(torch.int32)
        return PackedRows(packed=packed, scale=scale, sq_error=sq_error, sq_norm=sq_norm)


def quantize_rows(rows: torch.Tensor, group_size: int, scale_dtype: torch.dtype, *, measure: bool = True) -> PackedRows:
    """Quantize a whole 2-D matrix at once (tests and small tensors); returns owned tensors."""
    quantizer = GroupQuantizer(rows.shape[1], group_size, scale_dtype, max(rows.shape[0], 1))
    result = quantizer.quantize(rows, measure=measure)
    return PackedRows(result.packed.clone(), result.scale.clone(), result.sq_error, result.sq_norm)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8 codes [rows, cols] from int32 words [rows, cols / 4] (inverse of the packing)."""
    return packed.contiguous().view(torch.uint8).bitwise_xor(0x80).view(torch.int8)


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 weights from the stored layout."""
    codes = unpack_codes(packed).to(torch.float32)
    rows, cols = codes.shape
    grouped = codes.reshape(rows, cols // group_size, group_size) * scale.to(torch.float32).unsqueeze(2)
    return grouped.reshape(rows, cols)
