"""sha256 of files, one file per thread.

hashlib (OpenSSL) releases the GIL while it digests a buffer larger than 2 KiB and
``readinto`` releases it while the kernel copies, so plain threads hash several files at
once at the speed of the disk or of the cores, whichever is lower. One file is never split:
sha256 is sequential, and model directories have several large shards anyway.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core import proofs

# 4 MiB: large enough that the per-call overhead vanishes, small enough to stay in L2/L3
# while OpenSSL digests it (measured in `qwen38 bench verify`).
CHUNK_BYTES = 4 << 20


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def sha256_file(path: Path | str, progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file's content; ``progress(n)`` is called with each chunk's size.

    While a prepare command records (`core.proofs`), the digest is noted with the file's
    stat from before the read, for verify's stat cache."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        before = os.fstat(handle.fileno())
        started = time.time_ns()
        if hasattr(os, "posix_fadvise"):
            # Tell the kernel we read front to back: it doubles the readahead window.
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := handle.readinto(buffer):
            digest.update(view[:n])
            if progress is not None:
                progress(n)
    found = digest.hexdigest()
    proofs.note_hash(path, before, found, started)
    return found


def _size_or_zero(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def hash_files(
    paths: Iterable[Path],
    *,
    jobs: int | None = None,
    progress: Callable[[int], None] | None = None,
    return_errors: bool = False,
) -> dict[Path, str | OSError]:
    """sha256 of every path, ``jobs`` files at a time (default: the usable cores).

    Largest files start first so one big shard does not run alone at the end.
    ``progress`` must be thread-safe (`core.progress.Progress.update` is). With ``return_errors`` a file
    that cannot be read maps to its `OSError` instead of raising.
    """
    ordered = sorted(set(paths), key=_size_or_zero, reverse=True)
    if not ordered:
        return {}

    def one(path: Path) -> str | OSError:
        try:
            return sha256_file(path, progress)
        except OSError as exc:
            if return_errors:
                return exc
            raise

    workers = max(1, min(jobs or available_cores(), len(ordered)))
    if workers == 1:
        return {p: one(p) for p in ordered}
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256") as pool:
        return dict(zip(ordered, pool.map(one, ordered)))


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob: how the hub names a non-LFS file's content."""
    header = f"blob {len(data)}\0".encode("ascii")
    return hashlib.sha1(header + data, usedforsecurity=False).hexdigest()
