"""Manifests: what a model directory holds and where it comes from.

Every directory the server reads carries ``qwen38-manifest.json``::

    {
      "version": 1,
      "identity": {...},                 # core.identity: artifact | derived | generated
      "files": [{"path": "config.json", "size": 1234, "sha256": "<64 hex>"}, ...],
      "digest": "<sha256 of the canonical JSON of version + identity + files>"
    }

It is written last, atomically, and only after the content it describes has been
verified (a download checked against the lock, a transform's output re-read). Files are
every regular file below the directory except the manifest and anything under a hidden
(dot) name: staging leftovers and tool caches live there, and vLLM never reads them.

The ``digest`` makes a hand edit detectable: changing a size or hash without recomputing
the digest fails `read_manifest`. It is also the directory's short identity: derived
directories record their inputs' digests, the stat cache binds its entries to it, and the
served identity string includes it. For an artifact directory the whole manifest follows
from the lock (`artifact_manifest`), so even a consistently re-digested edit is caught
there; see docs/pinning.md for the full argument.

Whether a prepared directory is current - its manifest reads, it is the one wanted, and its
files are still the listed ones - is asked in one place: `current_manifest` / `is_current`
(sizes by default, sha256 for ``--recheck``); `file_mismatches` names what differs for the
steps that refuse an input visibly out of step with its manifest.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from core import progress, proofs
from core.atomic import atomic_write_text, destination_name
from core.errors import PrepareError, VerifyError
from core.hashing import hash_files, sha256_file
from core.identity import SHA256_RE, ArtifactIdentity, DerivedIdentity, GeneratedIdentity, Identity, InputRef, digest_of

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "LinkedFile",
    "Manifest",
    "ManifestError",
    "ManifestFile",
    "FileMismatch",
    "build_manifest",
    "content_files",
    "current_manifest",
    "file_mismatches",
    "files_match",
    "input_ref",
    "is_current",
    "read_manifest",
    "sha256_file",
    "trusted_links",
    "write_manifest",
]

MANIFEST_NAME = "qwen38-manifest.json"
MANIFEST_VERSION = 1

AnyIdentity = ArtifactIdentity | DerivedIdentity | GeneratedIdentity
_IDENTITY = TypeAdapter(Identity)


class ManifestError(VerifyError):
    """A manifest that is missing, malformed or edited by hand."""


def check_relative_path(value: str) -> str:
    """A file path inside a model directory: relative, POSIX, no `..`, no hidden part."""
    path = PurePosixPath(value)
    if not value or value != path.as_posix() or path.is_absolute():
        raise ValueError(f"not a relative POSIX path: {value!r}")
    if any(part in ("..", ".") or part.startswith(".") for part in path.parts):
        raise ValueError(f"path may not contain `..` or hidden parts: {value!r}")
    if value == MANIFEST_NAME:
        raise ValueError(f"{MANIFEST_NAME} cannot list itself")
    return value


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: int = Field(ge=0)
    sha256: str

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_relative_path(value)

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not SHA256_RE.fullmatch(value):
            raise ValueError(f"sha256 must be 64 lowercase hex, got {value!r}")
        return value


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1]
    identity: Identity
    files: tuple[ManifestFile, ...]
    digest: str

    @field_validator("files")
    @classmethod
    def _sorted_unique(cls, files: tuple[ManifestFile, ...]) -> tuple[ManifestFile, ...]:
        paths = [f.path for f in files]
        if paths != sorted(set(paths)):
            raise ValueError("files must be sorted by path, each listed once")
        return files

    def body(self) -> dict[str, Any]:
        """What the digest covers: everything but the digest."""
        return manifest_body(self.identity, self.files)

    def computed_digest(self) -> str:
        return digest_of(self.body())

    def by_path(self) -> dict[str, ManifestFile]:
        return {f.path: f for f in self.files}

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        data = {**self.body(), "digest": self.digest}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def manifest_body(identity: AnyIdentity, files: tuple[ManifestFile, ...] | list[ManifestFile]) -> dict[str, Any]:
    return {
        "version": MANIFEST_VERSION,
        "identity": identity.model_dump(mode="json"),
        "files": [f.model_dump(mode="json") for f in files],
    }


def as_identity(identity: AnyIdentity | Mapping[str, Any]) -> AnyIdentity:
    if isinstance(identity, (ArtifactIdentity, DerivedIdentity, GeneratedIdentity)):
        return identity
    try:
        return _IDENTITY.validate_python(dict(identity))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "identity"
        raise PrepareError(f"manifest identity {where}: {err['msg']}") from None


def build_manifest(identity: AnyIdentity | Mapping[str, Any], files: list[ManifestFile]) -> Manifest:
    """A manifest (with its digest) from an identity and the file entries."""
    ident = as_identity(identity)
    ordered = tuple(sorted(files, key=lambda f: f.path))
    return Manifest(
        version=MANIFEST_VERSION,
        identity=ident,
        files=ordered,
        digest=digest_of(manifest_body(ident, ordered)),
    )


def _is_content(relative: PurePosixPath) -> bool:
    return relative.as_posix() != MANIFEST_NAME and not any(p.startswith(".") for p in relative.parts)


def content_files(directory: Path | str) -> list[Path]:
    """Files a manifest covers: every regular file except the manifest and hidden names, and
    every symlink (a dangling one too: vLLM would try to load it, so it must not pass unseen).

    Hidden directories are not descended into (staging areas can be large).
    """
    directory = Path(directory)
    found: list[Path] = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = Path(root, name)
            is_file = path.is_file() or path.is_symlink()
            if is_file and _is_content(PurePosixPath(path.relative_to(directory).as_posix())):
                found.append(path)
    return sorted(found)


@dataclass(frozen=True)
class LinkedFile:
    """A file placed as a hard link of an input file whose size and sha256 are known.

    ``size`` and ``sha256`` come from the input directory's manifest (written only after
    its content was verified). `write_manifest` takes them instead of hashing the file, but
    only while the file still *is* ``source`` (same device and inode) with that size.
    """

    source: Path
    size: int
    sha256: str


def trusted_links(directory: Path | str, linked: Mapping[str, LinkedFile]) -> dict[str, str]:
    """The sha256 of each ``linked`` file that is still a hard link of its verified source.

    A reflink or copy (another inode), a replaced file or a size change is not trusted:
    those are hashed. Reusing the input manifest's hash cannot launder bad bytes: if the
    shared inode was altered after the input was verified, the new manifest records the
    verified hash, and verification of the new directory fails on that file.
    """
    directory = Path(directory)
    trusted: dict[str, str] = {}
    for rel, known in linked.items():
        try:
            here = os.stat(directory / rel, follow_symlinks=False)
            there = os.stat(known.source, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino) and here.st_size == known.size:
            trusted[rel] = known.sha256
    return trusted


def write_manifest(
    directory: Path | str,
    identity: AnyIdentity | Mapping[str, Any],
    *,
    files: Mapping[str, str] | None = None,
    jobs: int | None = None,
    linked: Mapping[str, LinkedFile] | None = None,
) -> Manifest:
    """Write ``directory``'s manifest, last and atomically; returns it.

    Call it only once the directory's content is verified. ``files`` maps each relative
    path to the sha256 the caller has already checked (a download compared with the
    lock); it must cover exactly the directory's content files. Without it every file is
    hashed here (in parallel), except those ``linked`` names that are still hard links of
    their verified input file (`trusted_links`): a derived directory's untouched shards
    are not read again.
    """
    directory = Path(directory)
    present = {p.relative_to(directory).as_posix(): p for p in content_files(directory)}
    if files is None:
        known = trusted_links(directory, {rel: f for rel, f in (linked or {}).items() if rel in present})
        unknown = [p for rel, p in present.items() if rel not in known]
        with progress.hashing(unknown, f"sha256 {destination_name(directory)}") as bar:
            digests = hash_files(unknown, jobs=jobs, progress=bar.update)
        known.update({rel: digests[p] for rel, p in present.items() if rel not in known})
    else:
        if linked:
            raise ValueError("write_manifest: give `files` (every hash verified) or `linked`, not both")
        if set(files) != set(present):
            missing = sorted(set(files) - set(present))
            extra = sorted(set(present) - set(files))
            raise PrepareError(
                f"{directory}: cannot write the manifest: files expected but absent {missing}, "
                f"present but not verified {extra}"
            )
        known = dict(files)
    entries = [ManifestFile(path=rel, size=present[rel].stat().st_size, sha256=known[rel]) for rel in sorted(present)]
    manifest = build_manifest(identity, entries)
    atomic_write_text(directory / MANIFEST_NAME, manifest.to_json())
    proofs.vouched(directory)
    return manifest


def read_manifest(directory: Path | str) -> Manifest:
    """Read and check ``directory``'s manifest; any problem is one `ManifestError` line."""
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: missing (the directory was never completed and verified); prepare it again"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc}); prepare the directory again") from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise ManifestError(f"{path}: {where}: {err['msg']}; prepare the directory again") from None
    computed = manifest.computed_digest()
    if computed != manifest.digest:
        raise ManifestError(
            f"{path}: edited by hand: its content digests to {computed}, the recorded digest is "
            f"{manifest.digest}; prepare the directory again instead of editing its manifest"
        )
    return manifest


