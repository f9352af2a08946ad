"""Directories derived from other directories: inputs, identity, idempotence, atomic rebuilds.

A preparation step turns input directories (a verified download, a draft vocabulary)
into an output directory. Its manifest carries a `DerivedIdentity`: the transform, its
version, the parameters that shape its output and, per input, an `InputRef` (the input's
identity and manifest digest, which covers every input file's sha256). So:

- a rerun whose output already carries the same identity and all its files does nothing;
- a different identity (new parameters, new input) rebuilds the output in a hidden staging
  directory and swaps it in whole, so a reader only ever sees the old complete directory
  or the new complete one; a kill leaves at most a staging directory, removed on the
  next run;
- an existing directory this step did not make is never replaced.

Inputs (`open_input`): a directory with a manifest is identified by it; its files must be
exactly the manifest's, at their sizes (its content was verified when the manifest was
written; `qwen38 verify` proves it again). A directory without one is refused, or, where
the caller allows it (the stand-alone commands on a user's own checkpoint), identified by
content: every file is hashed now and the input is recorded as a `GeneratedIdentity`
``local`` whose manifest digest is that of the manifest the directory *would* have. That
manifest is never written into the input (an input is only ever read), and it binds the
output to those exact bytes; `qwen38 verify` refuses to serve a profile slot that derives
from such an input, because nothing in the lock pins it.

Untouched input files are placed by `place_file`: a hard link where possible, else a
reflink, else a copy. The input is only ever read, so its bytes and its own manifest stay
valid; a hard link's sha256 is taken from the input manifest instead of being hashed
again (`core.manifest.LinkedFile`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core import progress, proofs
from core.atomic import atomic_directory
from core.errors import PrepareError
from core.hashing import hash_files
from core.identity import DerivedIdentity, GeneratedIdentity, InputRef
from core.manifest import (
    MANIFEST_NAME,
    LinkedFile,
    Manifest,
    ManifestError,
    ManifestFile,
    build_manifest,
    content_files,
    file_mismatches,
    read_manifest,
    write_manifest,
)

_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)

LOCAL_GENERATOR = "local"
LOCAL_GENERATOR_VERSION = "1"


@dataclass(frozen=True)
class InputDirectory:
    """An input of a derived directory: where it is, how it is referenced, what it holds."""

    path: Path
    ref: InputRef
    manifest: Manifest  # its manifest, or (``hashed_now``) the one built from hashing its files
    hashed_now: bool = False  # no manifest: identified by hashing its files just now

    def file(self, rel: str) -> ManifestFile | None:
        return self.manifest.by_path().get(rel)

    def linked(self, rel: str) -> LinkedFile | None:
        """What `write_manifest` may reuse for a hard link of ``rel`` (its verified size and sha256)."""
        entry = self.file(rel)
        return None if entry is None else LinkedFile(self.path / rel, entry.size, entry.sha256)


def check_input_files(directory: Path, manifest: Manifest) -> None:
    """Cheap guard: the input holds exactly its manifest's files, each at its size."""
    for mismatch in file_mismatches(directory, manifest)[:1]:
        fix = "remove it or re-download the input" if mismatch.kind == "extra" else "re-verify the download"
        raise PrepareError(f"{mismatch.describe(directory)}; {fix} before preparing")


def local_input(directory: Path, role: str, *, only: Sequence[str] | None = None) -> InputDirectory:
    """An input without a manifest, identified by the sha256 of its files (hashed now).

    ``only`` restricts it to the named files (e.g. the tokenizer files of a model
    directory): the reference then says so in its parameters.
    """
    files = content_files(directory)
    if only is not None:
        wanted = set(only)
        files = [p for p in files if p.relative_to(directory).as_posix() in wanted]
    if not files:
        raise PrepareError(f"{directory}: no files to prepare from")
    with progress.hashing(files, f"sha256 {directory} (no manifest: identified by content)") as bar:
        digests = hash_files(files, progress=bar.update)
    identity = GeneratedIdentity(
        generator=LOCAL_GENERATOR,
        generator_version=LOCAL_GENERATOR_VERSION,
        params={} if only is None else {"files": sorted(p.relative_to(directory).as_posix() for p in files)},
    )
    manifest = build_manifest(
        identity,
        [
            ManifestFile(path=p.relative_to(directory).as_posix(), size=p.stat().st_size, sha256=digests[p])
            for p in files
        ],
    )
    ref = InputRef(role=role, identity=identity, manifest_digest=manifest.digest)
    return InputDirectory(directory, ref, manifest, hashed_now=True)


