"""`qwen38 doctor`: one line per check, blockers are what stops a start."""

from __future__ import annotations

from pathlib import Path

from core.profiles import load_profile
from entrypoint.doctor import GIB, diagnose, parse_gpus, parse_processes
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


def resolved(name: str, **values):
    """The profile's engine as a user without overrides resolves it."""
    from entrypoint.resolve import resolve
    from tests.support.plans import user_settings

    return resolve(load_profile(name), user_settings(name, **values))


def levels(findings) -> dict[str, str]:
    return {f.check: f.level for f in findings}


def test_parsers_read_nvidia_smi_csv():
    (gpu,) = parse_gpus(SMI_3090)
    assert (gpu.index, gpu.total_mib, gpu.free_mib, gpu.compute_cap) == (0, 24576, 23900, "8.6")
    assert parse_processes("4242, llama-server, 22210\n")[0].used_mib == 22210


def test_a_free_3090_is_ready_for_single(tmp_path):
    findings = diagnose(load_profile("single"), resolved("single"), cache_dir=tmp_path / "cache",
                        weights_bytes=15 * GIB, run=fake_nvidia_smi(SMI_3090), cuda_home=toolkit(tmp_path),
                        cuda_runtime="13.0")
    assert levels(findings) == {"gpu": "ok", "driver": "ok", "memory": "ok", "processes": "ok", "cuda": "ok",
                                **{name: "ok" for name in TOOLCHAIN}, "compile cache": "info"}


def test_a_stray_process_and_missing_curand_are_named(tmp_path):
    findings = diagnose(load_profile("single"), resolved("single"), cache_dir=tmp_path, weights_bytes=16 * GIB,
                        run=fake_nvidia_smi(SMI_BUSY, "4242, llama-server, 22210\n"),
                        cuda_home=toolkit(tmp_path, curand=False), cuda_runtime="13.0")
    by = {f.check: f for f in findings}
    assert by["memory"].level == "blocker" and "2.1 GiB free" in by["memory"].detail
    tight = diagnose(load_profile("single"), resolved("single"), cache_dir=tmp_path, weights_bytes=18 * GIB,
                     run=fake_nvidia_smi(SMI_3090), cuda_home=tmp_path / "cuda", cuda_runtime="13.0")
    assert levels(tight)["memory"] == "warn"
    assert by["processes"].level == "warn" and "llama-server (pid 4242, 22210 MiB)" in by["processes"].detail
    assert by["curand"].level == "warn" and "~5 % slower" in by["curand"].detail
    assert "curand_kernel.h is missing" in by["curand"].detail and "`qwen38 toolchain check`" in by["curand"].detail


def test_without_a_c_compiler_triton_cannot_run_and_that_is_a_blocker(tmp_path):
    smi = fake_nvidia_smi(SMI_3090)

    def no_compilers(argv: list[str]) -> str | None:
        return None if argv[0] in ("gcc", "c++") else smi(argv)

    findings = diagnose(load_profile("single"), resolved("single"), cache_dir=tmp_path, weights_bytes=0,
                        run=no_compilers, cuda_home=toolkit(tmp_path), cuda_runtime="13.0")
    by = {f.check: f for f in findings}
    assert by["c compiler"].level == "blocker" and "Triton" in by["c compiler"].detail
    assert by["c++ compiler"].level == "warn" and "FlashInfer" in by["c++ compiler"].detail
    assert by["nvcc"].level == "ok"


