"""`qwen38 prepare download`: fetch pinned artifacts, prove them, then write their manifest.

For each artifact (named, or every slot of ``--profile P`` that is an artifact as
downloaded, i.e. ``artifact`` set and ``transform`` unset):

1. refuse an artifact the lock does not fully pin (one line + the command that pins it);
2. skip it when its directory already carries the manifest the lock implies and every
   file has its pinned size (``qwen38 verify`` then proves the content; ``--recheck``
   hashes what is in place instead and fetches again whatever does not match);
3. otherwise drop the old manifest first (the directory is no longer vouched for), hash
   files already present, and check the free disk against what is still missing;
4. fetch each missing file into ``DIR/.qwen38-staging/<sha256>.part`` through
   huggingface_hub, resuming a partial file left by an interrupted run (HTTP Range), hash
   the staged bytes, and only when size and sha256 match the lock fsync and rename the
   file into place; a mismatch discards the staged file and names repo, revision, file,
   expected and found;
5. write the manifest last (`core.manifest.write_manifest`).

Where files land: ``MODELS_DIR/<slot.dir>`` for ``--profile``; ``MODELS_DIR/<artifact
key>`` for an artifact named on the command line (the default directory of every
artifact is its key). A user-supplied (``local``) artifact is copied in from ``--from
PATH`` the same way, or checked in place when its files are already there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from core import progress, proofs
from core.artifact_lock import LOCK_PATH, ArtifactLock, LockedArtifact, LockedFile
from core.errors import DownloadError
from core.hashing import hash_files, sha256_file
from core.manifest import MANIFEST_NAME, Manifest, content_files, is_current, write_manifest
from prepare.hub import download_resumable

STAGING_DIR = ".qwen38-staging"
LOCK_FILE = ".qwen38-download.lock"


@dataclass(frozen=True)
class DownloadTarget:
    artifact: str
    dir: str


def default_dir(artifact_key: str) -> str:
    """Where an artifact named on the command line lands under MODELS_DIR: its key."""
    return artifact_key


def targets_for_profile(profile) -> list[DownloadTarget]:
    """Every slot of ``profile`` that is an artifact as downloaded (no transform, not generated)."""
    slots = [profile.models.target, profile.models.drafter, profile.models.adapter]
    return [
        DownloadTarget(slot.artifact, slot.dir)
        for slot in slots
        if slot is not None and slot.artifact is not None and slot.transform is None
    ]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _exclusive(dest: Path) -> Iterator[None]:
    """One download per directory at a time (two would share staging files)."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / LOCK_FILE, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DownloadError(f"{dest}: another `qwen38 prepare download` is writing here; wait for it") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def free_bytes(path: Path) -> int:
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def check_free_disk(dest: Path, needed: int, what: str) -> None:
    free = free_bytes(dest)
    if needed > free:
        raise DownloadError(
            f"{dest}: {what} needs {needed / 1e9:.2f} GB more on disk, {free / 1e9:.2f} GB are free; "
            "free space or point MODELS_DIR at a larger disk"
        )


Fetch = Callable[[LockedFile, Path], None]


def seed_candidates(artifact: LockedArtifact, entry: LockedFile, seed_dir: Path) -> list[Path]:
    """Where a file of ``artifact`` may already lie under ``seed_dir``, with the pinned size.

    A Hugging Face cache (``seed_dir`` is ``HF_HOME`` or its ``hub/``): the snapshot of the
    pinned commit, or the blob named by the file's LFS sha256; or a folder of downloaded files:
    ``seed_dir/<artifact key>/``, ``seed_dir/<repo name>/``, ``seed_dir/<owner>/<repo name>/`` or
    ``seed_dir/`` itself. Nothing is trusted for its place: the caller keeps a candidate only
    when its sha256 is the pinned one.
    """
    owner, _, name = (artifact.repo or "").partition("/")
    places = []
    for cache in (seed_dir, seed_dir / "hub"):
        repo_dir = cache / f"models--{owner}--{name}"
        places += [repo_dir / "snapshots" / str(artifact.revision) / entry.path, repo_dir / "blobs" / entry.sha256]
    for base in (seed_dir / artifact.key, seed_dir / name, seed_dir / owner / name, seed_dir):
        places.append(base / entry.path)
    found: list[Path] = []
    for place in places:
        try:
            if place.is_file() and place.stat().st_size == entry.size and place.resolve() not in found:
                found.append(place.resolve())
        except OSError:
            continue
    return found


