"""The cache directory the test session's vLLM processes share, removed when the session ends.

The servers (tests/conftest.py) link the `SHARED_CACHE_PARTS` of their CACHE_DIR to it; the
engine children a test starts itself (tests/support/vllm_env.py, tests/support/vllm_views.py)
use its vLLM part as VLLM_CACHE_ROOT. There the servers' planner leaves the model information
vLLM would otherwise inspect in a Python of its own (~8 s of one core for each model class).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

_SESSION_CACHE: list[Path] = []
# What the session's servers share of a CACHE_DIR: plans, and vLLM's per-engine caches
# (entries of both are keyed by what they depend on and written atomically).
SHARED_CACHE_PARTS = ("plan", "vllm")


def session_cache() -> Path:
    """The shared parts of the session's server caches (see `SHARED_CACHE_PARTS`)."""
    if not _SESSION_CACHE:
        _SESSION_CACHE.append(Path(tempfile.mkdtemp(prefix="qwen38-test-cache-")))
    return _SESSION_CACHE[0]


def session_vllm_cache() -> Path:
    """The session's vLLM cache (the servers' CACHE_DIR/vllm)."""
    path = session_cache() / "vllm"
    path.mkdir(exist_ok=True)
    return path


def remove_session_cache() -> None:
    for directory in _SESSION_CACHE:
        shutil.rmtree(directory, ignore_errors=True)
    _SESSION_CACHE.clear()
