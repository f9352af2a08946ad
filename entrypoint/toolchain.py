"""The CUDA JIT toolchain of the CUDA images, and the proof that a JIT compile finds it.

FlashInfer compiles kernels on first use (its sampling kernels include ``curand_kernel.h``)
and Triton builds launcher stubs at run time. The images take that toolchain from the
hash-pinned lock, not from NVIDIA's apt repository: the pip wheels (``nvidia-cuda-nvcc``,
``-crt``, ``nvidia-nvvm``, ``nvidia-cuda-runtime``, ``nvidia-curand``, ``nvidia-cuda-cccl``)
unpack into one tree, ``site-packages/nvidia/cu13`` (``bin/nvcc``, ``include/``, ``nvvm/``,
``lib/``). nvcc runs from there as is (its ``nvcc.profile`` finds the rest relative to itself);
what the tree lacks for a JIT build is the toolkit's library layout: FlashInfer links with
``-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda``, and the wheels ship only
versioned libraries (``libcudart.so.13``) and no driver stub.

`toolkit_links` (pure) lays out a toolkit at ``CUDA_HOME`` made of relative symlinks into the
tree: ``bin``, ``include``, ``nvvm``, ``lib64/<every library>`` plus the unversioned names a
``-l`` flag asks for, and ``lib64/stubs/libcuda.so`` pointing at the driver's ``libcuda.so.1``,
which the NVIDIA container toolkit mounts at run time (so a JIT link resolves against the
real driver). `link_toolkit` writes it (``qwen38 toolchain link``, at image build time).

`prebuild_flashinfer_modules` (``qwen38 toolchain prebuild``, at image build time) runs those
JIT builds once for the image's ``FLASHINFER_CUDA_ARCH_LIST`` and puts each module in
FlashInfer's AOT directory, which FlashInfer loads before it would build anything: vLLM's
sampler needs the sampling module at every start and the DFlash2 drafter the top-k one, and
building them is minutes of nvcc (5-10 min for the sampling module on the 2-core development
VM, docs/images.md), so a first start no longer pays for it.

`check_toolchain` looks where FlashInfer looks (`jit_cuda_home`: ``CUDA_HOME``, ``CUDA_PATH``,
else the directory above ``nvcc`` on PATH, else ``/usr/local/cuda``) and proves each piece;
``qwen38 toolchain check`` fails the image build when one is missing, and ``qwen38 doctor``
reports the same checks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from core.errors import ToolchainError

# Where the CUDA 13 wheels unpack, relative to site-packages.
WHEEL_TREE = Path("nvidia") / "cu13"
# The toolkit directories linked as a whole; lib64 is built file by file.
LINKED_DIRS = ("bin", "include", "nvvm")
_VERSIONED_SO = re.compile(r"^(lib[\w+-]+\.so)\.\d+(\.\d+)*$")
_NVCC_RELEASE = re.compile(r"release (\d+\.\d+),")

Runner = Callable[[list[str]], str | None]


def run_command(argv: list[str]) -> str | None:
    """stdout of a command, or None when it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


# ---- the toolkit layout ---------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    path: str  # relative to CUDA_HOME
    target: str  # what the symlink holds: relative into the tree, or the driver's absolute path


