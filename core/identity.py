"""Identities: what a model directory *is*, as opposed to what it holds.

A manifest lists a directory's files; its identity says where those files come from, in
one of three typed shapes (the ``kind`` field tells them apart):

- `ArtifactIdentity` (``kind = "artifact"``): the files of a pinned artifact of
  ``profiles/artifacts.lock.toml`` exactly as pinned: a Hugging Face repo at a 40-hex
  revision (``source = "hub"``) or a user-supplied file pinned by sha256
  (``source = "local"``). Written by ``qwen38 prepare download``.
- `DerivedIdentity` (``kind = "derived"``): the output of a preparation step (requantize,
  adapter build, ...): the transform's name and version, the parameters that change its
  output, and the identity of every input directory (`InputRef`, which carries the input's
  manifest digest, so a derived directory is bound to the exact bytes it was made from).
- `GeneratedIdentity` (``kind = "generated"``): made locally from nothing pinned, e.g. the
  tiny models of ``qwen38 tiny``: the generator's name, version and parameters (seed,
  shapes).

How a step writes its manifest (after it has verified its own output)::

    from core.identity import DerivedIdentity
    from core.manifest import input_ref, write_manifest

    identity = DerivedIdentity(
        transform="requantize-int8",
        transform_version="1",
        params={"group_size": 128},
        inputs=(input_ref(models_dir / "qwen3.8-27b-w4a16", role="model"),),
    )
    write_manifest(output_dir, identity)

and ``qwen38 tiny``::

    write_manifest(out, GeneratedIdentity(generator="tiny", generator_version="1",
                                          params={"arch": "qwen3_5", "seed": 0}))

Bump the version whenever the step's output bytes would change for the same input; the
version is part of the identity string the server reports.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
ARTIFACT_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def canonical_json(data: Any) -> str:
    """The one serialization digests are taken over: sorted keys, no whitespace, ASCII."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest_of(data: Any) -> str:
    return hashlib.sha256(canonical_json(data).encode("ascii")).hexdigest()


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArtifactIdentity(_Frozen):
    """A pinned artifact of the lock, byte for byte."""

    kind: Literal["artifact"] = "artifact"
    artifact: str = Field(description="Key in profiles/artifacts.lock.toml.")
    source: Literal["hub", "local"]
    repo: str | None = Field(default=None, description="Hugging Face repo (hub artifacts).")
    revision: str | None = Field(default=None, description="40-hex commit (hub artifacts).")

    @field_validator("artifact")
    @classmethod
    def _key(cls, value: str) -> str:
        if not ARTIFACT_KEY_RE.fullmatch(value):
            raise ValueError(f"not an artifact key: {value!r}")
        return value

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        if value is not None and not COMMIT_RE.fullmatch(value):
            raise ValueError(f"revision must be a 40-hex commit, got {value!r}")
        return value

    @model_validator(mode="after")
    def _source_fields(self) -> ArtifactIdentity:
        if self.source == "hub" and (self.repo is None or self.revision is None):
            raise ValueError("a hub artifact names its repo and revision")
        if self.source == "local" and (self.repo is not None or self.revision is not None):
            raise ValueError("a local artifact has no repo or revision (its files' sha256 pin it)")
        return self

    def describe(self) -> str:
        if self.source == "hub":
            return f"{self.artifact}@{self.revision[:12]}"  # type: ignore[index]
        return f"{self.artifact}(local)"


class GeneratedIdentity(_Frozen):
    """Generated locally (no pinned input): generator, its version and parameters."""

    kind: Literal["generated"] = "generated"
    generator: str = Field(description="What made it, e.g. `tiny` for `qwen38 tiny`.")
    generator_version: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.generator}-v{self.generator_version}"


class InputRef(_Frozen):
    """One input of a derived directory: its role, identity and manifest digest."""

    role: str = Field(description="What the input is to the transform, e.g. `model`, `directions`.")
    identity: Identity
    manifest_digest: str = Field(description="`digest` of the input directory's manifest.")

    @field_validator("manifest_digest")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not SHA256_RE.fullmatch(value):
            raise ValueError(f"manifest_digest must be 64 lowercase hex, got {value!r}")
        return value


class DerivedIdentity(_Frozen):
    """The output of a preparation step applied to identified inputs."""

    kind: Literal["derived"] = "derived"
    transform: str = Field(description="Step name; a profile slot's `transform` names it.")
    transform_version: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    inputs: tuple[InputRef, ...] = Field(min_length=1)

    def describe(self) -> str:
        inner = ",".join(i.identity.describe() for i in self.inputs)
        return f"{self.transform}-v{self.transform_version}({inner})"

    def artifacts(self) -> list[tuple[ArtifactIdentity, str]]:
        """Every pinned artifact this directory derives from, with the manifest digest seen."""
        found: list[tuple[ArtifactIdentity, str]] = []
        for ref in self.inputs:
            if isinstance(ref.identity, ArtifactIdentity):
                found.append((ref.identity, ref.manifest_digest))
            elif isinstance(ref.identity, DerivedIdentity):
                found.extend(ref.identity.artifacts())
        return found


Identity = Annotated[
    Union[ArtifactIdentity, DerivedIdentity, GeneratedIdentity], Field(discriminator="kind")
]
InputRef.model_rebuild()
DerivedIdentity.model_rebuild()


def identity_dict(identity: ArtifactIdentity | DerivedIdentity | GeneratedIdentity) -> dict[str, Any]:
    return identity.model_dump(mode="json")