def input_ref(directory: Path | str, role: str) -> InputRef:
    """The `InputRef` of an input directory, read from its (verified) manifest."""
    manifest = read_manifest(directory)
    return InputRef(role=role, identity=manifest.identity, manifest_digest=manifest.digest)


# ---- is a prepared directory current? ---------------------------------------------------


@dataclass(frozen=True)
class FileMismatch:
    """One way a directory's content differs from its manifest's file list (sizes only)."""

    path: str  # relative POSIX path
    expected: int | None  # the listed size; None: a file the manifest does not list
    found: int | None  # the size on disk (through a symlink); None: absent, or a dangling link

    @property
    def kind(self) -> Literal["missing", "size", "extra"]:
        if self.expected is None:
            return "extra"
        return "missing" if self.found is None else "size"

    def describe(self, directory: Path) -> str:
        """One line naming the file and how it differs from ``directory``'s manifest."""
        path, manifest = directory / self.path, directory / MANIFEST_NAME
        if self.kind == "missing":
            return f"{path}: listed in {manifest} but missing"
        if self.kind == "size":
            return f"{path}: size expected {self.expected} (its {MANIFEST_NAME}), found {self.found}"
        return f"{path}: not in {manifest} (expected absent)"


# What `Path.exists` takes for "not there": a missing file or parent, a dangling or looping link.
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)


