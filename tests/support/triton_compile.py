"""Triton kernels compiled for CUDA targets without a GPU: one home for the tests that prove a
kernel builds for the 3090 (sm_86), Hopper and Blackwell here.

`compile_for_cuda` compiles one kernel (to a cubin: ptxas runs) for ``sm_<arch>``, or says why
this Triton cannot. It runs in a process of its own (`run_compile_child`): in the test session
Triton's core language may already be imported under its interpreter (the split-KV and k4v2
kernel tests need that, see tests/conftest.py), and a compiled kernel must not meet interpreted
library functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def compile_for_cuda(kernel, signature: dict[str, str], constants: dict[str, Any], arch: int,
                     options: dict[str, int]) -> Any:
    """``kernel`` (a JITFunction) compiled for sm_<arch> with ``signature`` (argument -> Triton
    type; the ``constants``' arguments are constexprs), or "skip: ..." where this Triton carries
    no CUDA toolchain for it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    try:
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except RuntimeError as exc:  # no CUDA toolchain (ptxas) bundled with this Triton
        return f"skip: Triton cannot compile for sm_{arch} here: {str(exc).splitlines()[0][:200]}"


def run_compile_child(module: str, *args: str, stdin: str | None = None) -> Any:
    """``python -m module args`` outside Triton's interpreter, this checkout first on the path:
    the last line it prints, read as JSON (the module's answer); a failed child fails the caller."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
