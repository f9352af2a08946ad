"""The verify stat cache: skip re-hashing a file that provably has not changed.

After a file is fully hashed and matches its manifest, verify records its stamp
``(size, mtime_ns, ctime_ns, inode, device)`` and sha256 here. A later run trusts the file
without reading it only while all of these hold:

- the stamp is identical (any write changes mtime and ctime; a replaced file has another
  inode; a copy elsewhere another device/inode). ctime goes beyond the usual 4-tuple on
  purpose: ``touch -d`` can put mtime back after an in-place edit, but only the kernel
  sets ctime, to "now", on every change;
- the recorded sha256 is the one the manifest expects now;
- the directory's manifest digest is the one the entry was recorded under (a changed
  manifest - rewritten by a step or edited - re-hashes the whole directory);
- the entry is not "racy": a file modified within `RACY_WINDOW_NS` before it was hashed
  could be written again inside the same timestamp tick without changing its stamp (git's
  "racy clean" problem), so such an entry is re-hashed once more next time.

The cache lives under CACHE_DIR (the model directories are mounted read-only in the
containers) and is keyed by the directory's real path. Losing or corrupting it only costs
a full re-hash: it is never a reason to trust anything.

Prepare fills it too (`leave_proofs`): what a `qwen38 prepare` command hashed while it
downloaded or wrote a directory is recorded under these same rules, so the first
`qwen38 verify` after it reads none of those bytes again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.atomic import atomic_write_text
from core.manifest import ManifestError, read_manifest
from core.proofs import Ledger, Proof

STAT_CACHE_VERSION = 1
CACHE_FILE = Path("verify") / "stat-cache.json"  # under CACHE_DIR
# Coarse-timestamp filesystems (FAT, some NFS, SMB) tick every 1-2 s; ext4/xfs/btrfs far
# finer. Two seconds covers all of them.
RACY_WINDOW_NS = 2_000_000_000


@dataclass(frozen=True)
class FileStamp:
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def as_list(self) -> list[int]:
        return [self.size, self.mtime_ns, self.ctime_ns, self.ino, self.dev]


@dataclass(frozen=True)
class CacheEntry:
    stamp: FileStamp
    sha256: str
    hashed_at_ns: int

    @property
    def racy(self) -> bool:
        last_change = max(self.stamp.mtime_ns, self.stamp.ctime_ns)
        return last_change >= self.hashed_at_ns - RACY_WINDOW_NS


def is_trusted(entry: CacheEntry | None, stamp: FileStamp, expected_sha256: str) -> bool:
    """Whether a file with ``stamp`` may be taken to hold ``expected_sha256`` unread."""
    return (
        entry is not None
        and entry.stamp == stamp
        and entry.sha256 == expected_sha256
        and not entry.racy
    )


@dataclass
class DirEntries:
    manifest_digest: str
    files: dict[str, CacheEntry] = field(default_factory=dict)


class StatCache:
    """Recorded stamps per model directory, loaded from and saved to one JSON file."""

    def __init__(self, path: Path | None, dirs: dict[str, DirEntries] | None = None) -> None:
        self.path = path
        self.dirs: dict[str, DirEntries] = dirs or {}
        self.dirty = False

    @staticmethod
    def key(directory: Path) -> str:
        return os.path.realpath(directory)

    @classmethod
    def load(cls, path: Path) -> StatCache:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != STAT_CACHE_VERSION:
                return cls(path)
            dirs = {
                key: DirEntries(
                    manifest_digest=value["manifest_digest"],
                    files={
                        rel: CacheEntry(FileStamp(*entry["stamp"]), entry["sha256"], entry["hashed_at_ns"])
                        for rel, entry in value["files"].items()
                    },
                )
                for key, value in data["dirs"].items()
            }
        except (OSError, ValueError, KeyError, TypeError):
            return cls(path)  # missing or unreadable: everything is re-hashed
        return cls(path, dirs)

    def entries_for(self, directory: Path, manifest_digest: str) -> dict[str, CacheEntry]:
        """The entries recorded under this manifest; none when the manifest changed since."""
        found = self.dirs.get(self.key(directory))
        if found is None or found.manifest_digest != manifest_digest:
            return {}
        return found.files

    def record(
        self, directory: Path, manifest_digest: str, rel: str, stamp: FileStamp, sha256: str, hashed_at_ns: int
    ) -> None:
        key = self.key(directory)
        found = self.dirs.get(key)
        if found is None or found.manifest_digest != manifest_digest:
            found = self.dirs[key] = DirEntries(manifest_digest)
        found.files[rel] = CacheEntry(stamp, sha256, hashed_at_ns)
        self.dirty = True

    def forget(self, directory: Path, rel: str | None = None) -> None:
        key = self.key(directory)
        if rel is None:
            self.dirty |= self.dirs.pop(key, None) is not None
        elif key in self.dirs:
            self.dirty |= self.dirs[key].files.pop(rel, None) is not None

    def to_json(self) -> str:
        data = {
            "version": STAT_CACHE_VERSION,
            "dirs": {
                key: {
                    "manifest_digest": value.manifest_digest,
                    "files": {
                        rel: {"stamp": e.stamp.as_list(), "sha256": e.sha256, "hashed_at_ns": e.hashed_at_ns}
                        for rel, e in sorted(value.files.items())
                    },
                }
                for key, value in sorted(self.dirs.items())
            },
        }
        return json.dumps(data, indent=1) + "\n"

    def save(self) -> None:
        """Write the cache if anything changed (a warm restart writes nothing)."""
        if self.path is not None and self.dirty:
            atomic_write_text(self.path, self.to_json())
            self.dirty = False


# ---- what prepare proved ----------------------------------------------------------------


def _sound(proof: Proof, st: os.stat_result, ledger: Ledger, vouched_at: int) -> bool:
    """Whether ``proof`` speaks for the file that has ``st`` now (see `leave_proofs`)."""
    if (proof.size, proof.mtime_ns) != (st.st_size, st.st_mtime_ns):
        return False
    if not proof.written_here and max(proof.mtime_ns, proof.ctime_ns) >= proof.started_ns - RACY_WINDOW_NS:
        return False  # changed within the racy window before it was read: verify would not trust it either
    if st.st_ctime_ns == proof.ctime_ns or ledger.is_our_ctime(st):
        return True
    # A file written here was renamed into place (a new ctime) before its manifest was written.
    return proof.written_here and st.st_ctime_ns <= vouched_at


def _adopted(st: os.stat_result, sha256: str, ledger: Ledger, cache: StatCache) -> list[Proof]:
    """Entries of ``cache`` for this inode as it was right before this run hard-linked it."""
    found = []
    for before in ledger.stats_before_links(st):
        stamp = FileStamp.of(before)
        for entries in cache.dirs.values():
            for entry in entries.files.values():
                if entry.stamp == stamp and entry.sha256 == sha256 and not entry.racy:
                    found.append(Proof(stamp.size, stamp.mtime_ns, stamp.ctime_ns, sha256, entry.hashed_at_ns, False))
    return found


def leave_proofs(
    cache: StatCache,
    ledger: Ledger,
    *,
    clock: Callable[[], int] = time.time_ns,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Record in ``cache`` every file of the directories ``ledger`` saw vouched for (a manifest
    written) whose bytes the run proved; returns how many. A file is recorded only when:

    - a proof of the ledger (or, for a file this run hard-linked, a cache entry for the stat it
      had right before the link) has the manifest's sha256 for this inode, at its size and mtime;
    - the proof is sound: the file lay where only this process writes (a staging file or
      directory, so what it read back is what it wrote), or it had not changed for a racy
      window before the read began (verify's own rule);
    - nothing else changed the inode since: its ctime is the proof's, or one a hard link of
      ours set, or (a file written here, then renamed into place) not later than its manifest;
    - the entry will not be racy: recording waits until every file's last change is
      `RACY_WINDOW_NS` old (at most that long, once), then reads each stamp again, which must
      not have moved.
    """
    candidates: list[tuple[Path, str, str, str, FileStamp]] = []
    for directory, vouched_at in ledger.directories().items():
        try:
            manifest = read_manifest(directory)
        except ManifestError:
            continue  # a staging directory that never made it into place, or one since replaced
        for entry in manifest.files:
            try:
                st = os.stat(directory / entry.path)
            except OSError:
                continue
            offered = ledger.proofs_of(st) + _adopted(st, entry.sha256, ledger, cache)
            if any(p.sha256 == entry.sha256 and _sound(p, st, ledger, vouched_at) for p in offered):
                candidates.append((directory, manifest.digest, entry.path, entry.sha256, FileStamp.of(st)))
    if not candidates:
        return 0
    latest = max(max(stamp.mtime_ns, stamp.ctime_ns) for *_, stamp in candidates)
    wait_ns = latest + RACY_WINDOW_NS + 1 - clock()
    if wait_ns > 0:
        sleep(wait_ns / 1e9)
    recorded = 0
    for directory, digest, rel, sha256, stamp in candidates:
        seen_at = clock()
        try:
            again = FileStamp.of(os.stat(directory / rel))
        except OSError:
            continue
        if again == stamp:
            cache.record(directory, digest, rel, stamp, sha256, seen_at)
            recorded += 1
    return recorded
