"""`qwen38 doctor`: one line per check, blockers are what stops a start."""

from __future__ import annotations

from pathlib import Path

from entrypoint.doctor import GIB, diagnose, parse_gpus, parse_processes
from entrypoint.profiles import load_profile
from entrypoint.toolchain import link_toolkit
from tests.conftest import clean_env, run_cli
from tests.support.cuda_wheels import DRIVER_DIR, NVCC_13_0, cuda_wheel_tree

SMI_3090 = "0, NVIDIA GeForce RTX 3090, 580.95.05, 24576, 23900, 8.6\n"
SMI_BUSY = "0, NVIDIA GeForce RTX 3090, 580.95.05, 24576, 2100, 8.6\n"
TOOLCHAIN = ("nvcc", "cuda headers", "curand", "cudart", "c compiler", "c++ compiler", "python headers", "ninja")


def fake_nvidia_smi(gpus: str, apps: str = ""):
    """nvidia-smi of a machine with ``gpus``; nvcc, the host compiler and ninja answer too."""
    def run(argv: list[str]) -> str | None:
        if argv[0].endswith("/bin/nvcc"):
            return NVCC_13_0
        if argv[0] in ("gcc", "c++", "ninja"):
            return f"{argv[0]} 13.3.0\n"
        if argv[0] != "nvidia-smi":
            return None
        return apps if any(a.startswith("--query-compute-apps") for a in argv) else gpus

    return run


def toolkit(root: Path, curand: bool = True) -> Path:
    tree = cuda_wheel_tree(root)
    if not curand:
        (tree / "include" / "curand_kernel.h").unlink()
    link_toolkit(root / "cuda", tree, DRIVER_DIR)
    return root / "cuda"


def levels(findings) -> dict[str, str]:
    return {f.check: f.level for f in findings}


def test_parsers_read_nvidia_smi_csv():
    (gpu,) = parse_gpus(SMI_3090)
    assert (gpu.index, gpu.total_mib, gpu.free_mib, gpu.compute_cap) == (0, 24576, 23900, "8.6")
    assert parse_processes("4242, llama-server, 22210\n")[0].used_mib == 22210


def test_a_free_3090_is_ready_for_single(tmp_path):
    findings = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path / "cache",
                        weights_bytes=15 * GIB, run=fake_nvidia_smi(SMI_3090), cuda_home=toolkit(tmp_path),
                        cuda_runtime="13.0")
    assert levels(findings) == {"gpu": "ok", "driver": "ok", "memory": "ok", "processes": "ok", "cuda": "ok",
                                **{name: "ok" for name in TOOLCHAIN}, "compile cache": "info"}


def test_a_stray_process_and_missing_curand_are_named(tmp_path):
    findings = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=16 * GIB,
                        run=fake_nvidia_smi(SMI_BUSY, "4242, llama-server, 22210\n"),
                        cuda_home=toolkit(tmp_path, curand=False), cuda_runtime="13.0")
    by = {f.check: f for f in findings}
    assert by["memory"].level == "blocker" and "2.1 GiB free" in by["memory"].detail
    tight = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=18 * GIB,
                     run=fake_nvidia_smi(SMI_3090), cuda_home=tmp_path / "cuda", cuda_runtime="13.0")
    assert levels(tight)["memory"] == "warn"
    assert by["processes"].level == "warn" and "llama-server (pid 4242, 22210 MiB)" in by["processes"].detail
    assert by["curand"].level == "warn" and "~5 % slower" in by["curand"].detail
    assert "curand_kernel.h is missing" in by["curand"].detail and "`qwen38 toolchain check`" in by["curand"].detail


def test_without_a_c_compiler_triton_cannot_run_and_that_is_a_blocker(tmp_path):
    smi = fake_nvidia_smi(SMI_3090)

    def no_compilers(argv: list[str]) -> str | None:
        return None if argv[0] in ("gcc", "c++") else smi(argv)

    findings = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=0,
                        run=no_compilers, cuda_home=toolkit(tmp_path), cuda_runtime="13.0")
    by = {f.check: f for f in findings}
    assert by["c compiler"].level == "blocker" and "Triton" in by["c compiler"].detail
    assert by["c++ compiler"].level == "warn" and "FlashInfer" in by["c++ compiler"].detail
    assert by["nvcc"].level == "ok"


def test_the_spark_profile_on_a_3090_warns_about_the_arch(tmp_path):
    findings = diagnose(load_profile("spark-lora"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=0,
                        run=fake_nvidia_smi(SMI_3090), cuda_home=toolkit(tmp_path), cuda_runtime="13.0")
    assert levels(findings)["arch"] == "warn"


def test_no_gpu_is_a_blocker_with_a_nonzero_exit_and_warn_only_reports_it():
    result = run_cli("doctor", "--profile", "single", env=clean_env(PATH="/nonexistent"))
    assert result.returncode == 2
    assert "BLOCKER gpu" in result.stdout and "no NVIDIA GPU" in result.stdout
    assert result.stderr.startswith("qwen38: error: ")
    warn_only = run_cli("doctor", "--profile", "single", "--warn-only", env=clean_env(PATH="/nonexistent"))
    assert warn_only.returncode == 0 and "BLOCKER gpu" in warn_only.stdout


def test_the_cpu_profile_needs_no_gpu(tmp_path):
    result = run_cli("doctor", "--profile", "cpu", env=clean_env(CACHE_DIR=str(tmp_path)))
    assert result.returncode == 0
    assert result.stdout.strip().startswith("INFO    compile cache")
    assert Path(tmp_path).exists()
