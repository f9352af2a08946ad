"""The FlashInfer modules an engine loads at its first start come prebuilt (docs/gpu.md).

`qwen38 toolchain prebuild` (the images at build time, `tests/gpu/run_tier.sh` and `bench
fullscale`'s `prebuild` step on a bare GPU machine) installs FlashInfer's sampling and top-k
modules in its AOT directory. Here, on the GPU: none is missing afterwards, and FlashInfer's
radix top-k (what vLLM's DFlash2 candidate selection calls) runs from the prebuilt module and
gives torch.topk's answer, values and indices, over a vocabulary-sized row.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_the_prebuilt_modules_are_installed_and_top_k_runs_from_them():
    flashinfer = pytest.importorskip("flashinfer")
    import torch

    from entrypoint.toolchain import prebuilt_missing

    done = subprocess.run([sys.executable, "-m", "entrypoint.cli", "toolchain", "prebuild"], capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert prebuilt_missing() == []
    torch.manual_seed(0)
    scores = torch.randn(4, 248_320, device="cuda", dtype=torch.bfloat16)
    values, indices = flashinfer.top_k(scores, 8, sorted=True, deterministic=True)
    expected = torch.topk(scores.float(), 8, dim=-1)
    assert torch.equal(values.float(), expected.values)
    # Ties in bf16 may order equal values differently: each index must hold its value.
    assert torch.equal(scores.float().gather(1, indices.long()), expected.values)
