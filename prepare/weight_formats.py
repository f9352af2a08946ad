"""Linear weights as a checkpoint stores them, decoded to fp32 one block of rows at a time.

A module's storage format is read from the tensors beside its weight, never guessed from
its name: packed NVFP4 (ModelOpt `weight` u8 + `weight_scale` + `weight_scale_2`, or
compressed-tensors `weight_packed` u8 + `weight_scale` + `weight_global_scale`), static FP8
E4M3 (per-tensor or per-channel `weight_scale`), block FP8 (`weight_scale_inv`, or a 2-D
`weight_scale`, over 128 x 128 tiles) and plain BF16/FP16/FP32. Rows are sliced straight out
of the safetensors shards, so neither a whole dequantized tensor nor a dequantized model is
ever held in memory. The checkpoint itself (shards, index, headers, config) is opened by
`core.checkpoint.open_checkpoint`; this module only reads what format its tensors are in.

Conventions, checked against vLLM 0.28.0 and compressed-tensors 0.17.0:
- E2M1 nibbles: low nibble first (even input index), bit 3 the sign, magnitudes
  [0, 0.5, 1, 1.5, 2, 3, 4, 6]; one FP8 E4M3 block scale per 16 inputs along the row.
- ModelOpt `weight_scale_2` = amax / (6 * 448) multiplies (vLLM's ModelOptNvFp4 methods
  use it as is); compressed-tensors `weight_global_scale` = (6 * 448) / amax divides
  (vLLM's CT NVFP4 scheme takes its reciprocal).
- FP8 `weight_scale` and `weight_scale_inv` both multiply (`scaled_dequantize`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from core.checkpoint import Checkpoint
from core.errors import PrepareError

if TYPE_CHECKING:
    import torch

NVFP4_BLOCK = 16
DEFAULT_FP8_BLOCK = (128, 128)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PLAIN_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
SCALE_DTYPES = {"F32", "BF16", "F16"}

WeightFormat = Literal[
    "bf16", "fp16", "fp32", "fp8-tensor", "fp8-channel", "fp8-block", "nvfp4-modelopt", "nvfp4-ct"
]


class WeightFormatError(PrepareError):
    """A checkpoint tensor that is missing, malformed or in a format we do not decode."""

    code = "weights"


# ---------------------------------------------------------------------------------------
# The checkpoint (read by `core.checkpoint`): its modules and FP8 tile size


def linear_modules(ckpt: Checkpoint) -> list[str]:
    """Names of modules with a `weight` or `weight_packed` tensor."""
    names = set()
    for tensor in ckpt.weight_map:
        for suffix in (".weight", ".weight_packed"):
            if tensor.endswith(suffix):
                names.add(tensor[: -len(suffix)])
    return sorted(names)


def fp8_block_size(ckpt: Checkpoint) -> tuple[int, int]:
    """The block-FP8 tile (rows, cols) the quantization config states, else 128 x 128."""
    quant = ckpt.config.get("quantization_config") or ckpt.text_config.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return (block[0], block[1])
    return DEFAULT_FP8_BLOCK


# ---------------------------------------------------------------------------------------
# What a module's tensors say about its format


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string: "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StoredLinear:
    """One linear layer as stored: its format, logical shape and the tensors that hold it."""

    module: str
    format: WeightFormat
    out_features: int
    in_features: int
    weight: TensorInfo
    scale: TensorInfo | None = None  # block / channel / tensor scale
    global_scale: TensorInfo | None = None  # NVFP4 only
    block: tuple[int, int] | None = None  # fp8-block tile (rows, cols)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_info(ckpt: Checkpoint, name: str) -> TensorInfo:
    entry = ckpt.entry(name)
    return TensorInfo(name, entry.dtype, entry.shape)


def _is_scalar(shape: tuple[int, ...]) -> bool:
    return _numel(shape) == 1 and len(shape) <= 1


def _require(ckpt: Checkpoint, module: str, suffix: str, why: str) -> TensorInfo:
    name = f"{module}.{suffix}"
    if not ckpt.has(name):
        raise WeightFormatError(
            f"{ckpt.root}: {module} is {why} but has no `{suffix}` tensor; the checkpoint is incomplete"
        )
    return _tensor_info(ckpt, name)


def _require_scale_dtype(info: TensorInfo, allowed: set[str], what: str) -> None:
    if info.dtype not in allowed:
        raise WeightFormatError(f"{info.name}: {what} must be {'/'.join(sorted(allowed))}, found {info.dtype}")


def describe_linear(ckpt: Checkpoint, module: str) -> StoredLinear:
    """Classify ``module``'s stored format from its tensors (dtypes and shapes only)."""
    if ckpt.has(f"{module}.weight_packed"):
        packed = _tensor_info(ckpt, f"{module}.weight_packed")
        if packed.dtype != "U8":
            raise WeightFormatError(
                f"{packed.name}: packed {packed.dtype} weights (e.g. int4 pack-quantized) are not a format the "
                "converter decodes; it reads NVFP4 (U8), FP8 E4M3, BF16/FP16/FP32"
            )
        return _describe_nvfp4(ckpt, module, packed, "nvfp4-ct", "weight_global_scale")
    if not ckpt.has(f"{module}.weight"):
        raise WeightFormatError(f"{ckpt.root}: no tensor {module}.weight (or .weight_packed) in the checkpoint")
    weight = _tensor_info(ckpt, f"{module}.weight")
    if len(weight.shape) != 2:
        raise WeightFormatError(f"{weight.name}: expected a 2-D [out, in] weight, found shape {list(weight.shape)}")
    out_f, in_f = weight.shape
    if weight.dtype in PLAIN_DTYPES:
        return StoredLinear(module, PLAIN_DTYPES[weight.dtype], out_f, in_f, weight)  # type: ignore[arg-type]
    if weight.dtype == "U8":
        return _describe_nvfp4(ckpt, module, weight, "nvfp4-modelopt", "weight_scale_2")
    if weight.dtype == "F8_E4M3":
        return _describe_fp8(ckpt, module, weight)
    raise WeightFormatError(
        f"{weight.name}: unknown weight dtype {weight.dtype}; the converter decodes U8 (NVFP4), F8_E4M3, BF16, F16, F32"
    )


