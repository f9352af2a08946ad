"""The artifact lock: ``profiles/artifacts.lock.toml``, reviewed like code.

Every artifact a profile can use has one entry, keyed by its artifact key::

    [artifacts."qwen3.8-27b-nvfp4"]
    source = "hub"                                   # or "local": user-supplied files
    repo = "RadixArk/Qwen3.8-27B-NVFP4"
    revision = "319f741cce68d7914884900c138a1fbb70a42f30"
    note = "DGX Spark target"
    exclude = ["*.md"]                               # optional: repo files we never fetch
    files = [
      { path = "config.json", size = 1234, sha256 = "<64 lowercase hex>" },
      ...
    ]

``revision`` (hub) and ``files`` may hold the marker string ``"UNPINNED"``: the value is
not known yet. Nothing is ever taken on trust:

- a hub artifact whose ``revision`` is a commit but whose ``files`` are ``"UNPINNED"`` is
  pinned at first use: prepare reads that commit's file list and LFS sha256 from the hub (a
  commit id is content-addressed, so this is a pin, not trust in a branch) and records them
  in the machine-local lock beside the models (`LOCAL_LOCK_NAME` in MODELS_DIR), never in
  this file; ``known`` lists hashes published elsewhere that the hub's listing must agree
  with (a disagreement is refused with both values);
- a hub artifact with no revision (``"UNPINNED"``) is refused unless the owner opts in
  (ALLOW_BRANCH_HEAD): its main branch is then resolved once to a commit, which is printed
  and recorded in the machine-local lock;
- a hash this file names always wins over the machine-local lock. A ``local`` artifact (the adapter's directions file, which has no
public repo) has no repo/revision: its files' sizes and sha256 are the whole pin, filled
by ``qwen38 lock update KEY --from PATH`` from the user's own copy.

`load_lock` validates the whole file (one `ArtifactError` line on any problem);
`render_lock` writes it back in one canonical layout, so updates make small diffs.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.atomic import atomic_write_text
from core.errors import ArtifactError
from core.identity import ARTIFACT_KEY_RE, COMMIT_RE, ArtifactIdentity
from core.manifest import Manifest, ManifestFile, build_manifest

LOCK_PATH = Path(__file__).resolve().parent.parent / "profiles" / "artifacts.lock.toml"
LOCK_VERSION = 1
LOCAL_LOCK_NAME = "artifacts.local.toml"
"""The machine-local lock in MODELS_DIR: pins read from the hub at first use, never reviewed."""
UNPINNED = "UNPINNED"
"""The explicit marker for a revision or a file list that is not pinned yet."""

Unpinned = Literal["UNPINNED"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LockedFile(ManifestFile):
    """One file of a pinned artifact: its path in the repo, size and sha256 (the fields
    and checks of a manifest entry, which is what verification compares it with)."""


class LockedArtifact(_Strict):
    """One artifact: where it comes from and, once pinned, every file's size and sha256."""

    key: str
    source: Literal["hub", "local"]
    repo: str | None = None
    revision: str | Unpinned | None = None
    note: str = ""
    exclude: tuple[str, ...] = Field(
        default=(), description="Glob patterns of repo files never fetched (matched on the path)."
    )
    files: tuple[LockedFile, ...] | Unpinned = UNPINNED
    known: tuple[LockedFile, ...] = Field(
        default=(),
        description="Files whose size and sha256 are published elsewhere, for an artifact whose file list is "
        "read from the hub at first use: the hub's listing must agree with each.",
    )
    pinned_by: Literal["first-use", "owner"] | None = Field(
        default=None, description="Machine-local lock only: who pinned it (first use of a commit, or the owner's opt-in)."
    )
    pinned_at: str | None = Field(default=None, description="Machine-local lock only: when (UTC, ISO 8601).")

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not ARTIFACT_KEY_RE.fullmatch(value):
            raise ValueError(f"artifact keys are lowercase letters, digits, `.`, `-`, `_`; got {value!r}")
        return value

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        if value is not None and value != UNPINNED and not COMMIT_RE.fullmatch(value):
            raise ValueError(f"revision must be a 40-hex commit or {UNPINNED!r}, got {value!r}")
        return value

    @field_validator("files", mode="before")
    @classmethod
    def _list_or_marker(cls, value: object) -> object:
        if isinstance(value, str) and value != UNPINNED:
            raise ValueError(f"files must be a list of {{path, size, sha256}} or {UNPINNED!r}, got {value!r}")
        return value

    @field_validator("files")
    @classmethod
    def _sorted_unique(cls, files: tuple[LockedFile, ...] | str) -> tuple[LockedFile, ...] | str:
        if isinstance(files, str):
            return files
        paths = [f.path for f in files]
        if len(set(paths)) != len(paths):
            raise ValueError(f"a file is listed twice: {sorted(p for p in paths if paths.count(p) > 1)[0]}")
        if not files:
            raise ValueError(f"an empty file list pins nothing; use {UNPINNED!r}")
        return tuple(sorted(files, key=lambda f: f.path))

    @field_validator("known")
    @classmethod
    def _known_sorted(cls, files: tuple[LockedFile, ...]) -> tuple[LockedFile, ...]:
        return tuple(sorted(files, key=lambda f: f.path))

    @model_validator(mode="after")
    def _source_fields(self) -> LockedArtifact:
        if self.source == "hub":
            if not self.repo or "/" not in self.repo:
                raise ValueError("a hub artifact needs `repo` as `owner/name`")
            if self.revision is None:
                raise ValueError(f"a hub artifact needs `revision` (a 40-hex commit, or {UNPINNED!r})")
        elif self.repo is not None or self.revision is not None:
            raise ValueError("a local artifact has no `repo`/`revision`: its files' sha256 pin it")
        if self.known and self.source != "hub":
            raise ValueError("`known` belongs to a hub artifact (hashes public sources record for its files)")
        paths = [f.path for f in self.known]
        if len(set(paths)) != len(paths):
            raise ValueError("a file is listed twice in `known`")
        if not isinstance(self.files, str):
            problem = known_disagreement(self.known, self.files, "files")
            if problem is not None:
                raise ValueError(problem)
        return self

    # -- pin state --------------------------------------------------------------------

    @property
    def pinned_at_first_use(self) -> bool:
        """A hub commit is pinned, its files are read from the hub's listing of it at first use."""
        return self.source == "hub" and self.revision != UNPINNED and self.files == UNPINNED

    @property
    def provenance(self) -> str:
        """Where the pin comes from, as `qwen38 lock show` says it."""
        if self.pinned_by == "first-use":
            return f"first use ({self.pinned_at}): the hub's listing of the locked commit"
        if self.pinned_by == "owner":
            return f"owner ({self.pinned_at}): ALLOW_BRANCH_HEAD resolved the branch head"
        if self.is_pinned:
            return "repository lock"
        if self.pinned_at_first_use:
            return "repository lock (commit); files pinned at first prepare"
        return "not pinned"

    def pin_command(self) -> str:
        if self.source == "local":
            return f"qwen38 lock update {self.key} --from PATH"
        if self.revision == UNPINNED:
            return f"qwen38 lock update {self.key} --revision COMMIT"
        return f"qwen38 lock update {self.key}"

    def unpinned(self) -> str | None:
        """What is not pinned (None when everything is)."""
        if self.source == "hub" and self.revision == UNPINNED:
            return "its revision is UNPINNED"
        if self.pinned_at_first_use:
            return "its files are pinned at first use, and this machine has not recorded them yet"
        if self.files == UNPINNED:
            return "its file sizes and sha256 are UNPINNED"
        return None

    @property
    def is_pinned(self) -> bool:
        return self.unpinned() is None

    def require_pinned(self, lock_path: Path | str = LOCK_PATH, *, prepare: str | None = None) -> tuple[LockedFile, ...]:
        """The pinned files, or one `ArtifactError` line naming what is missing and the fix.

        ``prepare`` is the command that pins a first-use artifact where the caller knows it
        (``qwen38 prepare --profile P``)."""
        what = self.unpinned()
        if what is not None and self.pinned_at_first_use:
            fix = prepare or f"qwen38 prepare download {self.key}"
            raise ArtifactError(
                f"{lock_path}: artifact {self.key} pins commit {self.revision} of {self.repo}; its files are read "
                f"from the hub's listing of that commit at first use, and this machine has not recorded them yet: "
                f"run `{fix}`"
            )
        if what is not None:
            raise ArtifactError(
                f"{lock_path}: artifact {self.key} is not pinned ({what}); pin it with "
                f"`{self.pin_command()}` and commit the lock"
            )
        return self.files  # type: ignore[return-value]

    def excludes(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.exclude)

    # -- identity ---------------------------------------------------------------------

    def identity(self) -> ArtifactIdentity:
        """The identity a directory holding exactly this artifact carries (pinned only)."""
        self.require_pinned()
        return ArtifactIdentity(artifact=self.key, source=self.source, repo=self.repo, revision=self.revision)

    def expected_manifest(self) -> Manifest:
        """The manifest a verified directory of this artifact must carry, derived from the lock.

        Downloads write exactly this; verification compares against it, so a manifest
        edited by hand (even with a recomputed digest) cannot pass for a pinned artifact.
        """
        files = self.require_pinned()
        return build_manifest(
            self.identity(), [ManifestFile(path=f.path, size=f.size, sha256=f.sha256) for f in files]
        )

    @property
    def total_size(self) -> int:
        return 0 if isinstance(self.files, str) else sum(f.size for f in self.files)