def _copy_hashing(src: Path, staging: Path) -> str:
    """Copy ``src`` to ``staging`` and return the sha256 of the bytes copied (one read)."""
    digest = hashlib.sha256()
    staging.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as reader, open(staging, "wb") as writer:
        while chunk := reader.read(1 << 22):
            digest.update(chunk)
            writer.write(chunk)
    return digest.hexdigest()


def _seeded(artifact: LockedArtifact, seed_dir: Path, fallback: Fetch, say: Callable[[str], None]) -> Fetch:
    """Take each file from ``seed_dir`` where a copy with the pinned sha256 lies there, else ``fallback``."""

    def fetch(entry: LockedFile, staging: Path) -> None:
        for candidate in seed_candidates(artifact, entry, seed_dir):
            found = _copy_hashing(candidate, staging)
            if found == entry.sha256:
                say(f"{artifact.key}: {entry.path} taken from {candidate} (its sha256 is the pinned one)")
                return
            staging.unlink(missing_ok=True)
            say(f"{artifact.key}: {candidate} is not the pinned {entry.path} (sha256 {found}); not used")
        fallback(entry, staging)

    return fetch


def _hub_fetch(artifact: LockedArtifact, endpoint: str | None) -> Fetch:
    def fetch(entry: LockedFile, staging: Path) -> None:
        try:
            download_resumable(
                repo=artifact.repo,  # type: ignore[arg-type]
                revision=artifact.revision,  # type: ignore[arg-type]
                path=entry.path,
                size=entry.size,
                sha256=entry.sha256,
                staging=staging,
                endpoint=endpoint,
            )
        except DownloadError as exc:
            kept = staging.stat().st_size if staging.exists() else 0
            note = f"; {kept} bytes kept in {staging}, the next run resumes there" if kept else ""
            raise DownloadError(f"{exc}{note}") from None

    return fetch


def _local_fetch(artifact: LockedArtifact, source: Path) -> Fetch:
    files = artifact.require_pinned()

    def fetch(entry: LockedFile, staging: Path) -> None:
        src = source if (source.is_file() and len(files) == 1) else source / entry.path
        if not src.is_file():
            raise DownloadError(f"--from {source}: {entry.path} not found there (artifact {artifact.key})")
        staging.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, staging)

    return fetch


def _where(artifact: LockedArtifact, path: str) -> str:
    if artifact.source == "hub":
        return f"{artifact.repo}@{artifact.revision}/{path}"
    return f"{artifact.key} (local)/{path}"


