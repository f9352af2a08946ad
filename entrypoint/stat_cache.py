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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from prepare.atomic import atomic_write_text

STAT_CACHE_VERSION = 1
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