def driver_library_dir() -> Path:
    """Where the NVIDIA container toolkit mounts the driver libraries in a Debian-style image."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    return Path("/usr/lib") / multiarch


def toolkit_links(cuda_home: Path, tree: Path, libraries: list[str], driver_dir: Path) -> list[Link]:
    """The symlinks that make ``tree`` (a wheel tree) a CUDA toolkit at ``cuda_home`` (pure).

    ``libraries`` are the file names in ``tree/lib``. Targets are relative, so the venv can
    be copied whole from one image stage to the next.
    """
    links = [Link(name, os.path.relpath(tree / name, cuda_home)) for name in LINKED_DIRS]
    lib64 = cuda_home / "lib64"
    names = set(libraries)
    for name in sorted(libraries):
        links.append(Link(f"lib64/{name}", os.path.relpath(tree / "lib" / name, lib64)))
        versioned = _VERSIONED_SO.match(name)
        # `-lcudart` wants libcudart.so; point it at the versioned file beside it.
        if versioned and versioned.group(1) not in names:
            names.add(versioned.group(1))
            links.append(Link(f"lib64/{versioned.group(1)}", name))
    links.append(Link("lib64/stubs/libcuda.so", str(driver_dir / "libcuda.so.1")))
    return sorted(links, key=lambda link: link.path)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def link_toolkit(cuda_home: Path, tree: Path, driver_dir: Path) -> list[Link]:
    """Write the toolkit at ``cuda_home`` (replacing an older one whole, never half-written)."""
    missing = [name for name in (*LINKED_DIRS, "lib") if not (tree / name).is_dir()]
    if missing:
        raise ToolchainError(
            f"{tree}: no {', '.join(missing)} directory; the CUDA toolchain wheels (nvidia-cuda-nvcc, "
            "nvidia-nvvm, nvidia-cuda-runtime) are not installed in this environment"
        )
    libraries = sorted(p.name for p in (tree / "lib").iterdir())
    links = toolkit_links(cuda_home, tree, libraries, driver_dir)
    staging = cuda_home.with_name(f".{cuda_home.name}.incomplete")
    shutil.rmtree(staging, ignore_errors=True)
    for link in links:
        path = staging / link.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(link.target)
    if cuda_home.is_symlink() or cuda_home.is_file():
        cuda_home.unlink()
    elif cuda_home.exists():
        shutil.rmtree(cuda_home)
    staging.rename(cuda_home)
    return links


# ---- the checks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolchainCheck:
    name: str
    ok: bool
    detail: str
    # What a JIT build does without this piece (said by `qwen38 doctor` when it is missing).
    consequence: str = ""


def jit_cuda_home(environ: dict[str, str], which: Callable[[str], str | None] = shutil.which) -> Path:
    """The CUDA directory FlashInfer's JIT compiles against, found the way FlashInfer finds it."""
    explicit = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if explicit:
        return Path(explicit)
    nvcc = which("nvcc")
    if nvcc:
        return Path(nvcc).parent.parent
    return Path("/usr/local/cuda")


def nvcc_release(version_output: str) -> str | None:
    match = _NVCC_RELEASE.search(version_output)
    return match.group(1) if match else None


def check_toolchain(
    cuda_home: Path,
    *,
    torch_cuda: str | None,
    run: Runner = run_command,
    python_include: Path | None = None,
    cc: str | None = None,
    cxx: str | None = None,
) -> list[ToolchainCheck]:
    """Every piece a FlashInfer JIT build of the sampling kernels takes from ``cuda_home``."""
    checks: list[ToolchainCheck] = []
    nvcc = cuda_home / "bin" / "nvcc"
    output = run([str(nvcc), "--version"]) if nvcc.exists() else None
    release = nvcc_release(output or "")
    no_nvcc = "FlashInfer cannot JIT-build its kernels; vLLM falls back to slower paths"
    if release is None:
        checks.append(ToolchainCheck("nvcc", False, f"{nvcc} is missing or does not run", no_nvcc))
    elif torch_cuda and release != ".".join(torch_cuda.split(".")[:2]):
        checks.append(ToolchainCheck(
            "nvcc", False, f"{nvcc} is CUDA {release}, torch is built for CUDA {torch_cuda}",
            "kernels built by this nvcc may not load beside torch's CUDA runtime"))
    else:
        checks.append(ToolchainCheck("nvcc", True, f"{nvcc} (CUDA {release})"))
    include = cuda_home / "include"
    for name, header, consequence in (
        ("cuda headers", "cuda_runtime.h", no_nvcc),
        ("curand", "curand_kernel.h",
         "JIT-built sampling kernels fall back silently (~5 % slower on the 3090)"),
    ):
        path = include / header
        checks.append(ToolchainCheck(name, path.is_file(), str(path) if path.is_file() else f"{path} is missing",
                                     consequence))
    cudart = cuda_home / "lib64" / "libcudart.so"
    checks.append(ToolchainCheck(
        "cudart", cudart.exists(), str(cudart) if cudart.exists() else f"{cudart} is missing",
        "a JIT build cannot link its kernels (-lcudart)"))
    # Triton builds its launcher with $CC or gcc (nvcc's host compiler too); FlashInfer compiles
    # and links with $CXX or c++.
    for name, compiler, consequence in (
        ("c compiler", cc or os.environ.get("CC") or "gcc",
         "Triton cannot build its launchers, so the engine's Triton kernels cannot run"),
        ("c++ compiler", cxx or os.environ.get("CXX") or "c++", "FlashInfer cannot JIT-build its kernels"),
    ):
        found = run([compiler, "--version"])
        checks.append(ToolchainCheck(
            name, found is not None, found.splitlines()[0] if found else f"{compiler} is missing or does not run",
            consequence))
    header = (python_include or Path(sysconfig.get_paths()["include"])) / "Python.h"
    checks.append(ToolchainCheck(
        "python headers", header.is_file(), str(header) if header.is_file() else f"{header} is missing",
        "Triton cannot build its launchers (they include Python.h), nor FlashInfer its modules"))
    ninja = run(["ninja", "--version"])
    checks.append(ToolchainCheck(
        "ninja", ninja is not None, f"ninja {ninja.strip()}" if ninja else "ninja is missing from PATH",
        "FlashInfer cannot run its JIT builds"))
    return checks