def _describe_nvfp4(
    ckpt: Checkpoint, module: str, weight: TensorInfo, fmt: WeightFormat, global_name: str
) -> StoredLinear:
    if len(weight.shape) != 2:
        raise WeightFormatError(f"{weight.name}: expected a 2-D packed NVFP4 weight, found shape {list(weight.shape)}")
    out_f, in_f = weight.shape[0], weight.shape[1] * 2
    if in_f % NVFP4_BLOCK:
        raise WeightFormatError(f"{weight.name}: NVFP4 input size {in_f} is not a multiple of {NVFP4_BLOCK}")
    scale = _require(ckpt, module, "weight_scale", "packed NVFP4")
    _require_scale_dtype(scale, {"F8_E4M3"}, "the NVFP4 block scale")
    expected = (out_f, in_f // NVFP4_BLOCK)
    if scale.shape != expected:
        raise WeightFormatError(
            f"{scale.name}: NVFP4 block scale shape must be {list(expected)} for weight {list(weight.shape)}, "
            f"found {list(scale.shape)}"
        )
    global_scale = _require(ckpt, module, global_name, "packed NVFP4")
    _require_scale_dtype(global_scale, SCALE_DTYPES, "the NVFP4 global scale")
    if not _is_scalar(global_scale.shape):
        raise WeightFormatError(
            f"{global_scale.name}: expected one global scale, found shape {list(global_scale.shape)}"
        )
    return StoredLinear(module, fmt, out_f, in_f, weight, scale, global_scale)


def _describe_fp8(ckpt: Checkpoint, module: str, weight: TensorInfo) -> StoredLinear:
    out_f, in_f = weight.shape
    if ckpt.has(f"{module}.weight_scale_inv"):
        scale = _tensor_info(ckpt, f"{module}.weight_scale_inv")
        return _fp8_block(ckpt, module, weight, scale)
    if not ckpt.has(f"{module}.weight_scale"):
        raise WeightFormatError(
            f"{ckpt.root}: {module} is FP8 but has neither `weight_scale` nor `weight_scale_inv`; "
            "the checkpoint is incomplete"
        )
    scale = _tensor_info(ckpt, f"{module}.weight_scale")
    _require_scale_dtype(scale, SCALE_DTYPES, "an FP8 weight scale")
    if _is_scalar(scale.shape) or scale.shape == (1, 1):
        return StoredLinear(module, "fp8-tensor", out_f, in_f, weight, scale)
    if scale.shape in ((out_f,), (out_f, 1)):
        return StoredLinear(module, "fp8-channel", out_f, in_f, weight, scale)
    if len(scale.shape) == 2:
        return _fp8_block(ckpt, module, weight, scale)
    raise WeightFormatError(
        f"{scale.name}: FP8 scale shape {list(scale.shape)} fits neither per-tensor [1], per-channel [{out_f}] "
        f"nor 128x128 blocks for weight {list(weight.shape)}"
    )


def _fp8_block(ckpt: Checkpoint, module: str, weight: TensorInfo, scale: TensorInfo) -> StoredLinear:
    _require_scale_dtype(scale, SCALE_DTYPES, "an FP8 block scale")
    out_f, in_f = weight.shape
    b0, b1 = fp8_block_size(ckpt)
    expected = (-(-out_f // b0), -(-in_f // b1))
    if scale.shape != expected:
        raise WeightFormatError(
            f"{scale.name}: FP8 block scale shape must be {list(expected)} ({b0}x{b1} tiles of weight "
            f"{list(weight.shape)}), found {list(scale.shape)}"
        )
    return StoredLinear(module, "fp8-block", out_f, in_f, weight, scale, block=(b0, b1))


# ---------------------------------------------------------------------------------------
# Pure decoders (tensors in, fp32 out)

_PAIR_LUT: torch.Tensor | None = None


def e2m1_pair_table() -> torch.Tensor:
    """[256, 2] fp32: the two E2M1 values (low nibble, high nibble) of every byte."""
    global _PAIR_LUT
    if _PAIR_LUT is None:
        import torch

        values = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
        byte = torch.arange(256)
        _PAIR_LUT = torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=1).contiguous()
    return _PAIR_LUT


class DecodeScratch:
    """Reusable buffers for NVFP4 decoding: a few big allocations per build, not per block.

    Fresh tens-of-MB buffers per row block cost more in page faults than the decoding itself
    and fragment the heap, so peak RSS would creep up with the number of modules.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        import torch

        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            self._buffers.pop(name, None)
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[name] = buf
        return buf[:numel]


def decode_e2m1(packed: torch.Tensor, scratch: DecodeScratch | None = None) -> torch.Tensor:
    """Unpack [rows, in/2] u8 into [rows, in] fp32 (low nibble = even input index).

    With ``scratch`` the result lives in a reused buffer, valid until the next call.
    """
    import torch

    rows = packed.shape[0]
    # Each byte's two fp32 values, read as one 8-byte word: a 1-D index_select with int32
    # indices is ~4x faster on CPU than a 2-D gather with int64 ones.
    pairs = e2m1_pair_table().view(torch.int64).reshape(256)
    if scratch is None:
        words = pairs.index_select(0, packed.reshape(-1).to(torch.int32))
    else:
        index = scratch.get("e2m1-index", packed.numel(), torch.int32)
        index.copy_(packed.reshape(-1))
        words = scratch.get("e2m1-words", packed.numel(), torch.int64)
        torch.index_select(pairs, 0, index, out=words)
    return words.view(torch.float32).reshape(rows, -1)


def decode_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: float, *, divide_global: bool = False
) -> torch.Tensor:
    """Dequantize NVFP4 rows: e2m1 x block_scale x global (ModelOpt) or / global (compressed-tensors)."""
    values = decode_e2m1(packed)
    rows, in_f = values.shape
    scales = _nvfp4_scales(block_scale, global_scale, divide_global)
    values.view(rows, in_f // NVFP4_BLOCK, NVFP4_BLOCK).mul_(scales.unsqueeze(-1))
    return values


def _nvfp4_scales(block_scale: torch.Tensor, global_scale: float, divide_global: bool) -> torch.Tensor:
    scales = block_scale.float()
    return scales / global_scale if divide_global else scales * global_scale


def decode_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static FP8 rows times a scalar or per-row [rows] / [rows, 1] scale."""
    w = weight.float()
    s = scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    return w * s.reshape(-1, 1)


def decode_fp8_block(
    weight: torch.Tensor, scale_rows: torch.Tensor, row_start: int, block: tuple[int, int]
) -> torch.Tensor:
    """Block-FP8 rows [row_start, row_start+rows): each 128x128 tile times its scale.

    ``scale_rows`` holds the tile-rows of the scale grid the rows fall in, starting with
    the tile-row of ``row_start``.
    """
    import torch

    rows, in_f = weight.shape
    b0, b1 = block
    tile_row = (torch.arange(row_start, row_start + rows) // b0) - row_start // b0
    per_row = scale_rows.float()[tile_row]  # [rows, tiles along the input]
    per_elem = per_row.repeat_interleave(b1, dim=1)[:, :in_f]
    return weight.float() * per_elem


# ---------------------------------------------------------------------------------------
# Reading rows out of the shards


class LinearReader:
    """Open the shards of one `StoredLinear` and decode blocks of its rows to fp32.

    ``on_stored`` (if given) sees every stored tensor slice read, in reading order, so a
    caller can hash exactly the bytes the result was computed from. Pass one `DecodeScratch`
    to every reader of a build to keep memory flat.
    """

    def __init__(
        self, ckpt: Checkpoint, linear: StoredLinear, on_stored=None, scratch: DecodeScratch | None = None
    ) -> None:
        self.ckpt = ckpt
        self.linear = linear
        self._on_stored = on_stored
        self._scratch = scratch
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        self._global = 1.0
        self._small_scale = None

    def __enter__(self) -> LinearReader:
        lin = self.linear
        if lin.global_scale is not None:
            g = self._read_full(lin.global_scale)
            self._global = float(g.float().reshape(-1)[0])
            if lin.format == "nvfp4-ct" and self._global == 0.0:
                raise WeightFormatError(f"{lin.global_scale.name}: global scale is 0; compressed-tensors divides by it")
            if self._global != self._global or self._global in (float("inf"), float("-inf")):
                raise WeightFormatError(f"{lin.global_scale.name}: global scale is not finite ({self._global})")
        if lin.format in ("fp8-tensor", "fp8-channel", "fp8-block"):
            assert lin.scale is not None
            self._small_scale = self._read_full(lin.scale)
        return self

    def __exit__(self, *exc) -> None:
        # Closing the handles unmaps the shards: touched pages leave this process's RSS.
        self._handles.clear()
        self._stack.close()

    def _handle(self, tensor: str):
        from safetensors import safe_open

        path = self.ckpt.shard_path(tensor)
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def _read_full(self, info: TensorInfo):
        t = self._handle(info.name).get_tensor(info.name)
        if self._on_stored is not None:
            self._on_stored(info, 0, t)
        return t

    def _read_rows(self, info: TensorInfo, start: int, end: int):
        t = self._handle(info.name).get_slice(info.name)[start:end]
        if self._on_stored is not None:
            self._on_stored(info, start, t)
        return t

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the dequantized weight, fp32 [end - start, in_features]."""
        lin = self.linear
        weight = self._read_rows(lin.weight, start, end)
        if lin.format in ("bf16", "fp16", "fp32"):
            return weight.float()
        if lin.format in ("nvfp4-modelopt", "nvfp4-ct"):
            assert lin.scale is not None
            block_scale = self._read_rows(lin.scale, start, end)
            return decode_nvfp4(weight, block_scale, self._global, divide_global=lin.format == "nvfp4-ct")
        scale = self._small_scale
        if lin.format == "fp8-tensor":
            return decode_fp8(weight, scale)
        if lin.format == "fp8-channel":
            return decode_fp8(weight, scale.reshape(-1)[start:end])
        assert lin.block is not None
        b0 = lin.block[0]
        return decode_fp8_block(weight, scale[start // b0 : -(-end // b0)], start, lin.block)

    def weighted_row_sum(self, start: int, end: int, coeffs: torch.Tensor) -> torch.Tensor:
        """``coeffs @ W[start:end]`` (fp32 [in_features]) with the scales folded in where
        that saves a pass over the block: per-tensor/per-channel FP8 scales go into the
        coefficients, NVFP4 block scales into one weighted sum per 16-input block."""
        import torch

        lin = self.linear
        if lin.format in ("fp8-tensor", "fp8-channel"):
            weight = self._read_rows(lin.weight, start, end)
            scale = self._small_scale.float().reshape(-1)
            scale = scale if lin.format == "fp8-tensor" else scale[start:end]
            return (coeffs * scale) @ self._as_fp32(weight)
        if lin.format in ("nvfp4-modelopt", "nvfp4-ct"):
            assert lin.scale is not None
            weight = self._read_rows(lin.weight, start, end)
            block_scale = self._read_rows(lin.scale, start, end)
            u = coeffs.unsqueeze(1) * _nvfp4_scales(block_scale, self._global, lin.format == "nvfp4-ct")
            values = decode_e2m1(weight, self._scratch).view(end - start, -1, NVFP4_BLOCK)
            return torch.einsum("ib,ibk->bk", u, values).reshape(-1)
        return coeffs @ self.rows(start, end)

    def _as_fp32(self, weight: torch.Tensor) -> torch.Tensor:
        import torch

        if self._scratch is None:
            return weight.float()
        out = self._scratch.get("fp32-rows", weight.numel(), torch.float32).view(weight.shape)
        return out.copy_(weight)

    def row_blocks(self, row_chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        for start in range(0, self.linear.out_features, row_chunk):
            end = min(start + row_chunk, self.linear.out_features)
            yield start, end, self.rows(start, end)
