"""Opt-in: the series applies to the pristine CUDA wheel of vLLM 0.28.0 itself.

CI checks the CUDA wheel through the hashes recorded in patches/series.lock.json
(tests/unit/test_patch_series.py); this test downloads the ~300 MB wheel from PyPI to
re-derive them. Run with QWEN38_DOWNLOAD_CUDA_WHEEL=1 (or point QWEN38_CUDA_WHEEL at
an already downloaded wheel).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.manifest import sha256_file
from entrypoint import patches as ps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cuda_wheel(tmp_path_factory) -> Path:
    given = os.environ.get("QWEN38_CUDA_WHEEL")
    if given:
        return Path(given)
    if os.environ.get("QWEN38_DOWNLOAD_CUDA_WHEEL") != "1":
        pytest.skip("set QWEN38_DOWNLOAD_CUDA_WHEEL=1 to download the vLLM 0.28.0 CUDA wheel")
    dest = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "vllm==0.28.0", "-d", str(dest)],
        check=True,
        capture_output=True,
    )
    return next(dest.glob("vllm-0.28.0-*.whl"))


def test_cuda_wheel_is_the_one_the_lock_records(cuda_wheel):
    source = ps.load_series().lock["sources"].get(cuda_wheel.name)
    assert source is not None, f"the lock records no wheel named {cuda_wheel.name}"
    assert sha256_file(cuda_wheel) == source["sha256"]


def test_series_applies_to_the_cuda_wheel_files(cuda_wheel, tmp_path):
    series = ps.load_series()
    pristine = ps.pristine_from_wheel(cuda_wheel, series.paths)
    assert ps.build_lock(pristine)["files"] == series.lock["files"]
    tree = tmp_path / "vllm"
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    for path, text in pristine.items():
        if text is None:  # a file the series adds (e.g. 0045's kernel module)
            continue
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text, encoding="utf-8")
    ps.apply_series(tree)
    assert ps.all_present(ps.check_series(tree))
