"""What the image labels say is derived, not typed: `qwen38 image build-args`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import ImageError
from entrypoint.images import IMAGES, build_args, cuda_arch_list, locked_engine_version, profiles_for, published_tag

REPO = Path(__file__).resolve().parents[2]
needs_patch_series = pytest.mark.skipif(
    importlib.util.find_spec("entrypoint.patches") is None, reason="entrypoint.patches is not in this tree yet"
)


def test_each_image_serves_the_profiles_of_its_machine():
    assert profiles_for(IMAGES["rtx3090"]) == ["batch", "dual", "huge", "long", "single"]
    assert profiles_for(IMAGES["spark"]) == ["spark-lora", "spark-pair"]
    assert profiles_for(IMAGES["cpu"]) == ["cpu"]


def test_arch_list_comes_from_the_profiles_and_the_engine_version_from_the_lock():
    assert cuda_arch_list(IMAGES["rtx3090"]) == "8.6"
    assert cuda_arch_list(IMAGES["spark"]) == "12.1"
    assert cuda_arch_list(IMAGES["cpu"]) == "none"
    assert {locked_engine_version(spec) for spec in IMAGES.values()} == {"0.28.0"}


def test_published_tags_name_version_and_image():
    assert published_tag(IMAGES["spark"], "1.2.3") == "ghcr.io/qwen38-stack/qwen38-stack:1.2.3-spark"


@needs_patch_series
def test_build_args_fill_every_label_argument():
    from entrypoint.patches import series_fingerprint

    args = build_args(IMAGES["spark"], "0123456789abcdef0123456789abcdef01234567")
    assert args == {
        "VLLM_VERSION": "0.28.0",
        "PATCHSET_SHA256": series_fingerprint(),
        "CUDA_ARCH_LIST": "12.1",
        "SOURCE_REVISION": "0123456789abcdef0123456789abcdef01234567",
        "IMAGE_VERSION": "0.1.0",
    }
    with pytest.raises(ImageError, match="expected a git commit"):
        build_args(IMAGES["spark"], "main; rm -rf /")


@needs_patch_series
def test_build_args_command_prints_docker_arguments_and_json():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "entrypoint.cli", "image", "build-args", "rtx3090", "--revision", "abcdef1"]
    docker = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert docker[0::2] == ["--build-arg"] * 5 and "CUDA_ARCH_LIST=8.6" in docker
    data = json.loads(
        subprocess.run([*cmd, "--format", "json"], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    )
    assert data["tag"] == published_tag(IMAGES["rtx3090"]) and data["platform"] == "linux/amd64"
