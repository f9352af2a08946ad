"""Patch 0050 without a GPU: the patched GDN speculative kernels compile with Triton
for the 3090 (sm_86) and Blackwell (sm_120) targets, as the stock ones do.

The numerical proof (bounded indexing against a torch recurrence) needs a GPU:
tests/gpu/test_patch_kernels.py::test_gdn_spec_state_indexing_is_bounded. vLLM turns
Triton off where no GPU driver is found, so the kernel source of the patched view is
compiled here with Triton itself (vLLM's Triton shim swapped for the real modules).
"""

from __future__ import annotations

import types

import pytest

from tests.support.vllm_views import vllm_views  # noqa: F401

KERNELS = {
    "fused_recurrent.py": "fused_recurrent_gated_delta_rule_fwd_kernel",
    "fused_sigmoid_gating.py": "fused_sigmoid_gating_delta_rule_update_kernel",
}


def _jit_kernel(path, name):
    from triton.runtime.jit import JITFunction

    source = path.read_text()
    source = source.replace(
        "from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl"
    )
    source = source.replace("from .op import exp, log", "from triton.language import exp, log")
    module = types.ModuleType(name)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - our own patched file
    kernel = getattr(module, name)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _signature(kernel, scalar_beta: bool):
    flags_on = {
        "USE_INITIAL_STATE",
        "INPLACE_FINAL_STATE",
        "IS_VARLEN",
        "IS_CONTINUOUS_BATCHING",
        "IS_SPEC_DECODING",
    }
    sizes = {"B": 1, "H": 2, "HV": 4, "K": 128, "V": 128, "BK": 128, "BV": 32, "NUM_STATE_SLOTS": 8}
    strides = {"stride_indices_seq": 8, "stride_indices_tok": 1}
    signature, constants = {}, {}
    for name in kernel.arg_names:
        if name in ("N", "T"):
            signature[name] = "i64"
        elif name in ("scale", "threshold") or (name == "beta" and scalar_beta):
            signature[name] = "fp32"
        elif name in sizes:
            constants[name] = sizes[name]
        elif name in strides:
            constants[name] = strides[name]
        elif name.startswith(("stride_init", "stride_final")):
            constants[name] = 4 * 128 * 128
        elif name.isupper():
            constants[name] = name in flags_on
        elif name in ("ssm_state_indices", "num_accepted_tokens", "cu_seqlens"):
            signature[name] = "*i32"
        else:
            signature[name] = "*fp32"
    for name in constants:
        signature[name] = "constexpr"
    return signature, constants


@pytest.mark.parametrize("arch", [86, 120])
@pytest.mark.parametrize("view", ["stock", "patched"])
@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_gdn_spec_kernels_compile(vllm_views, filename, view, arch):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = vllm_views[view] / "vllm" / "third_party" / "flash_linear_attention" / "ops" / filename
    kernel = _jit_kernel(path, KERNELS[filename])
    signature, constants = _signature(kernel, scalar_beta="sigmoid" in filename)
    if view == "patched":
        assert "NUM_STATE_SLOTS" in kernel.arg_names
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
    )
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})
    except RuntimeError as exc:  # no CUDA toolchain (ptxas) bundled with this Triton
        pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
    assert compiled.asm["ttir"]
