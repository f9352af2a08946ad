"""`qwen38 doctor`: is this machine ready for a profile? One line per check.

Checks, for GPU profiles: the NVIDIA driver and GPU (nvidia-smi), the CUDA runtime torch
was built for, free GPU memory against what the profile will take (its pinned KV pool
plus its weights), other processes holding GPU memory (the Spark article lost a day to a
stray llama-server holding 21.7 GiB), and the CUDA JIT toolchain where FlashInfer looks for
it (`entrypoint.toolchain`: nvcc, the CUDA and curand headers - without curand's,
FlashInfer's sampling kernels fail to build and vLLM silently falls back, ~5 % slower on the
3090 - cudart, C and C++ compilers, Python's headers, ninja). For every profile: the
compile-cache location and size.

A blocker exits non-zero; warnings do not. The image runs it before launch with
``--warn-only`` (it reports, never stops the start), and users run it on demand.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from entrypoint.errors import StackError
from entrypoint.profiles import Profile
from entrypoint.toolchain import Runner, check_toolchain, jit_cuda_home, run_command, torch_cuda_version

Level = Literal["ok", "warn", "blocker", "info"]
GIB = 1 << 30
# Beyond the KV pool and the weights: the V2 runner's CUDA graphs (~1.2-1.5 GiB on the 3090),
# activations and workspaces. The weights are counted as stored, an upper bound (the MTP and
# vision tensors on disk are never loaded), so a short estimate is a warning, not a blocker.
RUNTIME_OVERHEAD_BYTES = 3 * GIB // 2


@dataclass(frozen=True)
class Finding:
    level: Level
    check: str
    detail: str

    def line(self) -> str:
        return f"{self.level.upper():7} {self.check:14} {self.detail}"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    driver: str
    total_mib: int
    free_mib: int
    compute_cap: str


def parse_gpus(csv: str) -> list[GpuInfo]:
    gpus = []
    for line in csv.strip().splitlines():
        index, name, driver, total, free, cap = (f.strip() for f in line.split(","))
        gpus.append(GpuInfo(int(index), name, driver, int(total), int(free), cap))
    return gpus


def parse_processes(csv: str) -> list[GpuProcess]:
    out = []
    for line in csv.strip().splitlines():
        if not line.strip():
            continue
        pid, name, used = (f.strip() for f in line.split(","))
        out.append(GpuProcess(int(pid), name, int(used) if used.isdigit() else 0))
    return out


def query_gpus(run: Runner) -> list[GpuInfo] | None:
    csv = run(
        ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.free,compute_cap",
         "--format=csv,noheader,nounits"]
    )
    return None if csv is None else parse_gpus(csv)


def query_processes(run: Runner) -> list[GpuProcess]:
    csv = run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"])
    return [] if csv is None else parse_processes(csv)


# Without these Triton cannot build the launchers of the engine's own kernels (the GDN layers
# run on Triton), so the engine cannot serve; the other pieces are FlashInfer's JIT, reported as
# warnings like the missing curand headers always were.
BLOCKING_TOOLCHAIN_CHECKS = frozenset({"c compiler", "python headers"})


def directory_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def memory_finding(profile: Profile, gpu: GpuInfo, weights_bytes: int) -> Finding:
    """Free memory against the profile: KV pool (exact) + weights as stored + runtime."""
    kv = profile.engine.kv_cache_memory_bytes or 0
    need = kv + weights_bytes + RUNTIME_OVERHEAD_BYTES
    free = gpu.free_mib << 20
    detail = (
        f"{free / GIB:.1f} GiB free on GPU {gpu.index}; profile {profile.name} takes up to {need / GIB:.1f} GiB "
        f"(KV pool {kv / GIB:.1f} + weights as stored {weights_bytes / GIB:.1f} + runtime "
        f"{RUNTIME_OVERHEAD_BYTES / GIB:.1f})"
    )
    if free >= need:
        return Finding("ok", "memory", detail)
    if free >= kv + weights_bytes // 2:
        return Finding("warn", "memory", detail + "; tight: it may still fit, the weights figure is an upper bound")
    return Finding("blocker", "memory", detail)


def diagnose(
    profile: Profile,
    *,
    cuda_visible_devices: str,
    cache_dir: Path,
    weights_bytes: int,
    run: Runner = run_command,
    cuda_home: Path | None = None,
    cuda_runtime: str | None = None,
) -> list[Finding]:
    """Every check for ``profile`` on this machine (I/O through ``run`` and the paths)."""
    findings: list[Finding] = []
    if profile.platform == "cuda":
        gpus = query_gpus(run)
        if not gpus:
            findings.append(Finding("blocker", "gpu", "no NVIDIA GPU or driver: nvidia-smi is missing or failed"))
        else:
            wanted = cuda_visible_devices.split(",")[0]
            gpu = next((g for g in gpus if str(g.index) == wanted), gpus[0])
            findings.append(Finding("ok", "gpu", f"{gpu.index}: {gpu.name}, compute capability {gpu.compute_cap}"))
            findings.append(Finding("ok", "driver", f"NVIDIA driver {gpu.driver}"))
            if profile.cuda_arch and gpu.compute_cap != profile.cuda_arch:
                findings.append(Finding(
                    "warn", "arch", f"profile {profile.name} is sized for sm {profile.cuda_arch} ({profile.machine}); "
                    f"this GPU is {gpu.compute_cap}"))
            findings.append(memory_finding(profile, gpu, weights_bytes))
            others = query_processes(run)
            if others:
                held = ", ".join(f"{p.name} (pid {p.pid}, {p.used_mib} MiB)" for p in others)
                findings.append(Finding("warn", "processes", f"other processes hold GPU memory: {held}"))
            else:
                findings.append(Finding("ok", "processes", "no other process holds GPU memory"))
        runtime = cuda_runtime if cuda_runtime is not None else torch_cuda_version()
        findings.append(
            Finding("ok", "cuda", f"torch built for CUDA {runtime}") if runtime
            else Finding("blocker", "cuda", "torch has no CUDA runtime (a CPU build?)"))
        home = cuda_home if cuda_home is not None else jit_cuda_home(dict(os.environ))
        for check in check_toolchain(home, torch_cuda=runtime, run=run):
            if check.ok:
                findings.append(Finding("ok", check.name, check.detail))
            else:
                level = "blocker" if check.name in BLOCKING_TOOLCHAIN_CHECKS else "warn"
                findings.append(Finding(level, check.name, f"{check.detail}: {check.consequence} "
                                        "(`qwen38 toolchain check`; docs/images.md)"))
    root = cache_dir.absolute()
    size = directory_size(root) if root.exists() else 0
    findings.append(Finding("info", "compile cache", f"{root} ({size / GIB:.2f} GiB)"))
    return findings


def weights_size(settings, profile: Profile) -> int:
    total = 0
    for _name, slot in profile.models:
        if slot is not None:
            directory = Path(settings.models_dir) / slot.dir
            if directory.is_dir():
                total += directory_size(directory)
    return total


def _cmd_doctor(args: argparse.Namespace) -> int:
    from entrypoint.settings import load_settings, load_settings_profile

    settings = load_settings(profile=args.profile)
    profile = load_settings_profile(settings)
    findings = diagnose(
        profile,
        cuda_visible_devices=settings.cuda_visible_devices,
        cache_dir=settings.cache_dir,
        weights_bytes=weights_size(settings, profile),
    )
    for finding in findings:
        print(finding.line())
    blockers = [f for f in findings if f.level == "blocker"]
    if blockers and not args.warn_only:
        raise StackError(f"{len(blockers)} blocker(s) for profile {profile.name}: {blockers[0].detail}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this machine for a profile (GPU, driver, CUDA, memory, other processes, JIT toolchain, cache)",
    )
    parser.add_argument("--profile", help="profile to check for (default: the PROFILE setting)")
    parser.add_argument("--warn-only", action="store_true", help="report blockers without failing (image start)")
    parser.set_defaults(func=_cmd_doctor)