def open_input(
    directory: Path | str, role: str, *, allow_unmanifested: bool, only: Sequence[str] | None = None
) -> InputDirectory:
    """Identify one input directory (see the module doc); refuses what cannot be identified.

    A directory with a broken manifest is always refused (never silently re-identified by
    content); one without a manifest only when ``allow_unmanifested`` is false.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise PrepareError(f"{directory}: no such directory; download it first (`qwen38 prepare download`)")
    if not (directory / MANIFEST_NAME).is_file():
        if not allow_unmanifested:
            raise PrepareError(
                f"{directory}: has no {MANIFEST_NAME}, so nothing vouches for its content; a profile prepares "
                "only from verified downloads: fetch it with `qwen38 prepare download` (or `qwen38 prepare "
                "--profile P`)"
            )
        return local_input(directory, role, only=only)
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        raise PrepareError(f"{exc}; the input cannot be identified, so nothing is prepared from it") from None
    check_input_files(directory, manifest)
    ref = InputRef(role=role, identity=manifest.identity, manifest_digest=manifest.digest)
    return InputDirectory(directory, ref, manifest)


def _owned_by(dst: Path, transform: str) -> bool:
    try:
        identity = read_manifest(dst).identity
    except ManifestError:
        return False
    return isinstance(identity, DerivedIdentity) and identity.transform == transform


def clean_staging(dst: Path) -> list[Path]:
    """Remove leftovers of interrupted builds of ``dst`` (and only of ``dst``)."""
    removed = []
    prefix = f".{dst.name}."
    if not dst.parent.is_dir():
        return removed
    for entry in dst.parent.iterdir():
        if entry.name.startswith(prefix) and entry.name.endswith((".incomplete", ".old")):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


@contextlib.contextmanager
def build_lock(dst: Path) -> Iterator[None]:
    """One builder of ``dst`` at a time (a second one fails at once rather than racing)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dst.parent / f".{dst.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(
                f"{dst}: another preparation is writing it (lock {lock_path}); wait for it to finish"
            ) from None
        yield
    finally:
        os.close(fd)


def refuse_overlap(inputs: list[Path], dst: Path) -> None:
    out = dst.resolve()
    for src in inputs:
        inp = src.resolve()
        if out == inp or out.is_relative_to(inp) or inp.is_relative_to(out):
            raise PrepareError(f"--out {dst} overlaps the input {src}; write the prepared model to its own directory")


@dataclass
class Staging:
    """The directory being built; `place` links input files into it and remembers their hashes."""

    path: Path
    linked: dict[str, LinkedFile] = field(default_factory=dict)
    placed: dict[str, str] = field(default_factory=dict)  # file -> hardlink | reflink | copy

    def place(self, source: InputDirectory, rel: str, dest_rel: str | None = None) -> str:
        dest_rel = dest_rel or rel
        how = place_file(source.path / rel, self.path / dest_rel)
        self.placed[dest_rel] = how
        known = source.linked(rel)
        if known is not None and how == "hardlink":
            self.linked[dest_rel] = known
        return how


@contextlib.contextmanager
def derived_directory(dst: Path, identity: DerivedIdentity) -> Iterator[Staging]:
    """Yield a `Staging` that becomes ``dst`` (with its manifest) on a clean exit.

    Call under `build_lock`. Refuses to replace a ``dst`` that another step made. The
    manifest hashes every file written fresh; hard links of verified input files keep
    the input manifest's sha256 (`write_manifest(..., linked=...)`).
    """
    if dst.exists() and not _owned_by(dst, identity.transform):
        raise PrepareError(
            f"{dst}: exists and is not a {identity.transform} output (no matching {MANIFEST_NAME}); "
            "remove it or choose another --out"
        )
    clean_staging(dst)
    with atomic_directory(dst, replace=True) as path:
        stage = Staging(path)
        yield stage
        write_manifest(path, identity, linked=stage.linked)


def place_file(src: Path, dst: Path) -> str:
    """Put ``src``'s bytes at ``dst`` without writing them where possible; returns how.

    A hard link first: no bytes written, and the same inode lets the manifest reuse the
    input's verified sha256 instead of reading the file again. Then a reflink (another
    inode sharing the blocks: hashed like a copy), then a copy.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        before = os.stat(src)
        os.link(src, dst)
        proofs.linked(src, before)  # the link changes the inode's ctime: that change is ours
        return "hardlink"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    with open(src, "rb") as source, open(dst, "wb") as target:
        try:
            fcntl.ioctl(target.fileno(), _FICLONE, source.fileno())
            return "reflink"
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise
    shutil.copyfile(src, dst)
    return "copy"
