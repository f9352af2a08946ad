"""The `cpu` profile split by vLLM's own tensor parallelism, for a real multi-process run here.

vLLM's CPU build runs tensor parallelism with the same multiprocessing executor as on GPUs
(one worker process per rank, gloo instead of NCCL), in one host or across hosts (``--nnodes``,
the head and a headless worker). The tiny target splits evenly in two (2 KV heads, 2/4 GDN
key/value heads), so the copies here are the `cpu` profile with a ``[parallel]`` section:
exactly what `dual` (one host) and `spark-pair` (two hosts) add to their one-GPU siblings.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from core.profiles import PROFILES_DIR


def tensor_parallel_profiles(directory: Path) -> Path:
    """``directory`` with the repository's profiles plus `cpu-tp2` (2 workers, one host) and
    `cpu-pair` (2 hosts of 1 worker each)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in PROFILES_DIR.glob("*.toml"):
        shutil.copy(path, directory)
    cpu = (PROFILES_DIR / "cpu.toml").read_text()
    assert cpu.count("\n[engine]\n") == 1
    for name, section in (("cpu-tp2", "tensor_parallel_size = 2"), ("cpu-pair", "tensor_parallel_size = 2\nnodes = 2")):
        (directory / f"{name}.toml").write_text(cpu.replace("\n[engine]\n", f"\n[parallel]\n{section}\n\n[engine]\n"))
    return directory


# OpenMP threads per worker (vLLM's CPU workers bind to cores: each rank one of its own).
ONE_HOST_CORES = "0|1"
HEAD_CORES, WORKER_CORES = "0", "1"
