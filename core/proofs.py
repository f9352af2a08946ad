"""What a prepare command proved about the files it hashed, so that verify need not read them again.

Prepare hashes every file it downloads or writes; `qwen38 verify` (the first `qwen38 serve`)
would hash them all again unless its stat cache (`core.stat_cache`) already holds
them. While a command records (`recording`, which `qwen38 prepare` wraps around each of its
commands), this ledger keeps:

- every sha256 computed (`core.hashing.sha256_file` notes it): the file's stat before it
  was read, the digest, and when the read began; and whether the file lay in a directory only
  this process writes (`written_here`: a download's staging file, an `atomic_directory` being
  built), where its bytes are the ones this process wrote and then read back;
- every hard link a derived directory made of an input file (`linked`): the link changes the
  inode's ctime, and that change is ours; the stat right before it lets a stat cache entry an
  earlier run recorded for the input file speak for the link (its bytes are not read again);
- every directory whose manifest was written (`core.manifest.write_manifest`), followed
  through the rename that puts a staging directory in place (`moved`).

`core.stat_cache.leave_proofs` then turns those into stat cache entries under the rules
verify applies (it is the one home of those rules); this module only records facts.
Files are known by (device, inode): a download's staging file is renamed into place, a
derived directory's untouched shards are hard links of the input's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Proof:
    """A file held ``sha256`` while it had ``size``/``mtime_ns``/``ctime_ns`` (read from ``started_ns`` on)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    sha256: str
    started_ns: int
    written_here: bool


@dataclass
class Ledger:
    proofs: dict[tuple[int, int], list[Proof]] = field(default_factory=dict)
    our_ctimes: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # after our own links
    before_links: dict[tuple[int, int], list[os.stat_result]] = field(default_factory=dict)
    vouched: dict[Path, int] = field(default_factory=dict)  # directory -> when its manifest was written
    private: list[Path] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, path: Path, before: os.stat_result, sha256: str, started_ns: int) -> None:
        where = Path(os.path.abspath(path))
        with self.lock:
            mine = any(where.is_relative_to(p) for p in self.private)
            proof = Proof(before.st_size, before.st_mtime_ns, before.st_ctime_ns, sha256, started_ns, mine)
            self.proofs.setdefault((before.st_dev, before.st_ino), []).append(proof)

    def proofs_of(self, st: os.stat_result) -> list[Proof]:
        with self.lock:
            return list(self.proofs.get((st.st_dev, st.st_ino), ()))

    def is_our_ctime(self, st: os.stat_result) -> bool:
        with self.lock:
            return st.st_ctime_ns in self.our_ctimes.get((st.st_dev, st.st_ino), ())

    def stats_before_links(self, st: os.stat_result) -> list[os.stat_result]:
        """The file's stat right before each hard link this process made of it."""
        with self.lock:
            return list(self.before_links.get((st.st_dev, st.st_ino), ()))

    def directories(self) -> dict[Path, int]:
        """Each directory whose manifest this run wrote, with when it was written (time.time_ns)."""
        with self.lock:
            return dict(self.vouched)


_active: Ledger | None = None
_active_lock = threading.Lock()


def active() -> Ledger | None:
    return _active


@contextlib.contextmanager
def recording() -> Iterator[Ledger]:
    """Keep a ledger of what this process proves until the block ends (one at a time)."""
    global _active
    with _active_lock:
        if _active is not None:
            raise RuntimeError("a proof ledger is already recording in this process")
        _active = ledger = Ledger()
    try:
        yield ledger
    finally:
        with _active_lock:
            _active = None


def note_hash(path: Path | str, before: os.stat_result, sha256: str, started_ns: int) -> None:
    """`core.hashing` computed ``sha256`` of ``path``, whose stat was ``before`` when the read began."""
    ledger = _active
    if ledger is not None:
        ledger.note(Path(path), before, sha256, started_ns)


@contextlib.contextmanager
def written_here(directory: Path | str) -> Iterator[None]:
    """Files hashed under ``directory`` while the block runs were written by this process
    there, where no other writer goes (a staging directory under our lock)."""
    ledger = _active
    if ledger is None:
        yield
        return
    where = Path(os.path.abspath(directory))
    with ledger.lock:
        ledger.private.append(where)
    try:
        yield
    finally:
        with ledger.lock:
            ledger.private.remove(where)


def linked(path: Path | str, before: os.stat_result) -> None:
    """This process just made a hard link of ``path``, whose stat was ``before``: the inode's
    new ctime is our doing, and a stat cache entry for ``before`` still speaks for its bytes."""
    ledger = _active
    if ledger is None:
        return
    try:
        st = os.stat(path)
    except OSError:
        return
    key = (st.st_dev, st.st_ino)
    with ledger.lock:
        ledger.our_ctimes.setdefault(key, set()).add(st.st_ctime_ns)
        ledger.before_links.setdefault(key, []).append(before)


def vouched(directory: Path | str) -> None:
    """A manifest was written for ``directory``: its files are what `leave_proofs` records."""
    ledger = _active
    if ledger is not None:
        with ledger.lock:
            ledger.vouched[Path(os.path.abspath(directory))] = time.time_ns()


def moved(source: Path | str, dest: Path | str) -> None:
    """The directory ``source`` (a staging directory) is now ``dest``."""
    ledger = _active
    if ledger is None:
        return
    old, new = Path(os.path.abspath(source)), Path(os.path.abspath(dest))
    with ledger.lock:
        ledger.vouched = {
            (new / p.relative_to(old) if p.is_relative_to(old) else p): at for p, at in ledger.vouched.items()
        }