def torch_cuda_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


# ---- building FlashInfer's JIT modules ahead of time ----------------------------------------

# The FlashInfer modules every profile's engine loads at its first start, each a JIT build of
# minutes of nvcc where it is not prebuilt: vLLM's sampler (top-k / top-p), and the DFlash2
# drafter's candidate selection (radix top-k over the vocabulary, vLLM's
# `LogitsProcessor.get_top_k_tokens`: 140 s of nvcc inside the engine's profiling run of the
# 2026-12-02 full-size cold start, docs/gpu.md). name -> (module, JitSpec factory).
PREBUILT_MODULES: dict[str, tuple[str, str]] = {
    "sampling": ("flashinfer.jit.sampling", "gen_sampling_module"),
    "topk": ("flashinfer.jit.topk", "gen_topk_module"),
}


def _jit_spec(name: str):
    import importlib

    module, factory = PREBUILT_MODULES[name]
    return getattr(importlib.import_module(module), factory)()


def prebuilt_missing() -> list[str]:
    """The modules of `PREBUILT_MODULES` not yet in FlashInfer's AOT directory."""
    return [name for name in PREBUILT_MODULES if not _jit_spec(name).aot_path.exists()]


def _build_and_install(name: str) -> Path:
    """Build one FlashInfer module (its own build directory) and install it as its AOT artifact,
    never half-written: a copy beside it, then a rename."""
    spec = _jit_spec(name)
    try:
        spec.build(verbose=False)
    except RuntimeError as exc:
        raise ToolchainError(f"FlashInfer's {name} module does not build: {str(exc)[-600:]}") from None
    target = spec.aot_path
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.incomplete")
    shutil.copyfile(spec.jit_library_path, staging)
    staging.chmod(0o755)
    os.replace(staging, target)
    return target


def prebuild_flashinfer_modules(driver_dir: Path, workspace: Path, names: list[str] | None = None) -> dict[str, Path]:
    """JIT-build FlashInfer's modules now (``names``, default those missing) and install each
    as its AOT artifact, which FlashInfer loads before it would build anything.

    The builds are FlashInfer's own (``gen_*_module().build()``: nvcc from CUDA_HOME for
    ``FLASHINFER_CUDA_ARCH_LIST``, then ``c++ ... -lcudart -lcuda``). No driver exists at image
    build time; the link only needs a ``libcuda.so.1`` to name, so an empty one stands where
    the container toolkit mounts the real one, for these builds only (whatever a module takes
    from the driver resolves against the real library when it is loaded).
    """
    # FlashInfer reads its workspace from the environment when its JIT modules are first
    # imported (the look at what is missing imports them; a caller that looked before sets it
    # before that too).
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    names = prebuilt_missing() if names is None else names
    if not names:
        return {}
    placeholder = driver_dir / "libcuda.so.1"
    made_placeholder = not placeholder.exists()
    if made_placeholder:
        placeholder.parent.mkdir(parents=True, exist_ok=True)
        built = subprocess.run(
            ["cc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(placeholder), "-x", "c", "/dev/null"],
            capture_output=True, text=True,
        )
        if built.returncode != 0:
            raise ToolchainError(f"cannot make a placeholder {placeholder}: {built.stderr.strip()[-300:]}")
    try:
        # Side by side: each module is a handful of nvcc units (ninja runs one module's in
        # parallel, and its longest unit bounds it), so the two builds overlap on a many-core
        # machine instead of adding up (307 s one after the other on the H200's 16 cores).
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            return dict(zip(names, pool.map(_build_and_install, names)))
    finally:
        if made_placeholder:
            placeholder.unlink(missing_ok=True)
        shutil.rmtree(workspace, ignore_errors=True)
