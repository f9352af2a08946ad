"""Pinning artifacts: reading a pin from the hub, from the owner's own files, or at first use.

- `pin_hub_artifact`: every file of a repo at one commit (a branch or tag is resolved to its
  commit), each with its size and sha256: the LFS sha256 the hub lists for that commit, or,
  for small files kept in git, the sha256 of the bytes fetched at that commit (checked
  against the git blob id the hub lists). `qwen38 lock update` writes it into the repository
  lock; `pin_at_first_use` into the machine-local one.
- `pin_local_artifact`: a user-supplied artifact pinned by hashing the user's own files.
- `pin_at_first_use`: what `qwen38 prepare` does for an artifact the repository lock pins by
  commit only (or not at all, when the owner set ALLOW_BRANCH_HEAD): read the listing, check it
  against every hash the repository lock names (``known``), record it in MODELS_DIR's
  machine-local lock, and say so in one line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from core import progress
from core.artifact_lock import LOCK_PATH, UNPINNED, LockedArtifact, LockedFile, agree_with_known, record_local_pin
from core.errors import ArtifactError
from core.hashing import hash_files, sha256_file
from core.manifest import content_files
from prepare import hub

BRANCH_HEAD = "main"
"""The branch an owner's ALLOW_BRANCH_HEAD resolves (huggingface_hub's default revision)."""


def _is_hidden(path: str) -> bool:
    return any(part.startswith(".") for part in path.split("/"))


def pin_hub_artifact(
    artifact: LockedArtifact, *, revision: str | None = None, endpoint: str | None = None
) -> LockedArtifact:
    """``artifact`` with its revision resolved to a commit and every file pinned from the hub."""

    if artifact.source != "hub":
        raise ArtifactError(f"artifact {artifact.key} is local: pin it with `{artifact.pin_command()}`")
    wanted = revision or artifact.revision
    if wanted is None or wanted == UNPINNED:
        raise ArtifactError(
            f"artifact {artifact.key} has no revision to pin; pass `--revision COMMIT` (a branch is resolved)"
        )
    remote = hub.list_revision(artifact.repo, wanted, endpoint=endpoint)  # type: ignore[arg-type]
    files: list[LockedFile] = []
    for entry in remote.files:
        if _is_hidden(entry.path) or artifact.excludes(entry.path):
            continue
        if entry.lfs_sha256 is not None:
            files.append(LockedFile(path=entry.path, size=entry.size, sha256=entry.lfs_sha256))
        else:
            repo: str = artifact.repo  # type: ignore[assignment]
            data = hub.fetch_small_file(repo, remote.commit, entry, endpoint=endpoint)
            files.append(LockedFile(path=entry.path, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    if not files:
        raise ArtifactError(f"{artifact.repo}@{remote.commit}: no files to pin (all hidden or excluded)")
    agree_with_known(artifact, tuple(files), f"{artifact.repo}@{remote.commit}")
    return artifact.model_copy(update={"revision": remote.commit, "files": tuple(sorted(files, key=lambda f: f.path))})


def pin_local_artifact(artifact: LockedArtifact, source: Path) -> LockedArtifact:
    """``artifact`` pinned to the sha256 of the user's own file (or every file of a directory)."""
    if artifact.source != "local":
        raise ArtifactError(f"artifact {artifact.key} comes from the hub; `--from` pins local artifacts only")
    if source.is_file():
        files = [LockedFile(path=source.name, size=source.stat().st_size, sha256=sha256_file(source))]
    elif source.is_dir():
        paths = content_files(source)
        if not paths:
            raise ArtifactError(f"--from {source}: the directory holds no files")
        digests = hash_files(paths)
        files = [
            LockedFile(path=p.relative_to(source).as_posix(), size=p.stat().st_size, sha256=digests[p])
            for p in paths
        ]
    else:
        raise ArtifactError(f"--from {source}: no such file or directory")
    return artifact.model_copy(update={"files": tuple(sorted(files, key=lambda f: f.path))})


def describe_change(old: LockedArtifact, new: LockedArtifact) -> str:
    before = {} if isinstance(old.files, str) else {f.path: f for f in old.files}
    after = {f.path: f for f in new.files}  # type: ignore[union-attr]
    added = len(set(after) - set(before))
    removed = len(set(before) - set(after))
    changed = sum(1 for p in set(after) & set(before) if after[p] != before[p])
    rev = f" @ {new.revision}" if new.revision else ""
    return (
        f"{new.key}{rev}: {len(after)} files, {new.total_size / 1e9:.2f} GB pinned "
        f"(+{added} added, -{removed} removed, {changed} changed)"
    )


def check_pinnable(artifact: LockedArtifact, lock_path: Path | str = LOCK_PATH, *, allow_branch_head: bool = False) -> None:
    """Refuse (one `ArtifactError` line, before any request) what prepare can neither download
    as pinned nor pin itself: a hub artifact with no revision (unless ``allow_branch_head``), a
    user-supplied one whose files are unpinned. A commit whose files are read at first use passes."""
    if artifact.source == "hub" and artifact.revision == UNPINNED:
        if not allow_branch_head:
            raise ArtifactError(
                f"{lock_path}: artifact {artifact.key} ({artifact.repo}) names no revision, and a branch is not a "
                f"pin: pin a commit with `qwen38 lock update {artifact.key} --revision COMMIT`, or set "
                f"ALLOW_BRANCH_HEAD=true to let prepare resolve its {BRANCH_HEAD} branch once and record the "
                "commit on this machine"
            )
        return
    if not artifact.pinned_at_first_use:
        artifact.require_pinned(lock_path)


def pin_at_first_use(
    artifact: LockedArtifact,
    models_dir: Path | str,
    *,
    allow_branch_head: bool = False,
    endpoint: str | None = None,
    lock_path: Path | str = LOCK_PATH,
    say: Callable[[str], None] = progress.say,
) -> LockedArtifact:
    """``artifact`` with every file pinned: as the repository lock has it, or read from the hub now.

    A hub artifact pinned by commit only is listed at that commit; one with no revision only
    with ``allow_branch_head`` (its branch head resolved once). The listing must agree with each
    hash the repository lock names; it is recorded in MODELS_DIR's machine-local lock before a
    byte is downloaded, so every later start verifies against it.
    """
    if artifact.is_pinned:
        return artifact
    check_pinnable(artifact, lock_path, allow_branch_head=allow_branch_head)  # a local one raises, naming --from
    by_owner = artifact.revision == UNPINNED
    pinned = pin_hub_artifact(artifact, revision=BRANCH_HEAD if by_owner else None, endpoint=endpoint)
    recorded = pinned.model_copy(
        update={
            "known": (),
            "pinned_by": "owner" if by_owner else "first-use",
            "pinned_at": datetime.now(UTC).replace(microsecond=0).isoformat(),
        }
    )
    where = record_local_pin(models_dir, recorded)
    how = f"its {BRANCH_HEAD} branch is at commit {pinned.revision}" if by_owner else f"commit {pinned.revision}"
    agreed = f", {len(artifact.known)} agree with the repository lock's hashes" if artifact.known else ""
    say(
        f"{artifact.key}: pinned {len(recorded.files)} files ({recorded.total_size / 1e9:.2f} GB) of {artifact.repo} "  # type: ignore[arg-type]
        f"from the hub's listing: {how}{agreed}; recorded in {where}"
    )
    return recorded
