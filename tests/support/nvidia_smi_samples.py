"""``nvidia-smi topo -m`` and ``topo -p2p r`` answers in the formats drivers print them.

Typed here in the layouts public bug reports show for real machines (tabs between cells and a
space around ``X`` in current drivers; space-aligned columns with only "CPU Affinity" in older
ones; NIC columns and a "NIC Legend" where RDMA devices sit on the PCIe tree; ``mlx5_N``
column names in older drivers). The device names and affinities are examples, not any one
machine's.
"""

from __future__ import annotations

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# Two RTX 3090s in two CPU-attached slots of a consumer board: they meet at the host bridge.
PCIE_PAIR = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tPHB\t0-31\t0\t\tN/A\n"
    "GPU1\tPHB\t X \t0-31\t0\t\tN/A\n" + LEGEND
)

# The same pair with an NVLink bridge (a 3090 bridge bonds four links).
NVLINK_PAIR = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV4\t0-23\t0\t\tN/A\n"
    "GPU1\tNV4\t X \t0-23\t0\t\tN/A\n" + LEGEND
)

# Three cards: 0 and 1 bridged, 2 behind the chipset on another root port.
BRIDGED_AND_ONE_MORE = (
    "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV4\tPHB\t0-15\t0\t\tN/A\n"
    "GPU1\tNV4\t X \tPHB\t0-15\t0\t\tN/A\n"
    "GPU2\tPHB\tPHB\t X \t0-15\t0\t\tN/A\n" + LEGEND
)

# An older driver: space-aligned, no NUMA columns, a two-socket server.
OLD_DRIVER_FOUR_GPUS = """        GPU0    GPU1    GPU2    GPU3    CPU Affinity
GPU0     X      SYS     SYS     SYS     0-15,32-47
GPU1    SYS      X      NODE    NODE    16-31,48-63
GPU2    SYS     NODE     X      NODE    16-31,48-63
GPU3    SYS     NODE    NODE     X      16-31,48-63
""" + LEGEND

# Eight NVLink GPUs with RDMA NICs as columns and rows, and the NIC legend after the matrix.
EIGHT_NVLINK_WITH_NICS = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    + "".join(
        f"GPU{i}\t" + "\t".join(" X " if j == i else "NV18" for j in range(8))
        + ("\tPIX\tSYS\t0-79\t0\t\tN/A\n" if i < 4 else "\tSYS\tPIX\t80-159\t1\t\tN/A\n")
        for i in range(8)
    )
    + "NIC0\tPIX\tPIX\tPIX\tPIX\tSYS\tSYS\tSYS\tSYS\t X \tSYS\n"
    + "NIC1\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tPIX\tPIX\tSYS\t X \n"
    + LEGEND
    + "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n"
)

# An older driver naming the RDMA devices as columns (mlx5_N), two PCIe switches.
OLD_DRIVER_MLX_COLUMNS = """        GPU0    GPU1    mlx5_0  mlx5_1  CPU Affinity
GPU0     X      PIX     PIX     PXB     0-23,48-71
GPU1    PIX      X      PIX     PXB     0-23,48-71
mlx5_0  PIX     PIX      X      PXB
mlx5_1  PXB     PXB     PXB      X
""" + LEGEND

# One GPU and the RDMA ports of its host, as on a DGX Spark (ConnectX-7: four RoCE functions).
ONE_GPU_WITH_NICS = (
    "\tGPU0\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNODE\tNODE\tNODE\tNODE\t0-19\t0\t\tN/A\n"
    "NIC0\tNODE\t X \tPIX\tNODE\tNODE\n"
    "NIC1\tNODE\tPIX\t X \tNODE\tNODE\n"
    "NIC2\tNODE\tNODE\tNODE\t X \tPIX\n"
    "NIC3\tNODE\tNODE\tNODE\tPIX\t X \n"
    + LEGEND
    + "\nNIC Legend:\n\n  NIC0: rocep1s0f0\n  NIC1: rocep1s0f1\n  NIC2: roceP2p1s0f0\n  NIC3: roceP2p1s0f1\n"
)

P2P_LEGEND = """
Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  U    = Unknown
"""

# `nvidia-smi topo -p2p r`: GeForce cards on the stock driver (no PCIe peer access) ...
P2P_NOT_SUPPORTED = " \tGPU0\tGPU1\t\n GPU0\tX\tCNS\t\n GPU1\tCNS\tX\t\n" + P2P_LEGEND
# ... and with a P2P-patched driver, which grants it.
P2P_GRANTED = " \tGPU0\tGPU1\t\n GPU0\tX\tOK\t\n GPU1\tOK\tX\t\n" + P2P_LEGEND
