"""Compile vLLM's GDN speculative Triton kernels for GPU targets, in a process of its own.

`python -m tests.support.gdn_kernel_compile` reads ``{"cases": [[path, kernel, arch], ...]}``
on stdin and prints ``{"results": [...]}``: for each case "ok" with the kernel's argument
names, or "skip: <reason>" where this Triton carries no toolchain for the target.

Real compilation runs here, apart from the test session (tests/support/triton_compile.py).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

from tests.support.triton_compile import compile_for_cuda

SCALAR_FLOATS = ("scale", "threshold")
FLAGS_ON = {"USE_INITIAL_STATE", "INPLACE_FINAL_STATE", "IS_VARLEN", "IS_CONTINUOUS_BATCHING", "IS_SPEC_DECODING"}
SIZES = {"B": 1, "H": 2, "HV": 4, "K": 128, "V": 128, "BK": 128, "BV": 32, "NUM_STATE_SLOTS": 8}
STRIDES = {"stride_indices_seq": 8, "stride_indices_tok": 1}


def jit_kernel(path: Path, name: str):
    """The kernel ``name`` of vLLM's file ``path``, with vLLM's Triton shim swapped for Triton."""
    from triton.runtime.jit import JITFunction

    source = path.read_text()
    source = source.replace("from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl")
    source = source.replace("from .op import exp, log", "from triton.language import exp, log")
    module = types.ModuleType(name)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - vLLM's (patched) file
    kernel = getattr(module, name)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def signature_of(kernel, scalar_beta: bool) -> tuple[dict[str, str], dict[str, object]]:
    signature: dict[str, str] = {}
    constants: dict[str, object] = {}
    for name in kernel.arg_names:
        if name in ("N", "T"):
            signature[name] = "i64"
        elif name in SCALAR_FLOATS or (name == "beta" and scalar_beta):
            signature[name] = "fp32"
        elif name in SIZES:
            constants[name] = SIZES[name]
        elif name in STRIDES:
            constants[name] = STRIDES[name]
        elif name.startswith(("stride_init", "stride_final")):
            constants[name] = 4 * 128 * 128
        elif name.isupper():
            constants[name] = name in FLAGS_ON
        elif name in ("ssm_state_indices", "num_accepted_tokens", "cu_seqlens"):
            signature[name] = "*i32"
        else:
            signature[name] = "*fp32"
    return signature, constants


def compile_case(path: str, name: str, arch: int) -> dict[str, object]:
    kernel = jit_kernel(Path(path), name)
    signature, constants = signature_of(kernel, scalar_beta="sigmoid" in Path(path).name)
    compiled = compile_for_cuda(kernel, signature, constants, arch, {"num_warps": 1})
    if isinstance(compiled, str):
        return {"status": compiled}
    return {"status": "ok", "arg_names": list(kernel.arg_names), "ttir": bool(compiled.asm.get("ttir"))}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET: this process compiles kernels for real")
    cases = json.loads(sys.stdin.read())["cases"]
    results = []
    for path, name, arch in cases:
        try:
            results.append(compile_case(path, name, arch))
        except Exception as exc:  # reported per case to the test, which fails with it
            results.append({"status": f"error: {type(exc).__name__}: {exc}"})
    sys.stdout.write(json.dumps({"results": results}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
