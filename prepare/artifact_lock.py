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
not known yet. Nothing is ever taken on trust: downloads and verification refuse an
unpinned artifact with one line naming what is missing and the ``qwen38 lock update``
command that pins it. A ``local`` artifact (the adapter's directions file, which has no
public repo) has no repo/revision: its files' sizes and sha256 are the whole pin, filled
by ``qwen38 lock update KEY --from PATH`` from the user's own copy.

`load_lock` validates the whole file (one `ArtifactError` line on any problem);
`render_lock` writes it back in one canonical layout, so updates make small diffs.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from entrypoint.errors import ArtifactError
from prepare.atomic import atomic_write_text
from prepare.identity import ARTIFACT_KEY_RE, COMMIT_RE, ArtifactIdentity
from prepare.manifest import Manifest, ManifestFile, build_manifest

LOCK_PATH = Path(__file__).resolve().parent.parent / "profiles" / "artifacts.lock.toml"
LOCK_VERSION = 1
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

    @model_validator(mode="after")
    def _source_fields(self) -> LockedArtifact:
        if self.source == "hub":
            if not self.repo or "/" not in self.repo:
                raise ValueError("a hub artifact needs `repo` as `owner/name`")
            if self.revision is None:
                raise ValueError(f"a hub artifact needs `revision` (a 40-hex commit, or {UNPINNED!r})")
        elif self.repo is not None or self.revision is not None:
            raise ValueError("a local artifact has no `repo`/`revision`: its files' sha256 pin it")
        return self

    # -- pin state --------------------------------------------------------------------

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
        if self.files == UNPINNED:
            return "its file sizes and sha256 are UNPINNED"
        return None

    @property
    def is_pinned(self) -> bool:
        return self.unpinned() is None

    def require_pinned(self, lock_path: Path | str = LOCK_PATH) -> tuple[LockedFile, ...]:
        """The pinned files, or one `ArtifactError` line naming what is missing and the fix."""
        what = self.unpinned()
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


def parse_lock(text: str, lock_path: Path | str = LOCK_PATH) -> ArtifactLock:
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
        return ArtifactLock.model_validate({"version": data.get("version"), "artifacts": entries})
    except ValidationError as exc:
        raise ArtifactError(f"{lock_path}: {_first_error(exc)}") from None


def load_lock(path: Path | str = LOCK_PATH) -> ArtifactLock:
    """Read and validate the lock; any problem is one `ArtifactError` line naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"{path}: the artifact lock is missing") from None
    return parse_lock(text, path)


# -- writing --------------------------------------------------------------------------

_HEADER = """\
# qwen38-stack artifact lock: every artifact a profile may serve or prepare from,
# pinned to a Hugging Face commit and to each file's size and sha256 (the LFS sha256 the
# hub publishes for that commit). Reviewed like code; docs/pinning.md explains it.
#
# Written by `qwen38 lock update KEY [--revision COMMIT | --from PATH]`, which keeps one
# canonical layout: edit `repo`, `revision`, `note` and `exclude` by hand if you like,
# then run it to refill `files`. "UNPINNED" marks a value not known yet: downloads and
# `qwen38 verify` refuse such an artifact and print the command that pins it.
"""


def _toml_str(value: str) -> str:
    out = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{out}"'


def render_lock(lock: ArtifactLock) -> str:
    """The lock as TOML, in the one layout `qwen38 lock update` writes."""
    lines = [_HEADER.rstrip("\n"), "", f"version = {lock.version}"]
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
        if isinstance(art.files, str):
            lines.append(f"files = {_toml_str(art.files)}")
        else:
            lines.append("files = [")
            for f in art.files:
                lines.append(f"  {{ path = {_toml_str(f.path)}, size = {f.size}, sha256 = {_toml_str(f.sha256)} }},")
            lines.append("]")
    return "\n".join(lines) + "\n"


def write_lock(lock: ArtifactLock, path: Path | str = LOCK_PATH) -> None:
    text = render_lock(lock)
    # Never write what we could not read back identically.
    if parse_lock(text, path) != lock:
        raise ArtifactError(f"{path}: internal error: the rendered lock does not read back")
    atomic_write_text(path, text)
