"""The cache directory the test session's vLLM processes share, removed when the session ends.

The servers (tests/conftest.py) link the `SHARED_CACHE_PARTS` of their CACHE_DIR to it; the
engine children a test starts itself (tests/support/vllm_env.py, tests/support/vllm_views.py)
use its vLLM part as VLLM_CACHE_ROOT. There the servers' planner leaves the model information
vLLM would otherwise inspect in a Python of its own (~8 s of one core for each model class).

A view of vLLM (tests/support/vllm_views.py) gets a vLLM cache of its own in the session
(`view_vllm_cache`), whose model information is kept across sessions and shared by the xdist
workers (`MODELINFO_STORE`), one directory per content of the tree (see `tree_key`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_SESSION_CACHE: list[Path] = []
# Where `view_vllm_cache` keeps vLLM's model information beyond the session: a directory of the
# pytest cache (tests/conftest.py adds it; empty without the cache plugin: kept for the session only).
MODELINFO_STORE: list[Path] = []
_TREE_KEYS: dict[Path, str] = {}
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


def tree_key(view: Path) -> str:
    """What vLLM's model information (the interfaces each model class declares) depends on in
    the view at ``view`` (the directory holding its ``vllm``): the bytes of every file the
    patch series touches there (the view's own files, pristine or patched; every other one is a
    link into the installed tree), the installed tree, its version and the interpreter's."""
    view = Path(view).resolve()
    if view not in _TREE_KEYS:
        from entrypoint.patches import find_vllm_dir, installed_vllm, load_series

        digest = hashlib.sha256()
        digest.update(repr((sys.version, installed_vllm(), str(find_vllm_dir().resolve()))).encode())
        for rel in sorted(load_series(require_lock=False).paths):
            path = view / "vllm" / rel
            digest.update(b"\0" + rel.encode() + b"\0")
            digest.update(path.read_bytes() if path.is_file() else b"<none>")
        _TREE_KEYS[view] = digest.hexdigest()[:24]
    return _TREE_KEYS[view]


def view_vllm_cache(view: Path) -> Path:
    """The session's VLLM_CACHE_ROOT for children run on ``view``: one per content of the tree
    (a stock and a patched view of the same file would otherwise overwrite each other's entry,
    vLLM keeping one per model class), its ``modelinfos`` the kept one for that content.

    vLLM records there, per model class, what it otherwise learns by importing the class in a
    Python of its own (~13 s of one core on the 2-core machine, at every first engine config of
    a child), checked by the hash of the class's source file; written by vLLM atomically (a
    temporary file renamed), so workers that record the same class at once are safe."""
    key = tree_key(view)
    root = session_cache() / "vllm-views" / key
    if not root.exists():
        store = (MODELINFO_STORE[0] if MODELINFO_STORE else session_cache() / "modelinfos") / key
        store.mkdir(parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        link = root / "modelinfos"
        if not link.is_symlink():
            link.symlink_to(store, target_is_directory=True)
    return root


def once_per_run(tmp_path_factory, name: str, compute: Callable[[], T]) -> T:
    """``compute()``'s value, computed once in this test run: the xdist workers of one run
    (`-n 2`) share it (pickled in the run's base temporary directory, the parent of each
    worker's own), the first to ask computing it while the other waits on its lock. Nothing is
    kept beyond the run; a ``compute`` that raises leaves nothing, and the next one asks again."""
    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = run_dir / f"qwen38-{name}.pickle"
    with open(run_dir / f".qwen38-{name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_bytes(pickle.dumps(value))
        os.replace(partial, path)
        return value
