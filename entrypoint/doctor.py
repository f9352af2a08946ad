"""`qwen38 doctor`: is this machine ready for a profile? One line per check.

Checks, for GPU profiles: the NVIDIA driver and GPU (nvidia-smi), the CUDA runtime torch
was built for, free GPU memory against what the profile will take (its pinned KV pool
plus its weights; with tensor parallelism on each GPU: the pool is per GPU, the weights
split), other processes holding GPU memory (the Spark article lost a day to a
stray llama-server holding 21.7 GiB), and the CUDA JIT toolchain where FlashInfer looks for
it (`entrypoint.toolchain`: nvcc, the CUDA and curand headers - without curand's,
FlashInfer's sampling kernels fail to build and vLLM silently falls back, ~5 % slower on the
3090 - cudart, C and C++ compilers, Python's headers, ninja). For a one-host multi-GPU
profile (`dual`): every GPU it names, the link between them (`nvidia-smi topo -m`) and the
all-reduce defaults that link picks, the driver's peer-access report (`topo -p2p r`), and
PyTorch's expandable segments, which vLLM's custom all-reduce cannot share. For a multi-host
profile (`spark-pair`): this host's GPU, the link's knobs, its interface and address, and the
RDMA devices NCCL is told to use. For every profile: the compile-cache location and size.

A blocker exits non-zero; warnings do not. The image runs it before launch with
``--warn-only`` (it reports, never stops the start), and users run it on demand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from core.errors import StackError
from core.profiles import Profile
from entrypoint.launch import check_allocator, check_multi_host
from entrypoint.toolchain import Runner, check_toolchain, jit_cuda_home, run_command, torch_cuda_version
from entrypoint.topology import TopologyError, link_between, parse_topology, read_topology

if TYPE_CHECKING:
    from entrypoint.resolved_engine import ResolvedEngine

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
    total_mib: int | None  # None: nvidia-smi reports none (e.g. "[N/A]" for unified memory)
    free_mib: int | None
    compute_cap: str
    uuid: str = ""


def _mib(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def parse_gpus(csv: str) -> list[GpuInfo]:
    gpus = []
    for line in csv.strip().splitlines():
        index, name, driver, total, free, cap, *uuid = (f.strip() for f in line.split(","))
        gpus.append(GpuInfo(int(index), name, driver, _mib(total), _mib(free), cap, uuid[0] if uuid else ""))
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
        ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.free,compute_cap,uuid",
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


def memory_finding(
    profile: Profile, gpu: GpuInfo, weights_bytes: int, pool_bytes: int | None = None, check: str = "memory"
) -> Finding:
    """Free memory against the profile: KV pool (exact) + weights as stored + runtime. With
    tensor parallelism, per GPU: the pool is each GPU's, the weights split over the GPUs."""
    kv = (profile.engine.kv_cache_memory_bytes or 0) if pool_bytes is None else pool_bytes
    split = profile.parallel.tensor_parallel_size
    weights = weights_bytes // split
    need = kv + weights + RUNTIME_OVERHEAD_BYTES
    if gpu.free_mib is None:
        return Finding("info", check, f"nvidia-smi reports no free memory for GPU {gpu.index}; profile "
                       f"{profile.name} takes up to {need / GIB:.1f} GiB there")
    free = gpu.free_mib << 20
    share = f"weights as stored {weights / GIB:.1f}"
    if split > 1:
        share += f" (1/{split} of {weights_bytes / GIB:.1f})"
    detail = (
        f"{free / GIB:.1f} GiB free on GPU {gpu.index}; profile {profile.name} takes up to {need / GIB:.1f} GiB "
        f"(KV pool {kv / GIB:.1f} + {share} + runtime {RUNTIME_OVERHEAD_BYTES / GIB:.1f})"
    )
    if free >= need:
        return Finding("ok", check, detail)
    if free >= kv + weights // 2:
        return Finding("warn", check, detail + "; tight: it may still fit, the weights figure is an upper bound")
    return Finding("blocker", check, detail)


def diagnose(
    profile: Profile,
    resolved: ResolvedEngine,
    *,
    cache_dir: Path,
    weights_bytes: int,
    run: Runner = run_command,
    cuda_home: Path | None = None,
    cuda_runtime: str | None = None,
    environ: Mapping[str, str] | None = None,
    sys_root: Path = Path("/"),
) -> list[Finding]:
    """Every check for ``profile`` on this machine (I/O through ``run`` and the paths).

    ``resolved`` is the engine as the settings resolve it on this host (its GPUs, pool and
    parallelism: `entrypoint.resolve.resolve_on_this_host`); ``environ`` the environment the
    engine inherits (default: this process's)."""
    environ = os.environ if environ is None else environ
    findings: list[Finding] = []
    if profile.platform == "cuda":
        gpus = query_gpus(run)
        if not gpus:
            findings.append(Finding("blocker", "gpu", "no NVIDIA GPU or driver: nvidia-smi is missing or failed"))
        elif resolved.parallel is not None and resolved.parallel.nodes == 1:
            findings += _gpus_of_one_host(profile, resolved, gpus, weights_bytes, run, environ)
        else:
            wanted = (resolved.devices or "0").split(",")[0]
            gpu = next((g for g in gpus if wanted in (str(g.index), g.uuid)), gpus[0])
            findings.append(Finding("ok", "gpu", f"{gpu.index}: {gpu.name}, compute capability {gpu.compute_cap}"))
            findings.append(Finding("ok", "driver", f"NVIDIA driver {gpu.driver}"))
            findings += _arch(profile, gpu, "arch")
            findings.append(memory_finding(profile, gpu, weights_bytes, resolved.kv_cache_memory_bytes))
            findings.append(_processes(run))
        if resolved.parallel is not None and resolved.parallel.nodes > 1:
            findings += _hosts_link(resolved, run, sys_root)
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