def download_artifact(
    artifact: LockedArtifact,
    dest: Path,
    *,
    endpoint: str | None = None,
    source: Path | None = None,
    seed_dir: Path | None = None,
    prune: bool = False,
    recheck: bool = False,
    jobs: int | None = None,
    lock_path: Path | str = LOCK_PATH,
    say: Callable[[str], None] = progress.say,
) -> Manifest:
    """Make ``dest`` hold exactly the pinned ``artifact`` and its manifest (see the module doc)."""
    files = artifact.require_pinned(lock_path)
    expected = artifact.expected_manifest()
    dest = Path(dest)
    if not recheck and is_current(dest, expected):
        say(f"{artifact.key}: {dest} is up to date ({len(files)} files)")
        return expected

    with _exclusive(dest):
        # From here on the directory is not vouched for until the new manifest is written.
        (dest / MANIFEST_NAME).unlink(missing_ok=True)

        pinned = {f.path: f for f in files}
        present = {p.relative_to(dest).as_posix(): p for p in content_files(dest)}
        extra = sorted(set(present) - set(pinned))
        if extra and not prune:
            raise DownloadError(
                f"{dest}: holds files the lock does not list for {artifact.key}: {', '.join(extra[:5])}"
                f"{' ...' if len(extra) > 5 else ''}; remove them or pass --prune"
            )
        for rel in extra:
            present.pop(rel).unlink()
            say(f"{artifact.key}: removed {rel} (not in the lock)")

        # Files already in place count only when their bytes are the pinned ones.
        sized = [p for rel, p in present.items() if p.stat().st_size == pinned[rel].size]
        total = sum(p.stat().st_size for p in sized)
        with progress.Progress(f"{artifact.key}: sha256 of the files already in place", total) as bar:
            digests = hash_files(sized, jobs=jobs, progress=bar.update)
        good = {
            rel for rel, p in present.items() if p in digests and digests[p] == pinned[rel].sha256
        }
        pending = [f for f in files if f.path not in good]

        staging_dir = dest / STAGING_DIR
        staged = {
            f.path: (staging_dir / f"{f.sha256}.part").stat().st_size
            for f in pending
            if (staging_dir / f"{f.sha256}.part").exists()
        }
        needed = sum(max(f.size - min(staged.get(f.path, 0), f.size), 0) for f in pending)
        check_free_disk(dest, needed, f"{artifact.key} ({len(pending)} files)")

        if artifact.source == "hub":
            fetch = _hub_fetch(artifact, endpoint)
            if seed_dir is not None and pending:
                fetch = _seeded(artifact, Path(seed_dir), fetch, say)
        elif source is not None:
            fetch = _local_fetch(artifact, source)
        elif pending:
            first = pending[0]
            raise DownloadError(
                f"{dest / first.path}: missing or not the pinned file (sha256 {first.sha256}, "
                f"{first.size} bytes) of user-supplied artifact {artifact.key}; copy it there or pass "
                f"--from PATH"
            )
        else:
            fetch = None

        for index, entry in enumerate(pending, 1):
            staging = staging_dir / f"{entry.sha256}.part"
            resumed = staged.get(entry.path, 0)
            note = f", resuming at {resumed / 1e9:.2f} GB" if 0 < resumed < entry.size else ""
            say(f"{artifact.key}: [{index}/{len(pending)}] {entry.path} ({entry.size / 1e9:.2f} GB{note})")
            # The hub draws its own bar in a terminal; without one, lines from the staging file's size.
            with progress.watching(staging, f"{artifact.key}: download {entry.path}", entry.size, bar=False):
                fetch(entry, staging)  # type: ignore[misc]
            # Staged bytes are ours alone: what is hashed here is what was written (`core.proofs`).
            with proofs.written_here(staging_dir), progress.Progress(f"{artifact.key}: sha256 {entry.path}",
                                                                     entry.size) as bar:
                found = sha256_file(staging, bar.update)
            size = staging.stat().st_size
            if size != entry.size or found != entry.sha256:
                staging.unlink(missing_ok=True)  # wrong bytes are never resumed from
                raise DownloadError(
                    f"{_where(artifact, entry.path)}: sha256 expected {entry.sha256} ({entry.size} bytes), "
                    f"found {found} ({size} bytes); the download was discarded, nothing was installed"
                )
            final = dest / entry.path
            final.parent.mkdir(parents=True, exist_ok=True)
            _fsync_path(staging)
            os.replace(staging, final)
            _fsync_path(final.parent)

        with contextlib.suppress(OSError):
            staging_dir.rmdir()
        manifest = write_manifest(dest, artifact.identity(), files={f.path: f.sha256 for f in files})
        if manifest.digest != expected.digest:  # the files on disk have other sizes than pinned
            (dest / MANIFEST_NAME).unlink(missing_ok=True)
            raise DownloadError(f"{dest}: the verified files do not form the pinned manifest; run again")
        say(f"{artifact.key}: {dest} verified, {len(files)} files, {artifact.total_size / 1e9:.2f} GB")
        return manifest


def resolve_targets(
    profile_name: str | None, artifact_keys: list[str], lock: ArtifactLock, lock_path: Path, profiles_dir: Path
) -> list[DownloadTarget]:
    """What `qwen38 prepare download` fetches: the ARTIFACTs named, or every downloaded slot of
    profile ``profile_name`` (not both), each known to the lock."""
    from core import profiles  # the profile files are read only for --profile

    if profile_name and artifact_keys:
        raise DownloadError("name artifacts or --profile, not both")
    if profile_name:
        profile = profiles.load_profile(profile_name, profiles_dir)
        targets = targets_for_profile(profile)
        if not targets:
            raise DownloadError(f"profile {profile_name} downloads nothing (its models are generated or derived)")
    elif artifact_keys:
        targets = [DownloadTarget(key, default_dir(key)) for key in artifact_keys]
    else:
        raise DownloadError("name the ARTIFACTs to download, or --profile P")
    for target in targets:
        lock.get(target.artifact, lock_path)
    return targets