def known_disagreement(known: tuple[LockedFile, ...], files: tuple[LockedFile, ...], where: str) -> str | None:
    """What in ``files`` contradicts a size or sha256 of ``known`` (None: nothing)."""
    listed = {f.path: f for f in files}
    for entry in known:
        found = listed.get(entry.path)
        if found is None:
            return f"{where}/{entry.path}: the repository lock names this file; the listing has no such file"
        for field in ("sha256", "size"):
            if getattr(found, field) != getattr(entry, field):
                return (
                    f"{where}/{entry.path}: {field} the repository lock names {getattr(entry, field)}, the listing "
                    f"has {getattr(found, field)}; refusing"
                )
    return None


def agree_with_known(artifact: LockedArtifact, files: tuple[LockedFile, ...], where: str) -> None:
    """Refuse (one `ArtifactError` line, both values) a file list contradicting the repository lock."""
    problem = known_disagreement(artifact.known, files, where)
    if problem is not None:
        raise ArtifactError(problem)


class ArtifactLock(_Strict):
    version: Literal[1] = LOCK_VERSION
    artifacts: dict[str, LockedArtifact]

    def get(self, key: str, lock_path: Path | str = LOCK_PATH) -> LockedArtifact:
        try:
            return self.artifacts[key]
        except KeyError:
            known = ", ".join(sorted(self.artifacts)) or "none"
            raise ArtifactError(f"{lock_path}: no artifact {key!r}; known artifacts: {known}") from None

    def with_artifact(self, artifact: LockedArtifact) -> ArtifactLock:
        return ArtifactLock(version=self.version, artifacts={**self.artifacts, artifact.key: artifact})


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # pydantic reports a union's branches (`tuple[...]`, `literal[...]`); name the field only.
    loc = [p for p in loc if not p.startswith(("tuple[", "literal[", "function-"))]
    where = ".".join(loc) or "(top level)"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"