def _arch(profile: Profile, gpu: GpuInfo, check: str) -> list[Finding]:
    if profile.cuda_arch and gpu.compute_cap != profile.cuda_arch:
        return [Finding("warn", check, f"profile {profile.name} is sized for sm {profile.cuda_arch} "
                        f"({profile.machine}); GPU {gpu.index} is {gpu.compute_cap}")]
    return []


def _processes(run: Runner) -> Finding:
    others = query_processes(run)
    if others:
        held = ", ".join(f"{p.name} (pid {p.pid}, {p.used_mib} MiB)" for p in others)
        return Finding("warn", "processes", f"other processes hold GPU memory: {held}")
    return Finding("ok", "processes", "no other process holds GPU memory")


# `nvidia-smi topo -p2p r`: the driver's answer to "may GPU a read GPU b's memory?".
P2P_STATUS = {
    "OK": "granted",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}


def _gpus_of_one_host(
    profile: Profile, resolved: ResolvedEngine, gpus: list[GpuInfo], weights_bytes: int, run: Runner,
    environ: Mapping[str, str],
) -> list[Finding]:
    """Every GPU a one-host multi-GPU profile splits its layers over, and the link between them."""
    par = resolved.parallel
    assert par is not None and resolved.devices is not None
    named = resolved.devices.split(",")[: par.tensor_parallel_size]
    by_id = {**{str(g.index): g for g in gpus}, **{g.uuid: g for g in gpus if g.uuid}}
    chosen = [by_id.get(entry) for entry in named]
    if None in chosen:
        listed = ", ".join(f"{g.index} ({g.name})" for g in gpus)
        return [Finding("blocker", "gpus", f"profile {profile.name} splits every layer over {len(named)} GPUs "
                        f"(CUDA_VISIBLE_DEVICES={resolved.devices}); nvidia-smi lists {listed}")]
    findings = []
    for gpu in chosen:
        findings.append(Finding("ok", f"gpu{gpu.index}", f"{gpu.name}, compute capability {gpu.compute_cap}, "
                                f"NVIDIA driver {gpu.driver}"))
        findings += _arch(profile, gpu, f"arch gpu{gpu.index}")
        findings.append(memory_finding(profile, gpu, weights_bytes, resolved.kv_cache_memory_bytes,
                                       check=f"memory gpu{gpu.index}"))
    if len({g.name for g in chosen}) > 1:
        findings.append(Finding("warn", "gpus", f"different GPUs ({', '.join(g.name for g in chosen)}): each holds "
                                "an equal share, the slower one sets the pace; the server numbers them in PCI bus "
                                "order (CUDA_DEVICE_ORDER=PCI_BUS_ID), as nvidia-smi does"))
    findings.append(_processes(run))
    indices = [g.index for g in chosen]
    findings += _link_findings(resolved, indices, run)

    try:
        check_allocator(resolved, environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    except StackError as exc:
        findings.append(Finding("blocker", "allocator", str(exc)))
    return findings


def _link_findings(resolved: ResolvedEngine, indices: list[int], run: Runner) -> list[Finding]:
    par = resolved.parallel
    assert par is not None
    choice = (f"custom all-reduce {'on' if par.custom_all_reduce else 'off'}, NCCL P2P "
              f"{'on' if par.nccl_p2p else 'off (NCCL_P2P_DISABLE=1)'}")
    try:
        topology = read_topology(run)
        reading = None if topology is None else link_between(topology, indices)
    except TopologyError as exc:
        reading, problem = None, str(exc)
    else:
        problem = "nvidia-smi topo -m did not answer" if topology is None else ""
    findings = []
    if reading is None:
        findings.append(Finding("warn", "link", f"{problem}; {par.link_origin}: {choice} (docs/dual.md)"))
    elif par.link_origin.startswith("GPU_LINK=") and reading.kind != par.link:
        findings.append(Finding("warn", "link", f"{par.link_origin}, but {reading.summary()}: {choice}; "
                                "set GPU_LINK=auto unless you know better (docs/dual.md)"))
    else:
        origin = par.link_origin if par.link_origin.startswith("GPU_LINK=") else reading.summary()
        findings.append(Finding("ok", "link", f"{origin}: {choice}"))
    if par.custom_all_reduce and par.link == "pcie":
        findings.append(Finding("warn", "all-reduce", "CUSTOM_ALL_REDUCE=true over PCIe: vLLM trusts the driver's "
                                "peer-access report (VLLM_SKIP_P2P_CHECK=1 by default), and patched-P2P drivers are "
                                "reported to return wrong sums or reset the machine; prove the answers "
                                "(`qwen38 validate apis`) or leave it unset"))
    p2p = run(["nvidia-smi", "topo", "-p2p", "r"])
    try:
        matrix = None if p2p is None else parse_topology(p2p)
        codes = [] if matrix is None else [(a, b, matrix.code(a, b)) for i, a in enumerate(indices)
                                           for b in indices[i + 1:]]
    except TopologyError:
        codes = []
    if codes:
        said = "; ".join(f"GPU{a} -> GPU{b}: {P2P_STATUS.get(code, code)}" for a, b, code in codes)
        patched = reading is not None and reading.kind == "pcie" and all(code == "OK" for _a, _b, code in codes)
        note = (" (over PCIe on GeForce cards: a patched driver; the PCIe defaults keep it unused)"
                if patched else "")
        findings.append(Finding("info", "peer access", f"the driver reports {said}{note}"))
    return findings


def _hosts_link(resolved: ResolvedEngine, run: Runner, sys_root: Path) -> list[Finding]:
    """This host's side of a multi-host profile's link: its knobs, interface, address, RDMA devices."""

    par = resolved.parallel
    assert par is not None
    role = f"worker (node rank {par.node_rank})" if par.headless else "head (node rank 0)"
    try:
        check_multi_host(resolved)
    except StackError as exc:
        return [Finding("blocker", "hosts", str(exc))]
    findings = [Finding("ok", "hosts", f"this host is the {role} of {par.nodes}; head {par.head_address}:"
                        f"{par.head_port}, this host {par.node_address} on {par.network_interface}")]
    net = sys_root / "sys" / "class" / "net" / str(par.network_interface)
    if not net.is_dir():
        known = sorted(p.name for p in (sys_root / "sys" / "class" / "net").glob("*"))
        findings.append(Finding("blocker", "interface", f"NETWORK_INTERFACE={par.network_interface}: no such "
                                f"interface here (known: {', '.join(known) or 'none'})"))
        return findings
    state = (net / "operstate").read_text().strip() if (net / "operstate").is_file() else "unknown"
    addresses = _addresses(run, str(par.network_interface))
    level = "ok" if state == "up" else "warn"
    detail = f"{par.network_interface} is {state}"
    if addresses is not None:
        detail += f", addresses {', '.join(addresses) or 'none'}"
        if par.node_address not in addresses:
            level = "blocker"
            detail += f"; NODE_ADDRESS {par.node_address} is not one of them (vLLM would bind to it: set the address "
            detail += "of this interface)"
    findings.append(Finding(level, "interface", detail))
    rdma = sys_root / "sys" / "class" / "infiniband"
    present = sorted(p.name for p in rdma.glob("*")) if rdma.is_dir() else []
    if par.rdma_devices:
        wanted = [name.split(":")[0] for name in par.rdma_devices.lstrip("^=").split(",")]
        absent = [name for name in wanted if name not in present]
        if absent and not par.rdma_devices.startswith("^"):
            findings.append(Finding("warn", "rdma", f"RDMA_DEVICES names {', '.join(absent)}, not present here "
                                    f"(present: {', '.join(present) or 'none'}): NCCL would fall back to TCP sockets"))
        else:
            findings.append(Finding("ok", "rdma", f"RDMA_DEVICES={par.rdma_devices} (present: {', '.join(present)})"))
    else:
        findings.append(Finding("info", "rdma", f"NCCL picks the RDMA devices itself (present: "
                                f"{', '.join(present) or 'none'}; RDMA_DEVICES names them)"))
    return findings


def _addresses(run: Runner, interface: str) -> list[str] | None:
    """The IP addresses of ``interface`` (`ip -j addr`), or None where `ip` cannot say."""
    text = run(["ip", "-j", "addr", "show", "dev", interface])
    try:
        entries = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    if not isinstance(entries, list):
        return None
    return [info["local"] for entry in entries for info in entry.get("addr_info", []) if "local" in info]


def weights_size(settings, profile: Profile, reads_drafter: bool = True) -> int:
    """Bytes of the model directories the engine reads: the drafter's only where the chosen
    speculation drafts with it (``reads_drafter``: False for SPECULATION=mtp or off)."""
    total = 0
    for name, slot in profile.models:
        if slot is not None and (name != "drafter" or reads_drafter):
            directory = Path(settings.models_dir) / slot.dir
            if directory.is_dir():
                total += directory_size(directory)
    return total