def _size_on_disk(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError as exc:
        if exc.errno in _ABSENT:
            return None
        raise


def _present(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in content_files(directory)}


def _differences(directory: Path, manifest: Manifest) -> tuple[list[FileMismatch], set[str]]:
    """The size mismatches (listed files in manifest order, then unlisted ones, sorted) and
    the relative paths of the directory's content files."""
    present = _present(directory)
    mismatches = [
        FileMismatch(entry.path, entry.size, found)
        for entry in manifest.files
        if (found := _size_on_disk(directory / entry.path)) != entry.size
    ]
    listed = manifest.by_path()
    mismatches += [FileMismatch(rel, None, None) for rel in sorted(present) if rel not in listed]
    return mismatches, present


def file_mismatches(directory: Path | str, manifest: Manifest) -> list[FileMismatch]:
    """What keeps ``directory`` from holding exactly ``manifest``'s files at their sizes: each
    listed file absent or at another size (in the manifest's order), then each content file
    the manifest does not list (sorted). Hashes are not read."""
    return _differences(Path(directory), manifest)[0]


def files_match(directory: Path | str, manifest: Manifest, *, sha256: bool = False) -> bool:
    """``directory`` holds exactly ``manifest``'s files (no file missing, none unlisted), each at
    its listed size; with ``sha256`` instead each hashing as listed (``--recheck``: every byte
    is read; an unreadable file does not match)."""
    directory = Path(directory)
    if not sha256:
        mismatches, present = _differences(directory, manifest)
        return not mismatches and present == {entry.path for entry in manifest.files}
    paths = {entry.path: directory / entry.path for entry in manifest.files}
    if _present(directory) != set(paths):
        return False  # a file missing, or one the manifest does not list
    try:
        with progress.hashing(list(paths.values()), f"recheck: sha256 of {directory}") as bar:
            found = hash_files(paths.values(), progress=bar.update)
    except OSError:
        return False
    return all(found[paths[entry.path]] == entry.sha256 for entry in manifest.files)


Wanted = AnyIdentity | Manifest | Callable[[Manifest], bool] | None


def _is_wanted(manifest: Manifest, wanted: Wanted) -> bool:
    if wanted is None:
        return True
    if isinstance(wanted, Manifest):
        return manifest.digest == wanted.digest
    if isinstance(wanted, (ArtifactIdentity, DerivedIdentity, GeneratedIdentity)):
        return manifest.identity == wanted
    return bool(wanted(manifest))


def current_manifest(
    directory: Path | str, wanted: Wanted = None, *, sizes: bool = True, sha256: bool = False
) -> Manifest | None:
    """``directory``'s manifest when the directory is current, else None.

    Current: the manifest reads and checks (a missing or broken one is not current); it is
    the one ``wanted`` - an identity (equal), a manifest (the same digest: that identity and
    those files), a predicate on the manifest, or None (any); with ``sizes`` the directory
    holds exactly its files at their sizes (`files_match`); with ``sha256`` also every file
    hashes as listed (after the size check when both are asked).
    """
    try:
        manifest = read_manifest(directory)
    except ManifestError:
        return None
    if not _is_wanted(manifest, wanted):
        return None
    if sizes and not files_match(directory, manifest):
        return None
    if sha256 and not files_match(directory, manifest, sha256=True):
        return None
    return manifest


def is_current(directory: Path | str, wanted: Wanted = None, *, sizes: bool = True, sha256: bool = False) -> bool:
    """Whether ``directory`` is current (`current_manifest`); the skip test of every prepare step."""
    return current_manifest(directory, wanted, sizes=sizes, sha256=sha256) is not None
