"""`qwen38 doctor`: one line per check, blockers are what stops a start."""

from __future__ import annotations

from pathlib import Path

from entrypoint.doctor import GIB, diagnose, parse_gpus, parse_processes
from entrypoint.profiles import load_profile
from tests.conftest import clean_env, run_cli

SMI_3090 = "0, NVIDIA GeForce RTX 3090, 580.95.05, 24576, 23900, 8.6\n"
SMI_BUSY = "0, NVIDIA GeForce RTX 3090, 580.95.05, 24576, 2100, 8.6\n"


def fake_nvidia_smi(gpus: str, apps: str = ""):
    def run(argv: list[str]) -> str | None:
        if argv[0] != "nvidia-smi":
            return None
        return apps if any(a.startswith("--query-compute-apps") for a in argv) else gpus

    return run


def levels(findings) -> dict[str, str]:
    return {f.check: f.level for f in findings}


def test_parsers_read_nvidia_smi_csv():
    (gpu,) = parse_gpus(SMI_3090)
    assert (gpu.index, gpu.total_mib, gpu.free_mib, gpu.compute_cap) == (0, 24576, 23900, "8.6")
    assert parse_processes("4242, llama-server, 22210\n")[0].used_mib == 22210


def test_a_free_3090_is_ready_for_single(tmp_path):
    header_dir = tmp_path / "include"
    header_dir.mkdir()
    (header_dir / "curand.h").write_text("/* curand */")
    findings = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path / "cache",
                        weights_bytes=15 * GIB, run=fake_nvidia_smi(SMI_3090), include_dirs=[header_dir],
                        cuda_runtime="13.0")
    assert levels(findings) == {"gpu": "ok", "driver": "ok", "memory": "ok", "processes": "ok", "cuda": "ok",
                                "curand": "ok", "compile cache": "info"}


def test_a_stray_process_and_missing_curand_are_named(tmp_path):
    findings = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=16 * GIB,
                        run=fake_nvidia_smi(SMI_BUSY, "4242, llama-server, 22210\n"), include_dirs=[tmp_path],
                        cuda_runtime="13.0")
    by = {f.check: f for f in findings}
    assert by["memory"].level == "blocker" and "2.1 GiB free" in by["memory"].detail
    tight = diagnose(load_profile("single"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=18 * GIB,
                     run=fake_nvidia_smi(SMI_3090), include_dirs=[], cuda_runtime="13.0")
    assert levels(tight)["memory"] == "warn"
    assert by["processes"].level == "warn" and "llama-server (pid 4242, 22210 MiB)" in by["processes"].detail
    assert by["curand"].level == "warn" and "~5 % slower" in by["curand"].detail


def test_the_spark_profile_on_a_3090_warns_about_the_arch(tmp_path):
    findings = diagnose(load_profile("spark-lora"), cuda_visible_devices="0", cache_dir=tmp_path, weights_bytes=0,
                        run=fake_nvidia_smi(SMI_3090), include_dirs=[], cuda_runtime="13.0")
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
