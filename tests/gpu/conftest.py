"""The GPU tier's shared pieces: the one way to skip without a GPU, and the tier report.

Every test under tests/gpu carries the `gpu` marker; where torch sees no CUDA device (or
Triton is missing) they are skipped here, with the reason, before any fixture builds a
model. With ``QWEN38_GPU_REPORT=FILE`` (tests/gpu/run_tier.sh sets it) the session writes a
JSON report: the GPU and the versions, every test's outcome and duration, and what the tests
record with `record` (ready seconds, spec-decode counters, benchmark figures). It is written
after every test, so a run cut short still leaves what it reached.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

REPORT = os.environ.get("QWEN38_GPU_REPORT")
_STATE: dict = {"results": {}, "records": {}}
_T0: list[float] = []


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU here: the GPU tier runs on a machine with an NVIDIA GPU (docs/gpu.md)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` deselects by marker
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(str(item.fspath)).parents]
    for item in ours:
        item.add_marker(pytest.mark.gpu)
    reason = _cuda_reason() if ours else None
    if reason:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))


def versions() -> dict[str, str]:
    """GPU, driver and package versions of this run (the tier report's header)."""
    import importlib.metadata as md
    import platform
    import subprocess

    import torch

    props = torch.cuda.get_device_properties(0)
    out = {
        "gpu": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "memory_gib": f"{props.total_memory / 2**30:.0f}",
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for dist in ("vllm", "triton", "flashinfer-python", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    out["driver"] = smi.stdout.strip() if smi.returncode == 0 else "unknown"
    return out


def _write() -> None:
    if not REPORT:
        return
    path = Path(REPORT)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_STATE, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def record(key: str, value) -> None:
    """Add a figure to the tier report under ``key`` ("single.ready_s.cold", ...)."""
    node = _STATE["records"]
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    _write()


def pytest_sessionstart(session):
    if not REPORT or _cuda_reason():
        return
    _STATE["started"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    _STATE["versions"] = versions()
    _T0.append(time.monotonic())
    _write()


def pytest_runtest_logreport(report):
    if not REPORT or not _T0:
        return
    if report.when == "call" or report.outcome != "passed":
        entry = {"outcome": report.outcome, "seconds": round(report.duration, 1)}
        if report.outcome == "failed":
            entry["error"] = str(report.longrepr)[-1500:]
        _STATE["results"][f"{report.nodeid}@{report.when}"] = entry
        _STATE["elapsed_s"] = round(time.monotonic() - _T0[0], 1)
        _write()