def parse_lock(text: str, lock_path: Path | str = LOCK_PATH, *, local: bool = False) -> ArtifactLock:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ArtifactError(f"{lock_path}: not valid TOML: {exc}") from None
    artifacts = data.get("artifacts")
    if not isinstance(artifacts, dict):
        raise ArtifactError(f"{lock_path}: no [artifacts.KEY] table")
    try:
        entries = {}
        for key, entry in artifacts.items():
            if not isinstance(entry, dict):
                raise ArtifactError(f"{lock_path}: artifacts.{key}: expected a table")
            try:
                entries[key] = LockedArtifact.model_validate({**entry, "key": key})
            except ValidationError as exc:
                raise ArtifactError(f"{lock_path}: artifacts.{key}.{_first_error(exc)}") from None
            _check_origin(entries[key], lock_path, local)
        return ArtifactLock.model_validate({"version": data.get("version"), "artifacts": entries})
    except ValidationError as exc:
        raise ArtifactError(f"{lock_path}: {_first_error(exc)}") from None


def _check_origin(artifact: LockedArtifact, lock_path: Path | str, local: bool) -> None:
    """`pinned_by`/`pinned_at` are what the machine-local lock records, and all it holds are such pins."""
    if not local and (artifact.pinned_by or artifact.pinned_at):
        raise ArtifactError(
            f"{lock_path}: artifacts.{artifact.key}: pinned_by/pinned_at belong to the machine-local lock "
            f"({LOCAL_LOCK_NAME} in MODELS_DIR), not the repository's"
        )
    if local and (artifact.source != "hub" or not artifact.pinned_by or not artifact.is_pinned):
        raise ArtifactError(
            f"{lock_path}: artifacts.{artifact.key}: not a pin this machine recorded (a hub commit, every file, "
            "pinned_by); delete the file and run prepare again: it reads the pins from the hub anew"
        )


