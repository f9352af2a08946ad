"""The RTX 3090 image built from scratch and checked inside, without a GPU, as its user.

`make image-test-rtx3090` (or QWEN38_IMAGE_TEST_RTX3090=1): a private Docker daemon
(tests/container/docker_daemon.py) under QWEN38_IMAGE_TEST_RTX3090_DIR (default
/tmp/qwen38-image-test-rtx3090) builds docker/Dockerfile.rtx3090 on a stand-in for its
nvidia/cuda base (tests/support/image_build.py: Ubuntu 24.04 from Ubuntu's archive; no registry
is reachable here). Every Python package, the JIT toolchain included, comes from the hash-pinned
lock docker/lock/cuda-x86_64.txt. Then, in containers of that image, as uid 10001 and with no
network:

- torch 2.13.0 (CUDA 13.0) and vLLM 0.28.0 import; `qwen38 patches check` passes;
- `qwen38 doctor --profile single` reports the missing GPU as a blocker and every toolchain
  check OK; `nvcc --version` answers;
- FlashInfer's JIT builds the sampling kernels vLLM's sampler uses (they include
  curand_kernel.h) with the image's nvcc, headers and libraries, for sm_86, exactly as at a
  first start. A driver library is the one thing missing without a GPU: a placeholder
  libcuda.so.1 is mounted where the NVIDIA container toolkit mounts the real one;
- the image carries those kernels prebuilt: FlashInfer loads them without compiling;
- `pip freeze` lists exactly the lock, plus this project.

It needs root, Debian's docker.io and mmdebstrap, ~4.3 GB of wheels and 30-60 minutes cold on
a 2-core machine (docs/images.md has the recorded runs). The daemon stops at the end; its layers
and pip cache stay under the work directory for a faster re-run (`make image-test-clean`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from entrypoint.images import IMAGES, build_args, project_version
from prepare.dependency_lock import TARGETS, parse_lock
from tests.container.docker_daemon import PrivateDockerDaemon
from tests.support.image_build import (
    NOBLE_CUDA_BASE,
    Record,
    build_image,
    image_figures,
    source_revision,
    standin_base,
    started_daemon,
)

pytestmark = [
    pytest.mark.container,
    pytest.mark.image,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("QWEN38_IMAGE_TEST_RTX3090") != "1",
        reason="opt-in: make image-test-rtx3090 (QWEN38_IMAGE_TEST_RTX3090=1)",
    ),
]

WORK = Path(os.environ.get("QWEN38_IMAGE_TEST_RTX3090_DIR", "/tmp/qwen38-image-test-rtx3090"))
SPEC = IMAGES["rtx3090"]
TAG = "qwen38-stack:rtx3090-imagetest"
USER = "10001"
TOOLCHAIN_CHECKS = ("nvcc", "cuda headers", "curand", "cudart", "c compiler", "c++ compiler", "python headers",
                    "ninja")


@pytest.fixture(scope="module")
def record() -> Record:
    return Record(WORK)


@pytest.fixture(scope="module")
def daemon() -> Iterator[PrivateDockerDaemon]:
    with started_daemon(WORK / "docker") as instance:
        yield instance


@pytest.fixture(scope="module")
def image(daemon: PrivateDockerDaemon, record: Record) -> dict:
    base = os.environ.get("QWEN38_BASE_IMAGE") or standin_base(daemon, WORK, NOBLE_CUDA_BASE, record)
    labels = build_args(SPEC, source_revision())
    seconds = build_image(daemon, SPEC.dockerfile, TAG, {"BASE_IMAGE": base, **labels}, WORK / "build.log")
    record.add(build_seconds=round(seconds, 1), **image_figures(daemon, TAG, base))
    return {"labels": labels, "inspect": json.loads(daemon.docker("image", "inspect", TAG).stdout)[0]}


def run_in_image(
    daemon: PrivateDockerDaemon, *argv: str, entrypoint: str | None = None, mounts: tuple[str, ...] = (),
    env: dict[str, str] | None = None, timeout: float = 600,
) -> subprocess.CompletedProcess:
    """A throwaway container of the image, as its own user, without network."""
    options = ["run", "--rm", "--network=none"]
    if entrypoint:
        options += ["--entrypoint", entrypoint]
    for mount in mounts:
        options += ["-v", mount]
    for key, value in (env or {}).items():
        options += ["-e", f"{key}={value}"]
    return daemon.docker(*options, TAG, *argv, timeout=timeout, check=False)


def test_image_is_labelled_and_runs_as_non_root(image):
    config = image["inspect"]["Config"]
    labels = config["Labels"]
    assert labels["io.qwen38.vllm.version"] == image["labels"]["VLLM_VERSION"] == "0.28.0"
    assert labels["io.qwen38.patchset.sha256"] == image["labels"]["PATCHSET_SHA256"]
    assert labels["io.qwen38.cuda.arch-list"] == "8.6"
    assert config["User"] == f"{USER}:{USER}"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["CUDA_HOME"] == "/opt/venv/cuda" and "/opt/venv/cuda/bin" in env["PATH"].split(":")


def test_torch_and_vllm_import_as_the_image_user(daemon, image):
    probe = (
        "import os, torch, vllm, flashinfer; "
        "print(os.getuid(), torch.__version__, torch.version.cuda, vllm.__version__, flashinfer.__version__)"
    )
    result = run_in_image(daemon, "-c", probe, entrypoint="python")
    assert result.returncode == 0, result.stderr[-3000:]
    uid, torch_version, cuda, vllm_version, flashinfer_version = result.stdout.split()[-5:]
    assert (uid, torch_version, cuda, vllm_version) == (USER, "2.13.0+cu130", "13.0", "0.28.0")
    assert flashinfer_version == "0.6.16.post3"


def test_the_shipped_vllm_carries_the_patch_series(daemon, image):
    result = run_in_image(daemon, "patches", "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"all \d+ patches delivered in /opt/venv/lib/python3\.12/site-packages/vllm", result.stdout)
    assert image["labels"]["PATCHSET_SHA256"][:12] in result.stdout


def test_doctor_blocks_on_the_missing_gpu_and_finds_the_whole_toolchain(daemon, image):
    result = run_in_image(daemon, "doctor", "--profile", "single")
    # Finding.line(): the level in 7 columns, the check in 14, then the detail.
    by_check = {line[8:22].strip(): (line[:7].strip(), line[23:]) for line in result.stdout.splitlines()}
    assert result.returncode == 2, result.stdout + result.stderr
    assert by_check["gpu"][0] == "BLOCKER" and "no NVIDIA GPU" in by_check["gpu"][1]
    assert "1 blocker(s) for profile single: no NVIDIA GPU" in result.stderr
    assert by_check["cuda"] == ("OK", "torch built for CUDA 13.0")
    for name in TOOLCHAIN_CHECKS:
        assert by_check[name][0] == "OK", (name, result.stdout)
    assert by_check["nvcc"][1] == "/opt/venv/cuda/bin/nvcc (CUDA 13.0)"
    assert by_check["curand"][1] == "/opt/venv/cuda/include/curand_kernel.h"
    assert [level for level, _ in by_check.values()].count("BLOCKER") == 1


def test_nvcc_answers_as_the_image_user(daemon, image):
    result = run_in_image(daemon, "--version", entrypoint="nvcc")
    assert result.returncode == 0, result.stderr
    assert "Cuda compilation tools, release 13.0" in result.stdout


# vLLM's FlashInfer top-k/top-p sampler (on by default) makes FlashInfer JIT-build this module at
# the first start; `build()` is exactly that build (ninja: nvcc for each .cu, then the link).
JIT_SAMPLING = """
import json, os, time
from flashinfer.jit import cpp_ext, env
from flashinfer.jit.sampling import gen_sampling_module
spec = gen_sampling_module()
start = time.monotonic()
spec.build(verbose=False)
seconds = time.monotonic() - start
ninja = spec.ninja_path.read_text()
print(json.dumps({"seconds": seconds, "cuda_home": cpp_ext.get_cuda_path(), "library": str(spec.jit_library_path),
                  "built": spec.jit_library_path.is_file(), "ninja": ninja, "jit_dir": str(env.FLASHINFER_JIT_DIR)}))
