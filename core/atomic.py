"""Atomic file and directory writes: a reader sees the old state or the complete new one.

Files are written beside their destination under a hidden ``.incomplete`` name, flushed,
fsync'ed and renamed into place; directories are built under a hidden staging name and
swapped in with renames, so a crash at any point never leaves a half-written artifact where
a good one was.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from core import proofs


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _make_readable(tree: Path) -> None:
    """Model directories are read by the (non-root) server user: 0644 files, 0755 dirs.

    A file already at its mode is left alone: it may be a hard link of an input file
    (another directory's inode, perhaps another owner's), which a chmod would touch too.
    """
    tree.chmod(0o755)
    for root, dirs, files in os.walk(tree):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            path = os.path.join(root, name)
            if stat.S_IMODE(os.lstat(path).st_mode) != 0o644:
                os.chmod(path, 0o644)


def staging_path(dest: Path) -> Path:
    """A unique hidden sibling of ``dest`` to build it in."""
    return dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.incomplete"


def destination_name(path: Path) -> str:
    """The name ``path`` will have once in place: a `staging_path`'s destination, else its own."""
    name = path.name
    if name.startswith(".") and name.endswith(".incomplete") and name.count(".") >= 3:
        return name[1:-len(".incomplete")].rsplit(".", 1)[0]
    return name


@contextlib.contextmanager
def atomic_file(dest: Path | str, mode: str = "wb") -> Iterator:
    """Open a staging file; on a clean exit it replaces ``dest``, else it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(dest)
    try:
        with open(tmp, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(dest: Path | str, data: bytes) -> None:
    with atomic_file(dest, "wb") as handle:
        handle.write(data)


def atomic_write_text(dest: Path | str, text: str) -> None:
    atomic_write_bytes(dest, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(dest: Path | str, *, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging directory that becomes ``dest`` on a clean exit.

    With ``replace`` an existing ``dest`` is swapped out (renamed aside, then deleted) only
    after the new one is complete; without it an existing ``dest`` is an error.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and not replace:
        raise FileExistsError(dest)
    tmp = staging_path(dest)
    tmp.mkdir()
    try:
        with proofs.written_here(tmp):  # only this process writes there: what it hashes it wrote
            yield tmp
        _make_readable(tmp)
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if dest.exists():
            # Swap in one step where the kernel can; the replaced tree then sits at tmp.
            if _exchange(tmp, dest):
                proofs.moved(tmp, dest)
                _fsync_dir(dest.parent)
                shutil.rmtree(tmp, ignore_errors=True)
                return
            old = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.old"
            os.replace(dest, old)
            os.replace(tmp, dest)
            proofs.moved(tmp, dest)
            _fsync_dir(dest.parent)
            shutil.rmtree(old, ignore_errors=True)
            return
        os.replace(tmp, dest)
        proofs.moved(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_staging(directory: Path | str) -> list[Path]:
    """Delete leftovers of interrupted atomic writes directly inside ``directory``."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if entry.name.startswith(".") and entry.name.endswith((".incomplete", ".old")):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
