"""The CUDA JIT toolchain laid out from the wheel tree, and the checks that find what is missing.

The real proof (the image's nvcc building FlashInfer's sampling kernels) is
tests/container/test_image_rtx3090.py; here: the layout rules, the files they write, the
resolution order FlashInfer uses, and each missing piece named.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.errors import ToolchainError
from entrypoint.toolchain import Link, check_toolchain, jit_cuda_home, link_toolkit, nvcc_release, toolkit_links
from tests.conftest import run_cli
from tests.support.cuda_wheels import DRIVER_DIR, NVCC_13_0, cuda_wheel_tree


def test_every_library_gets_its_unversioned_name_and_the_driver_gets_a_stub_link():
    links = toolkit_links(
        Path("/opt/venv/cuda"),
        Path("/opt/venv/lib/python3.12/site-packages/nvidia/cu13"),
        ["libcudart.so.13", "libcudadevrt.a", "libnvvm.so.4", "libcublasLt.so.13", "libfoo.so", "libfoo.so.1"],
        DRIVER_DIR,
    )
    by_path = {link.path: link.target for link in links}
    assert by_path["bin"] == "../lib/python3.12/site-packages/nvidia/cu13/bin"
    assert by_path["include"] == "../lib/python3.12/site-packages/nvidia/cu13/include"
    assert by_path["lib64/libcudart.so.13"] == "../../lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    assert by_path["lib64/libcudart.so"] == "libcudart.so.13"
    assert by_path["lib64/libcublasLt.so"] == "libcublasLt.so.13"
    assert by_path["lib64/libnvvm.so"] == "libnvvm.so.4"
    # A library the tree already ships unversioned keeps its own file; a static one gets no alias.
    assert by_path["lib64/libfoo.so"].endswith("/nvidia/cu13/lib/libfoo.so")
    assert "lib64/libcudadevrt" not in by_path
    assert by_path["lib64/stubs/libcuda.so"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert len(by_path) == len(links)
    assert all(isinstance(link, Link) for link in links)


def test_the_toolkit_resolves_into_the_wheel_tree_and_survives_copying_the_venv(tmp_path):
    venv = tmp_path / "venv"
    tree = cuda_wheel_tree(venv)
    link_toolkit(venv / "cuda", tree, DRIVER_DIR)
    assert (venv / "cuda" / "bin" / "nvcc").resolve() == (tree / "bin" / "nvcc").resolve()
    assert (venv / "cuda" / "include" / "curand_kernel.h").read_text() == "include/curand_kernel.h"
    assert (venv / "cuda" / "lib64" / "libcudart.so").read_text() == "libcudart.so.13"
    # The image copies /opt/venv from the builder stage whole: relative links keep working.
    copied = tmp_path / "elsewhere"
    shutil.copytree(venv, copied, symlinks=True)
    assert (copied / "cuda" / "lib64" / "libcurand.so").resolve() == (copied / tree.relative_to(venv) / "lib" /
                                                                     "libcurand.so.10").resolve()
    assert (copied / "cuda" / "lib64" / "stubs" / "libcuda.so").readlink() == DRIVER_DIR / "libcuda.so.1"


def test_relinking_replaces_the_old_toolkit_whole(tmp_path):
    tree = cuda_wheel_tree(tmp_path)
    home = tmp_path / "cuda"
    link_toolkit(home, tree, DRIVER_DIR)
    (home / "lib64" / "left-over").write_text("from an older layout")
    (tree / "lib" / "libcudart.so.13").unlink()
    (tree / "lib" / "libcudart.so.14").write_text("newer")
    link_toolkit(home, tree, DRIVER_DIR)
    assert sorted(p.name for p in (home / "lib64").iterdir()) == [
        "libcudadevrt.a", "libcudart.so", "libcudart.so.14", "libcurand.so", "libcurand.so.10", "stubs"]
    assert not list(tmp_path.glob(".cuda.incomplete*"))


def test_an_environment_without_the_toolchain_wheels_is_refused_with_what_is_missing(tmp_path):
    with pytest.raises(ToolchainError, match=r"no bin, include, nvvm, lib directory; the CUDA toolchain wheels"):
        link_toolkit(tmp_path / "cuda", tmp_path / "nvidia" / "cu13", DRIVER_DIR)
    assert not (tmp_path / "cuda").exists()
    result = run_cli("toolchain", "link", "--cuda-home", str(tmp_path / "cuda"), "--tree", str(tmp_path / "none"))
    assert result.returncode == 2 and result.stderr.startswith("qwen38: toolchain: ")
    assert "nvidia-cuda-nvcc" in result.stderr and not result.stdout


def test_the_cuda_home_is_found_the_way_flashinfer_finds_it():
    def which(name: str) -> str | None:
        return "/opt/venv/cuda/bin/nvcc" if name == "nvcc" else None

    assert jit_cuda_home({"CUDA_HOME": "/a", "CUDA_PATH": "/b"}, which) == Path("/a")
    assert jit_cuda_home({"CUDA_PATH": "/b"}, which) == Path("/b")
    assert jit_cuda_home({}, which) == Path("/opt/venv/cuda")
    assert jit_cuda_home({}, lambda name: None) == Path("/usr/local/cuda")


def test_a_complete_toolkit_passes_every_check(tmp_path):
    home = tmp_path / "cuda"
    link_toolkit(home, cuda_wheel_tree(tmp_path), DRIVER_DIR)
    include = tmp_path / "python"
    include.mkdir()
    (include / "Python.h").write_text("")

    def run(argv: list[str]) -> str | None:
        return {str(home / "bin" / "nvcc"): NVCC_13_0, "gcc": "gcc (Ubuntu 13.3.0) 13.3.0\n",
                "c++": "c++ (Ubuntu 13.3.0) 13.3.0\n", "ninja": "1.13.2\n"}.get(argv[0])

    checks = check_toolchain(home, torch_cuda="13.0", run=run, python_include=include, cc="gcc", cxx="c++")
    assert [(c.name, c.ok) for c in checks] == [
        ("nvcc", True), ("cuda headers", True), ("curand", True), ("cudart", True), ("c compiler", True),
        ("c++ compiler", True), ("python headers", True), ("ninja", True)]
    assert checks[0].detail == f"{home}/bin/nvcc (CUDA 13.0)"
    assert checks[5].detail == "c++ (Ubuntu 13.3.0) 13.3.0"


def test_each_missing_piece_is_named_with_what_a_jit_build_loses(tmp_path):
    checks = {c.name: c for c in check_toolchain(tmp_path, torch_cuda="13.0", run=lambda argv: None,
                                                   python_include=tmp_path, cc="gcc-none", cxx="g++-none")}
    assert not any(c.ok for c in checks.values())
    assert checks["nvcc"].detail == f"{tmp_path}/bin/nvcc is missing or does not run"
    assert "~5 % slower" in checks["curand"].consequence
    assert checks["cudart"].detail == f"{tmp_path}/lib64/libcudart.so is missing"
    assert checks["c compiler"].detail == "gcc-none is missing or does not run"
    assert "Triton" in checks["c compiler"].consequence
    assert checks["c++ compiler"].detail == "g++-none is missing or does not run"
    assert checks["python headers"].detail == f"{tmp_path}/Python.h is missing"


def test_an_nvcc_of_another_cuda_release_than_torch_fails_the_check(tmp_path):
    home = tmp_path / "cuda"
    link_toolkit(home, cuda_wheel_tree(tmp_path), DRIVER_DIR)
    older = "Cuda compilation tools, release 12.8, V12.8.93\n"
    (nvcc,) = [c for c in check_toolchain(home, torch_cuda="13.0", run=lambda argv: older) if c.name == "nvcc"]
    assert not nvcc.ok and nvcc.detail.endswith("is CUDA 12.8, torch is built for CUDA 13.0")
    assert nvcc_release(NVCC_13_0) == "13.0" and nvcc_release("no version here") is None


def test_the_check_command_fails_with_one_line_naming_the_first_missing_piece(tmp_path):
    result = run_cli("toolchain", "check", "--cuda-home", str(tmp_path))
    assert result.returncode == 2
    assert f"MISSING nvcc           {tmp_path}/bin/nvcc is missing or does not run" in result.stdout
    assert result.stderr.startswith("qwen38: toolchain: ") and len(result.stderr.strip().splitlines()) == 1
    assert f"missing under {tmp_path}: nvcc:" in result.stderr