"""


@pytest.fixture(scope="module")
def driver_placeholder(daemon, image, tmp_path_factory) -> Path:
    """An empty libcuda.so.1, made by the image's own compiler: the link step resolves ``-lcuda``
    against the driver the NVIDIA container toolkit mounts at run time; without a GPU this file
    stands where it would be (the sampling module calls no driver function)."""
    directory = tmp_path_factory.mktemp("driver")
    made = daemon.docker(
        "run", "--rm", "--network=none", "--user", "0", "-v", f"{directory}:/out", "--entrypoint", "cc", TAG,
        "-shared", "-Wl,-soname,libcuda.so.1", "-o", "/out/libcuda.so.1", "-x", "c", "/dev/null",
        timeout=300, check=False,
    )
    assert made.returncode == 0, made.stderr
    library = directory / "libcuda.so.1"
    library.chmod(0o755)
    return library


def test_flashinfer_jit_builds_the_sampling_kernels_with_the_image_toolchain(daemon, image, driver_placeholder,
                                                                             record):
    result = run_in_image(
        daemon, "-c", JIT_SAMPLING, entrypoint="python",
        mounts=(f"{driver_placeholder}:/usr/lib/x86_64-linux-gnu/libcuda.so.1:ro",),
        env={"FLASHINFER_WORKSPACE_BASE": "/var/cache/qwen38/flashinfer"},
        timeout=3600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert built["built"] and built["cuda_home"] == "/opt/venv/cuda"
    assert built["jit_dir"].startswith("/var/cache/qwen38/flashinfer/.cache/flashinfer/0.6.16.post3/86/")
    ninja = built["ninja"]
    assert "nvcc = $cuda_home/bin/nvcc" in ninja and "cuda_home = /opt/venv/cuda" in ninja
    assert "-isystem $cuda_home/include" in ninja  # where curand_kernel.h is
    assert "-gencode=arch=compute_86,code=sm_86" in ninja
    assert "sampling.cu" in ninja and "-L$cuda_home/lib64" in ninja and "-lcudart" in ninja
    record.add(jit_sampling_seconds=round(built["seconds"], 1))


# What vLLM's sampler calls at the first start: the module comes from FlashInfer's AOT directory
# (built into the image), so no JIT build happens in the cache.
LOAD_SAMPLING = """
import json, os
import flashinfer.sampling
from flashinfer.jit import env
from flashinfer.jit.sampling import gen_sampling_module
flashinfer.sampling.get_sampling_module()
spec = gen_sampling_module()
print(json.dumps({"aot": str(spec.aot_path), "is_aot": spec.is_aot, "jit_built": spec.build_dir.exists()}))
"""


def test_vllms_sampler_loads_the_prebuilt_sampling_kernels_without_compiling(daemon, image):
    result = run_in_image(daemon, "-c", LOAD_SAMPLING, entrypoint="python",
                          env={"FLASHINFER_WORKSPACE_BASE": "/var/cache/qwen38/flashinfer"})
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {
        "aot": "/opt/venv/lib/python3.12/site-packages/flashinfer/data/aot/sampling/sampling.so",
        "is_aot": True,
        "jit_built": False,
    }


def test_pip_freeze_in_the_image_is_exactly_the_lock(daemon, image):
    result = run_in_image(daemon, "freeze", "--all", entrypoint="pip")
    assert result.returncode == 0, result.stderr
    installed, other = {}, []
    for line in result.stdout.splitlines():
        pinned = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if pinned:
            installed[canonicalize_name(pinned.group(1))] = pinned.group(2)
        else:
            other.append(line)
    target = TARGETS[SPEC.lock_target]
    locked = {name: req.version for name, req in parse_lock(target.lock_path.read_text()).items()}
    assert installed == locked
    # Beside the lock, only this project, installed editable from /opt/qwen38.
    assert other == [
        f"# Editable install with no version control (qwen38-stack=={project_version()})",
        "-e /opt/qwen38",
    ]


def test_image_size_and_build_time_are_recorded(image, record):
    assert record.figures["build_seconds"] > 0 and record.figures["image_bytes"] > record.figures["base_image_bytes"]
    print(json.dumps(record.figures, indent=2))
