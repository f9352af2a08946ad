"""Independent encoders for the stored weight formats the adapter converter reads.

Test support: each encoder follows the published format with someone else's arithmetic
where a library offers it (compressed-tensors' E2M1 packer and NVFP4 compressor, vLLM's
block-FP8 `scaled_quantize`), so the converter's decoder is checked against code it does
not share. Each returns the tensors exactly as a checkpoint stores them.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
E2M1_MAX = 6.0


def modelopt_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4: `weight` u8 (2 E2M1 per byte, low nibble first), FP8 block scales per
    16 inputs, `weight_scale_2` = amax / (6 * 448) multiplying them."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    w = w.float()
    out_f, in_f = w.shape
    global_scale = w.abs().max() / (E2M1_MAX * FP8_MAX)
    blocks = w.reshape(out_f, in_f // 16, 16)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / global_scale).to(torch.float8_e4m3fn)
    effective = block_scale.float() * global_scale
    safe = torch.where(effective == 0, torch.ones_like(effective), effective)
    q = (blocks / safe.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).reshape(out_f, in_f)
    return {
        "weight": pack_fp4_to_uint8(q),  # rounds to the nearest E2M1 value
        "weight_scale": block_scale,
        "weight_scale_2": global_scale.reshape(()).float(),
    }


def compressed_tensors_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 (`weight_packed`, `weight_scale`, `weight_global_scale`),
    produced by compressed-tensors' own qparams and NVFP4PackedCompressor."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        generate_gparam,
    )

    w = w.float()
    out_f, in_f = w.shape
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    global_scale = generate_gparam(w.min(), w.max())
    blocks = w.reshape(out_f, in_f // 16, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=global_scale)
    state = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}, scheme
    )
    return {k: v.contiguous() for k, v in state.items()}


def compressed_tensors_nvfp4_reference(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own fp32 dequantization of `compressed_tensors_nvfp4` output."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = stored["weight_packed"]
    m, n = packed.shape
    values = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
    return dequantize(
        x_q=values,
        scale=stored["weight_scale"].float(),
        global_scale=stored["weight_global_scale"],
        dtype=torch.float32,
    )


def modelopt_nvfp4_reference(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """vLLM 0.28.0's reference NVFP4 dequantizer (the emulation path) on unswizzled scales."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    # On a CUDA machine vLLM dequantizes with a Triton kernel: the tensors must be on the GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return dequantize_to_dtype(
        stored["weight"].to(device), stored["weight_scale"].to(device), stored["weight_scale_2"].to(device),
        torch.float32, 16, swizzle=False,
    ).cpu()


def fp8_per_tensor(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().max() / FP8_MAX).reshape(())
    return {"weight": (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}


def fp8_per_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    return {"weight": (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}


def _pad_to_tiles(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    rows, cols = x.shape
    return torch.nn.functional.pad(x, (0, -cols % tile, 0, -rows % tile))


def fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block FP8 over 128x128 tiles with vLLM's `scaled_quantize` (scale = amax / 448).

    A ragged edge is zero-padded to whole tiles for quantizing, then cropped, as block-FP8
    checkpoints store it (scale grid ceil(out/128) x ceil(in/128))."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_quantize,
    )

    rows, cols = w.shape
    q, scale_inv = scaled_quantize(_pad_to_tiles(w.float()), GroupShape(128, 128), torch.float8_e4m3fn)
    return {"weight": q[:rows, :cols].contiguous(), "weight_scale_inv": scale_inv.float().contiguous()}


def fp8_block_reference(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
    )

    q = stored["weight"]
    rows, cols = q.shape
    padded = _pad_to_tiles(q.float()).to(torch.float8_e4m3fn)
    full = scaled_dequantize(padded, stored["weight_scale_inv"], GroupShape(128, 128), torch.float32)
    return full[:rows, :cols].contiguous()


def fp8_reference(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    scale = stored["weight_scale"].float()
    return stored["weight"].float() * (scale if scale.numel() == 1 else scale.reshape(-1, 1))


ENCODERS = {
    "bf16": lambda w: {"weight": w.to(torch.bfloat16)},
    "fp8-tensor": fp8_per_tensor,
    "fp8-channel": fp8_per_channel,
    "fp8-block": fp8_block,
    "nvfp4-modelopt": modelopt_nvfp4,
    "nvfp4-ct": compressed_tensors_nvfp4,
}

REFERENCES = {
    "bf16": lambda s: s["weight"].float(),
    "fp8-tensor": fp8_reference,
    "fp8-channel": fp8_reference,
    "fp8-block": fp8_block_reference,
    "nvfp4-modelopt": modelopt_nvfp4_reference,
    "nvfp4-ct": compressed_tensors_nvfp4_reference,
}


def stored_module(module: str, fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors named `<module>.<suffix>`, the reference dequantized weight)."""
    stored = ENCODERS[fmt](w)
    return {f"{module}.{k}": v for k, v in stored.items()}, REFERENCES[fmt](stored)
