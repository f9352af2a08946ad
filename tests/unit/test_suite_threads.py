"""The session's Pythons run one OpenMP thread each where no GPU is present (tests/conftest.py):
this pytest process's torch, and every child started with its environment (the servers and
engines are such children)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

GPU_HOST = conftest.GPU_DEVICE.exists()


@pytest.mark.skipif(GPU_HOST, reason="on a GPU machine the suite leaves OpenMP's default alone")
def test_this_process_and_its_children_run_the_threads_the_suite_set() -> None:
    import torch

    threads = os.environ["OMP_NUM_THREADS"]  # "1", unless the one who ran pytest set it
    assert torch.get_num_threads() == int(threads)  # set before this process imported torch
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120, check=True)
    assert child.stdout.strip() == threads


def test_a_value_the_user_set_is_kept_and_a_gpu_machine_keeps_the_default(monkeypatch) -> None:
    """`OMP_NUM_THREADS=2 pytest ...` runs two threads per Python, as asked; on a GPU machine
    (one engine, many cores) nothing is set."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    conftest._one_openmp_thread_per_process()
    assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(conftest, "GPU_DEVICE", Path("/nonexistent/nvidia0"))
    conftest._one_openmp_thread_per_process()
    assert os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(conftest, "GPU_DEVICE", Path(__file__))  # a path that exists stands in for the GPU
    conftest._one_openmp_thread_per_process()
    assert "OMP_NUM_THREADS" not in os.environ
