"""Which code MKL's fp32 GEMM (torch's, and patches 0081/0083's fp32 work) runs on emulated CPUs
without AVX-512: MKL names its code path only for Intel CPUs, so the time tells.

    .venv/bin/python -m tests.support.qemu_mkl_bench

For QEMU's EPYC-Rome model (AMD Zen 2: AVX2, no AVX-512), its Haswell model (Intel: AVX2) and
Haswell with MKL limited to SSE4.2, prints MKL's own line (MKL_VERBOSE) and the seconds five
384 x 384 x 384 GEMMs take on one thread, emulated. QEMU emulates AVX2 instructions far more
slowly than SSE ones, so a model running MKL's AVX2-class code takes about as long as Haswell
does, and one on SSE code far less. Needs qemu-x86_64 (`make qemu`); about 4 minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.qemu import AVX2_MODEL, INSTALL, qemu_x86_64

RUNS = ((AVX2_MODEL, {}), ("Haswell", {}), ("Haswell", {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}))
GEMMS = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(384, 384), torch.randn(384, 384)
a @ b
start = time.perf_counter()
for _ in range(5):
    a @ b
print(f"SECONDS {time.perf_counter() - start:.1f}")
"""


def main() -> int:
    emulator = qemu_x86_64()
    if emulator is None:
        print(f"no qemu-x86_64: {INSTALL}", file=sys.stderr)
        return 2
    for model, knobs in RUNS:
        env = {**os.environ, "MKL_VERBOSE": "1", **knobs}
        done = subprocess.run([emulator, "-cpu", model, sys.executable, "-c", GEMMS], env=env,
                              capture_output=True, text=True, timeout=900)
        lines = done.stdout.splitlines()
        path = next((line.split(" for ", 1)[-1].split(", Lnx")[0] for line in lines if "oneMKL" in line), "?")
        seconds = next((line.split()[1] for line in lines if line.startswith("SECONDS ")), None)
        if done.returncode != 0 or seconds is None:
            print(f"{model}: failed (exit {done.returncode}): {done.stderr[-500:]}", file=sys.stderr)
            return 1
        label = model + "".join(f", {k}={v}" for k, v in knobs.items())
        print(f"{label:<40} {seconds:>6} s   MKL: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
