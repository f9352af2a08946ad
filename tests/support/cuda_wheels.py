"""A directory shaped like ``site-packages/nvidia/cu13`` once the CUDA toolchain wheels are
installed (nvcc, crt, nvvm, runtime, curand), for the toolchain and doctor tests; the real tree
is checked in the image (tests/container/test_image_rtx3090.py)."""

from __future__ import annotations

from pathlib import Path

NVCC_13_0 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
DRIVER_DIR = Path("/usr/lib/x86_64-linux-gnu")


def cuda_wheel_tree(root: Path, libraries=("libcudart.so.13", "libcurand.so.10", "libcudadevrt.a")) -> Path:
    tree = root / "site-packages" / "nvidia" / "cu13"
    for name in ("bin/nvcc", "include/cuda_runtime.h", "include/curand_kernel.h", "nvvm/bin/cicc"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    (tree / "lib").mkdir()
    for name in libraries:
        (tree / "lib" / name).write_text(name)
    return tree