def test_the_spark_profile_on_a_3090_warns_about_the_arch(tmp_path):
    findings = diagnose(load_profile("spark-lora"), resolved("spark-lora"), cache_dir=tmp_path, weights_bytes=0,
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


# ---- two GPUs of one host (`dual`) and two hosts (`spark-pair`) --------------------------------

SMI_TWO_3090 = (
    "0, NVIDIA GeForce RTX 3090, 580.95.05, 24576, 23900, 8.6, GPU-aaaa\n"
    "1, NVIDIA GeForce RTX 3090, 580.95.05, 24576, 23800, 8.6, GPU-bbbb\n"
)


def two_gpu_smi(gpus: str, topo: str | None, p2p: str | None = None):
    """nvidia-smi of a two-GPU host whose `topo -m` prints ``topo`` (None: it fails)."""
    base = fake_nvidia_smi(gpus)

    def run(argv: list[str]) -> str | None:
        if argv[:3] == ["nvidia-smi", "topo", "-m"]:
            return topo
        if argv[:3] == ["nvidia-smi", "topo", "-p2p"]:
            return p2p
        return base(argv)

    return run


def dual_findings(tmp_path, run, environ=None, **values):
    """`qwen38 doctor --profile dual` on a host whose nvidia-smi is ``run``: the engine resolved
    as the CLI resolves it (the link read from that nvidia-smi), then diagnosed."""
    import tempfile

    from entrypoint.resolve import resolve_on_this_host
    from tests.support.plans import user_settings

    profile = load_profile("dual")
    settings = user_settings("dual", **values)
    engine = resolve_on_this_host(profile, settings, run)
    home = toolkit(Path(tempfile.mkdtemp(dir=tmp_path)))
    return {f.check: f for f in diagnose(profile, engine, cache_dir=tmp_path, weights_bytes=18 * GIB, run=run,
                                         cuda_home=home, cuda_runtime="13.0", environ=environ or {})}


def test_dual_checks_both_gpus_against_their_share_and_the_pcie_link(tmp_path):
    from tests.support import nvidia_smi_samples as smi

    by = dual_findings(tmp_path, two_gpu_smi(SMI_TWO_3090, smi.PCIE_PAIR, smi.P2P_NOT_SUPPORTED))
    assert by["gpu0"].level == by["gpu1"].level == "ok"
    for index, free in ((0, "23.3"), (1, "23.2")):
        memory = by[f"memory gpu{index}"]
        # per GPU: the 5.2 GiB pool + half of the 18 GiB weights + the runtime
        assert memory.level == "ok" and f"{free} GiB free on GPU {index}" in memory.detail
        assert "KV pool 5.2 + weights as stored 9.0 (1/2 of 18.0) + runtime 1.5" in memory.detail
    assert by["link"].level == "ok"
    assert by["link"].detail == ("GPU0 <-> GPU1: PHB = PCIe through the CPU's host bridge: custom all-reduce off, "
                                 "NCCL P2P off (NCCL_P2P_DISABLE=1)")
    assert by["peer access"].detail == ("the driver reports GPU0 -> GPU1: chipset not supported")
    assert "all-reduce" not in by and "allocator" not in by


def test_dual_over_nvlink_turns_the_peer_paths_on_and_refuses_expandable_segments(tmp_path):
    from tests.support import nvidia_smi_samples as smi

    run = two_gpu_smi(SMI_TWO_3090, smi.NVLINK_PAIR, smi.P2P_GRANTED)
    by = dual_findings(tmp_path, run, environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert by["link"].detail.endswith("NV4 = NVLink (4 bonded links): custom all-reduce on, NCCL P2P on")
    assert by["allocator"].level == "blocker" and "CUSTOM_ALL_REDUCE=false" in by["allocator"].detail
    assert by["peer access"].detail == "the driver reports GPU0 -> GPU1: granted"


def test_a_patched_p2p_driver_over_pcie_is_named_and_forcing_the_kernel_on_warns(tmp_path):
    from tests.support import nvidia_smi_samples as smi

    run = two_gpu_smi(SMI_TWO_3090, smi.PCIE_PAIR, smi.P2P_GRANTED)
    by = dual_findings(tmp_path, run)
    assert "a patched driver; the PCIe defaults keep it unused" in by["peer access"].detail
    forced = dual_findings(tmp_path, run, custom_all_reduce=True)
    assert forced["all-reduce"].level == "warn" and "wrong sums" in forced["all-reduce"].detail


def test_gpu_link_that_contradicts_the_matrix_and_an_unreadable_matrix_warn(tmp_path):
    from tests.support import nvidia_smi_samples as smi

    said = dual_findings(tmp_path, two_gpu_smi(SMI_TWO_3090, smi.PCIE_PAIR), gpu_link="nvlink")
    assert said["link"].level == "warn" and said["link"].detail.startswith("GPU_LINK=nvlink, but GPU0 <-> GPU1: PHB")
    blind = dual_findings(tmp_path, two_gpu_smi(SMI_TWO_3090, None))
    assert blind["link"].level == "warn"
    assert "assumed PCIe" in blind["link"].detail and "custom all-reduce off" in blind["link"].detail


def test_dual_on_a_host_with_one_gpu_or_a_busy_second_one_is_a_blocker(tmp_path):
    from tests.support import nvidia_smi_samples as smi

    one = dual_findings(tmp_path, two_gpu_smi(SMI_3090, smi.PCIE_PAIR))
    assert one["gpus"].level == "blocker" and "CUDA_VISIBLE_DEVICES=0,1" in one["gpus"].detail
    busy = SMI_TWO_3090.replace("23800", "2100")
    by = dual_findings(tmp_path, two_gpu_smi(busy, smi.PCIE_PAIR))
    assert by["memory gpu0"].level == "ok" and by["memory gpu1"].level == "blocker"
    mixed = SMI_TWO_3090.replace("1, NVIDIA GeForce RTX 3090,", "1, NVIDIA GeForce RTX 3090 Ti,")
    assert dual_findings(tmp_path, two_gpu_smi(mixed, smi.PCIE_PAIR))["gpus"].level == "warn"


SMI_SPARK = "0, NVIDIA GB10, 580.95.05, [N/A], [N/A], 12.1, GPU-cccc\n"


def spark_host(root: Path, interface: str = "enp1s0f1np1", state: str = "up", rdma=("rocep1s0f1", "roceP2p1s0f1")):
    (root / "sys" / "class" / "net" / interface).mkdir(parents=True)
    (root / "sys" / "class" / "net" / interface / "operstate").write_text(state + "\n")
    (root / "sys" / "class" / "net" / "lo").mkdir()
    for name in rdma:
        (root / "sys" / "class" / "infiniband" / name).mkdir(parents=True)
    return root


def pair_findings(tmp_path, address: str, **values):
    import json

    smi = fake_nvidia_smi(SMI_SPARK)
    ip_json = json.dumps([{"ifname": "enp1s0f1np1", "addr_info": [{"family": "inet", "local": address}]}])

    def run(argv):
        return ip_json if argv[:2] == ["ip", "-j"] else smi(argv)

    profile = load_profile("spark-pair")
    root = spark_host(tmp_path / "root")
    return {f.check: f for f in diagnose(profile, resolved("spark-pair", **values), cache_dir=tmp_path,
                                         weights_bytes=24 * GIB, run=run, cuda_home=toolkit(tmp_path),
                                         cuda_runtime="13.0", environ={}, sys_root=root)}


def test_a_pair_host_checks_its_gpu_its_link_interface_address_and_rdma_devices(tmp_path):
    from tests.support.plans import PAIR_WORKER

    by = pair_findings(tmp_path, "192.168.100.11", **PAIR_WORKER, rdma_devices="rocep1s0f1,roceP2p1s0f1")
    assert by["gpu"].detail == "0: NVIDIA GB10, compute capability 12.1"
    # unified memory: nvidia-smi reports none; the need is per host (half the weights)
    assert by["memory"].level == "info" and "takes up to 29.5 GiB there" in by["memory"].detail
    assert by["hosts"].detail == ("this host is the worker (node rank 1) of 2; head 192.168.100.10:29501, "
                                  "this host 192.168.100.11 on enp1s0f1np1")
    assert by["interface"].level == "ok" and by["interface"].detail == "enp1s0f1np1 is up, addresses 192.168.100.11"
    assert by["rdma"].level == "ok"


def test_a_pair_host_with_the_wrong_address_missing_knobs_or_absent_rdma_is_told(tmp_path):
    from tests.support.plans import PAIR_WORKER

    wrong = pair_findings(tmp_path / "a", "10.0.0.7", **PAIR_WORKER, rdma_devices="mlx5_0")
    assert wrong["interface"].level == "blocker" and "NODE_ADDRESS 192.168.100.11 is not one of them" in wrong[
        "interface"].detail
    assert wrong["rdma"].level == "warn" and "NCCL would fall back to TCP sockets" in wrong["rdma"].detail
    bare = pair_findings(tmp_path / "b", "192.168.100.10", head_address=None, network_interface=None)
    assert bare["hosts"].level == "blocker"
    assert "set HEAD_ADDRESS, NETWORK_INTERFACE on the head" in bare["hosts"].detail


def test_the_weights_counted_are_the_directories_the_engine_reads(tmp_path):
    """With SPECULATION=mtp or off the engine reads no drafter: its directory is not counted
    against the card's memory (the DFlash2 drafter's bytes would make a fitting MTP start look
    short)."""
    from core.settings import Settings
    from entrypoint.doctor import weights_size

    profile = load_profile("single")
    for slot, size in (("target", 3000), ("drafter", 500)):
        directory = tmp_path / getattr(profile.models, slot).dir
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"\0" * size)
    settings = Settings(models_dir=str(tmp_path))
    assert weights_size(settings, profile) == 3500
    assert weights_size(settings, profile, reads_drafter=False) == 3000
