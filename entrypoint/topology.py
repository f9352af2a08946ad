"""How the GPUs of one host are linked, read from ``nvidia-smi topo -m``.

A one-host multi-GPU profile (`dual`) splits every layer over its GPUs, and after every layer
they sum their halves (an all-reduce). How safely and how fast that runs depends on the link:
NVLink (``NV#`` in the matrix) carries peer-to-peer traffic natively; everything else
(``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``) is PCIe, where a GeForce card has no
peer-to-peer access on NVIDIA's stock driver and only a patched driver grants it.
`entrypoint.resolve` turns the link into the all-reduce defaults (docs/dual.md says why).

`parse_topology` and `link_between` are pure and read every format the matrix has been
printed in (tab- or space-separated; with or without NIC columns and the NUMA columns);
`read_link` runs nvidia-smi through a `Runner` (I/O at the edge).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from entrypoint.toolchain import Runner

LinkKind = Literal["nvlink", "pcie"]

# nvidia-smi's legend, shortened: what each code of the matrix means.
PCIE_CODES = {
    "PIX": "PCIe through at most one PCIe bridge",
    "PXB": "PCIe through several PCIe bridges",
    "PHB": "PCIe through the CPU's host bridge",
    "NODE": "PCIe across host bridges of one NUMA node",
    "SYS": "PCIe across NUMA nodes (the CPUs' interconnect)",
    "SOC": "PCIe across CPU sockets",  # older drivers' name for SYS
}
_NVLINK = re.compile(r"NV(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU_ROW = re.compile(r"GPU\d+")


class TopologyError(ValueError):
    """Text that is not an ``nvidia-smi topo -m`` matrix, or lacks a GPU asked for."""


@dataclass(frozen=True)
class Topology:
    """The matrix: its column names (GPUs, then NICs) and each GPU row's cells."""

    columns: tuple[str, ...]
    rows: dict[str, tuple[str, ...]]

    @property
    def gpus(self) -> list[int]:
        return [int(name[3:]) for name in self.rows]

    def code(self, a: int, b: int) -> str:
        """The matrix cell between GPU ``a`` and GPU ``b`` (``X`` for a GPU and itself)."""
        row, column = f"GPU{a}", f"GPU{b}"
        if row not in self.rows or column not in self.columns:
            raise TopologyError(f"nvidia-smi topo -m lists no GPU{a if row not in self.rows else b}")
        return self.rows[row][self.columns.index(column)]


def parse_topology(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m``: the header names the columns up to "CPU Affinity"."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header: tuple[str, ...] | None = None
    rows: dict[str, tuple[str, ...]] = {}
    for line in lines:
        cells = line.split()
        if not cells:
            continue
        if cells[0].startswith("Legend"):
            break
        if header is None:
            # The header row starts with an empty cell, then GPU0 (GPU0's own row has X next).
            if cells[0] == "GPU0" and cells[1:2] != ["X"]:
                header = tuple(cells[: cells.index("CPU")] if "CPU" in cells else cells)
            continue
        if _GPU_ROW.fullmatch(cells[0]):
            values = tuple(cells[1 : 1 + len(header)])
            if len(values) < len(header):
                raise TopologyError(f"nvidia-smi topo -m: row {cells[0]} has {len(values)} of {len(header)} cells")
            rows[cells[0]] = values
    if header is None or not rows:
        raise TopologyError("not an nvidia-smi topo -m matrix (no GPU0 header row)")
    return Topology(header, rows)


def link_kind(code: str) -> LinkKind | None:
    """NVLink or PCIe for a matrix code; None for one this reader does not know."""
    if _NVLINK.fullmatch(code):
        return "nvlink"
    return "pcie" if code in PCIE_CODES else None


def describe(code: str) -> str:
    nvlink = _NVLINK.fullmatch(code)
    if nvlink:
        links = int(nvlink[1])
        return f"NVLink ({links} bonded link{'s' if links != 1 else ''})"
    return PCIE_CODES.get(code, f"unknown link code {code!r}")


@dataclass(frozen=True)
class LinkReading:
    """The link between the GPUs a profile uses, as the matrix reports it."""

    kind: LinkKind
    pairs: tuple[tuple[int, int, str], ...]  # (GPU, GPU, code) for every pair

    def summary(self) -> str:
        return "; ".join(f"GPU{a} <-> GPU{b}: {code} = {describe(code)}" for a, b, code in self.pairs)


def link_between(topology: Topology, gpus: list[int]) -> LinkReading:
    """NVLink only when every pair of ``gpus`` is on NVLink; PCIe when any pair is not."""
    pairs = tuple((a, b, topology.code(a, b)) for i, a in enumerate(gpus) for b in gpus[i + 1 :])
    kinds = {link_kind(code) for _a, _b, code in pairs}
    if None in kinds:
        unknown = next(code for _a, _b, code in pairs if link_kind(code) is None)
        raise TopologyError(f"nvidia-smi topo -m: unknown link code {unknown!r}")
    return LinkReading("nvlink" if kinds == {"nvlink"} else "pcie", pairs)


def gpu_indices(devices: str, uuids: dict[str, int]) -> list[int]:
    """CUDA_VISIBLE_DEVICES entries as nvidia-smi indices (``uuids`` maps GPU-UUIDs to them)."""
    out = []
    for entry in devices.split(","):
        if entry.isdigit():
            out.append(int(entry))
        elif entry in uuids:
            out.append(uuids[entry])
        else:
            raise TopologyError(f"CUDA_VISIBLE_DEVICES names {entry}, which nvidia-smi does not list")
    return out


def read_topology(run: Runner) -> Topology | None:
    """``nvidia-smi topo -m`` on this host; None where nvidia-smi is missing or fails."""
    text = run(["nvidia-smi", "topo", "-m"])
    return None if text is None else parse_topology(text)


def read_link(devices: str, run: Runner) -> LinkReading | None:
    """The link between the GPUs ``devices`` names (CUDA_VISIBLE_DEVICES) on this host.

    None where nvidia-smi is missing or fails; `TopologyError` where its answer cannot be read."""
    topology = read_topology(run)
    if topology is None:
        return None
    uuids: dict[str, int] = {}
    if not all(entry.isdigit() for entry in devices.split(",")):
        listing = run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]) or ""
        for line in listing.strip().splitlines():
            index, _, uuid = (cell.strip() for cell in line.partition(","))
            if index.isdigit():
                uuids[uuid] = int(index)
    return link_between(topology, gpu_indices(devices, uuids))