def load_lock(path: Path | str = LOCK_PATH) -> ArtifactLock:
    """Read and validate the lock; any problem is one `ArtifactError` line naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"{path}: the artifact lock is missing") from None
    return parse_lock(text, path)


# -- the machine-local lock --------------------------------------------------------------


def local_lock_path(models_dir: Path | str) -> Path:
    return Path(models_dir) / LOCAL_LOCK_NAME


def load_local_lock(models_dir: Path | str) -> ArtifactLock:
    """The pins this machine recorded at first use (empty when it recorded none)."""
    path = local_lock_path(models_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ArtifactLock(artifacts={})
    return parse_lock(text, path, local=True)


def apply_local_pin(artifact: LockedArtifact, local: LockedArtifact | None, local_path: Path | str) -> LockedArtifact:
    """``artifact`` as this machine serves it: the repository's pin, completed by the local one.

    The repository's hashes always win: a fully pinned artifact ignores the local lock; a
    local pin of another repo or commit (the repository lock moved on) is stale and ignored,
    so the next prepare reads the new commit; a local pin that contradicts a hash the
    repository names is refused with both values.
    """
    if artifact.is_pinned or local is None or artifact.source != "hub" or local.repo != artifact.repo:
        return artifact
    if artifact.revision != UNPINNED and local.revision != artifact.revision:
        return artifact
    if artifact.revision == UNPINNED and local.pinned_by != "owner":
        return artifact
    files = tuple(f for f in local.files if not artifact.excludes(f.path))  # type: ignore[union-attr]
    agree_with_known(artifact, files, f"{local_path}: {artifact.repo}@{local.revision}")
    return artifact.model_copy(
        update={
            "revision": local.revision,
            "files": files,
            "known": (),
            "pinned_by": local.pinned_by,
            "pinned_at": local.pinned_at,
        }
    )


def effective_lock(lock: ArtifactLock, models_dir: Path | str) -> ArtifactLock:
    """The repository's lock with the pins this machine recorded in MODELS_DIR applied."""
    local = load_local_lock(models_dir)
    path = local_lock_path(models_dir)
    return ArtifactLock(
        version=lock.version,
        artifacts={key: apply_local_pin(art, local.artifacts.get(key), path) for key, art in lock.artifacts.items()},
    )


