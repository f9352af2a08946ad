"""A reference 8-bit WNA16 linear kernel for vLLM's CPU platform (tests only).

vLLM 0.28.0's CPU build has no kernel for 8-bit weight-only compressed-tensors layers:
``CPUWNA16LinearKernel`` (and the Zentorch / dynamic-4bit ones) implement only uint4 /
uint4b8, so a model with an int8 ``lm_head`` fails to build on CPU with "Failed to find a
kernel that can implement the WNA16 linear layer ... uint8b128". On a GPU, Marlin serves
it. To run the *rest* of vLLM's real path on CPU - config parsing, scheme selection,
weight loaders filling ``weight_packed`` / ``weight_scale`` / ``weight_shape`` - this module
registers, through vLLM's public ``register_linear_kernel``, a kernel that dequantizes the
loaded parameters with compressed-tensors' own unpacking (the format's oracle) and runs
``F.linear`` in the activation dtype. It is a test instrument, not part of the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from vllm.model_executor.kernels.linear import register_linear_kernel
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel, MPLinearLayerConfig
from vllm.platforms import PlatformEnum
from vllm.scalar_type import scalar_types

SEEN: list[dict] = []


class ReferenceInt8WNA16Kernel(MPLinearKernel):
    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        if c.weight_type != scalar_types.uint8b128 or c.zero_points or c.has_g_idx:
            return False, "reference kernel: symmetric 8-bit only"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = getattr(layer, self.w_q_name).data
        scale = getattr(layer, self.w_s_name).data
        rows, words = packed.shape
        codes = unpack_from_int32(packed, 8, torch.Size([rows, words * 4]))
        group = codes.shape[1] // scale.shape[1]
        weight = (codes.float().reshape(rows, -1, group) * scale.float().unsqueeze(2)).reshape(rows, -1)
        layer.reference_weight = torch.nn.Parameter(weight.to(self.config.act_type), requires_grad=False)
        SEEN.append({"scale_dtype": str(scale.dtype), "packed_shape": list(packed.shape), "group": group})

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.reference_weight, bias)


def register() -> None:
    register_linear_kernel(ReferenceInt8WNA16Kernel, PlatformEnum.CPU, "mp")