def record_local_pin(models_dir: Path | str, artifact: LockedArtifact) -> Path:
    """Write ``artifact`` (a hub commit, every file, ``pinned_by``) into the machine-local lock."""
    path = local_lock_path(models_dir)
    local = load_local_lock(models_dir).with_artifact(artifact.model_copy(update={"known": (), "exclude": ()}))
    Path(models_dir).mkdir(parents=True, exist_ok=True)
    write_lock(local, path, local=True)
    return path


# -- writing --------------------------------------------------------------------------

_HEADER = """\
# qwen38-stack artifact lock: every artifact a profile may serve or prepare from,
# pinned to a Hugging Face commit and to each file's size and sha256 (the LFS sha256 the
# hub publishes for that commit). Reviewed like code; docs/pinning.md explains it.
#
# Written by `qwen38 lock update KEY [--revision COMMIT | --from PATH]`, which keeps one
# canonical layout: edit `repo`, `revision`, `note` and `exclude` by hand if you like,
# then run it to refill `files`. "UNPINNED" marks a value not known yet. A hub commit whose
# `files` are UNPINNED is pinned at first use: prepare reads that commit's file list and LFS
# sha256 from the hub, checks them against `known` (hashes public sources record), and records
# them in MODELS_DIR/artifacts.local.toml. Anything else UNPINNED is refused by downloads and
# `qwen38 verify`, which print the command that pins it.
"""

_LOCAL_HEADER = """\
# qwen38-stack machine-local artifact lock: pins this machine read from the hub at first use
# (the listing of a commit the repository lock names) or by the owner's ALLOW_BRANCH_HEAD.
# Written by `qwen38 prepare`; the repository's profiles/artifacts.lock.toml always wins.
# `qwen38 lock show` says where each pin came from. Delete an entry to read it anew.
"""


def _toml_str(value: str) -> str:
    out = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{out}"'


def _render_files(name: str, files: tuple[LockedFile, ...]) -> list[str]:
    lines = [f"{name} = ["]
    for f in files:
        lines.append(f"  {{ path = {_toml_str(f.path)}, size = {f.size}, sha256 = {_toml_str(f.sha256)} }},")
    return [*lines, "]"]


def render_lock(lock: ArtifactLock, *, local: bool = False) -> str:
    """The lock as TOML, in the one layout `qwen38 lock update` (or prepare, for the local lock) writes."""
    header = _LOCAL_HEADER if local else _HEADER
    lines = [header.rstrip("\n"), "", f"version = {lock.version}"]
    for key in sorted(lock.artifacts):
        art = lock.artifacts[key]
        lines += ["", f"[artifacts.{_toml_str(key)}]", f"source = {_toml_str(art.source)}"]
        if art.repo is not None:
            lines.append(f"repo = {_toml_str(art.repo)}")
        if art.revision is not None:
            lines.append(f"revision = {_toml_str(art.revision)}")
        if art.note:
            lines.append(f"note = {_toml_str(art.note)}")
        if art.exclude:
            lines.append("exclude = [" + ", ".join(_toml_str(p) for p in art.exclude) + "]")
        if art.pinned_by is not None:
            lines.append(f"pinned_by = {_toml_str(art.pinned_by)}")
        if art.pinned_at is not None:
            lines.append(f"pinned_at = {_toml_str(art.pinned_at)}")
        if isinstance(art.files, str):
            lines.append(f"files = {_toml_str(art.files)}")
        else:
            lines += _render_files("files", art.files)
        if art.known:
            lines += _render_files("known", art.known)
    return "\n".join(lines) + "\n"


def write_lock(lock: ArtifactLock, path: Path | str = LOCK_PATH, *, local: bool = False) -> None:
    text = render_lock(lock, local=local)
    # Never write what we could not read back identically.
    if parse_lock(text, path, local=local) != lock:
        raise ArtifactError(f"{path}: internal error: the rendered lock does not read back")
    atomic_write_text(path, text)
