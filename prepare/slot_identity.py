"""Is a model directory the one its profile slot and the lock call for? (pure checks)

One home for the identity check that `qwen38 verify` runs on every slot before a launch and
that `qwen38 prepare` runs to decide whether a directory can be kept:

- an artifact slot: the lock's repo and revision, and exactly the lock's files;
- a derived slot (``transform``): this build's version of the transform, from pinned inputs
  at the lock's revisions and manifest digests;
- a generated slot (``generated = "tiny"``): this build's generator.

Every problem is one line naming the file, what was expected and what was found, with the
command that repairs it.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import ArtifactError, StackError, VerifyError
from core.identity import ArtifactIdentity, DerivedIdentity, GeneratedIdentity
from core.manifest import Manifest
from prepare.transforms import transform_version as current_transform_version


def generator_version(generator: str) -> str:
    """The version of a local generator (`generated = ...` slots) in this checkout."""
    if generator == "tiny":
        # Here, not at the top: the generator imports torch, and `qwen38 verify` / `serve` need
        # it only for a generated slot (serve's own process then holds no torch while vLLM runs).
        from prepare.generate import GENERATOR_VERSION

        return str(GENERATOR_VERSION)
    raise VerifyError(f"unknown generator {generator!r} in a profile slot")


def check_slot_identity(
    slot_name: str,
    slot,
    manifest: Manifest,
    lock,
    manifest_path: Path,
    lock_path: Path | str,
    profile_name: str = "PROFILE",
) -> list[str]:
    """Problems between a directory's manifest and what its profile slot and the lock pin.

    ``profile_name`` goes into the repair commands the problems name."""
    ident = manifest.identity
    where = str(manifest_path)
    prepare = f"`qwen38 prepare --profile {profile_name} --recheck`"
    if slot.transform is not None:
        problems = _transform_problems(slot, ident, where, prepare)
        if problems:
            return problems
    if slot.generated is not None:
        if slot.transform is None:
            return _generated_problems(ident, slot.generated, where, prepare)
        # A transform of a generated model (the GPU tier's int8 tiny target): every leaf of
        # the derivation is that generator's current output, and nothing else.
        leaves = unpinned_inputs(ident)
        if not leaves or ident.artifacts():
            return [f"{where}: expected {slot.transform} of a `qwen38 {slot.generated}` model, found {ident.describe()}"]
        return [p for leaf in leaves for p in _generated_problems(leaf, slot.generated, where, prepare)]

    artifact = lock.get(slot.artifact)
    pin = artifact.unpinned()
    if pin is not None and artifact.pinned_at_first_use:
        try:
            artifact.require_pinned(lock_path, prepare=f"qwen38 prepare --profile {profile_name}")
        except ArtifactError as exc:
            return [str(exc)]
    if pin is not None:
        return [
            f"{lock_path}: artifact {artifact.key} ({slot_name} {slot.dir}) is not pinned ({pin}); "
            f"pin it with `{artifact.pin_command()}` and commit the lock"
        ]
    if slot.transform is not None:
        return _derived_problems(ident, artifact, lock, where, prepare)
    return _artifact_problems(manifest, artifact, where)


def _derived_problems(ident, artifact, lock, where: str, prepare: str) -> list[str]:
    """A derived directory comes from the slot's pinned artifact, at the lock's revisions and digests."""
    problems: list[str] = []
    for leaf in unpinned_inputs(ident):
        problems.append(
            f"{where}: derives from {leaf.describe()} content that the lock does not pin; prepare it from "
            f"the pinned download with {prepare}"
        )
    inputs = ident.artifacts()
    if not any(a.artifact == artifact.key for a, _ in inputs):
        problems.append(f"{where}: identity expected to derive from {artifact.key}, found {ident.describe()}")
    for source, digest in inputs:
        if source.artifact not in lock.artifacts:
            problems.append(f"{where}: derives from {source.artifact}, which the lock does not pin")
            continue
        pinned = lock.artifacts[source.artifact]
        if pinned.unpinned() is not None:
            problems.append(
                f"{where}: derives from {source.artifact}, which is not pinned; `{pinned.pin_command()}`"
            )
        elif source.revision != pinned.revision:
            problems.append(
                f"{where}: input {source.artifact} revision expected {pinned.revision} (lock), "
                f"found {source.revision}; prepare the directory again"
            )
        elif digest != pinned.expected_manifest().digest:
            problems.append(
                f"{where}: input {source.artifact} manifest digest expected "
                f"{pinned.expected_manifest().digest} (lock), found {digest}; prepare the directory again"
            )
    return problems


def _artifact_problems(manifest: Manifest, artifact, where: str) -> list[str]:
    """A downloaded directory is the lock's artifact: its repo, revision and exactly its files."""
    ident = manifest.identity
    if not isinstance(ident, ArtifactIdentity) or ident.artifact != artifact.key:
        return [f"{where}: identity expected artifact {artifact.key}, found {ident.describe()}"]
    if ident.repo != artifact.repo:
        return [f"{where}: identity repo expected {artifact.repo} (lock), found {ident.repo}"]
    if ident.revision != artifact.revision:
        return [
            f"{where}: identity revision expected {artifact.revision} (lock), found {ident.revision}; "
            f"run `qwen38 prepare download {artifact.key}`"
        ]
    return compare_with_lock(manifest, artifact.expected_manifest(), where, artifact.key)


def _generated_problems(ident, generator: str, where: str, prepare: str) -> list[str]:
    if not isinstance(ident, GeneratedIdentity) or ident.generator != generator:
        return [
            f"{where}: identity expected generated by `qwen38 {generator}`, found {ident.describe()}; "
            f"regenerate it with {prepare}"
        ]
    current = generator_version(generator)
    if ident.generator_version != current:
        return [
            f"{where}: generated by `qwen38 {generator}` v{ident.generator_version}, "
            f"this stack's generator is v{current}; regenerate it with {prepare}"
        ]
    return []


def _transform_problems(slot, ident, where: str, prepare: str) -> list[str]:
    """The directory is this build's version of the slot's transform."""
    origin = slot.artifact or f"a `qwen38 {slot.generated}` model"
    if not isinstance(ident, DerivedIdentity) or ident.transform != slot.transform:
        return [f"{where}: identity expected transform {slot.transform} of {origin}, found {ident.describe()}"]
    try:
        current = transform_version(slot.transform)
    except StackError as exc:
        return [f"{where}: {exc}"]
    if ident.transform_version != current:
        return [
            f"{where}: made by transform {slot.transform} v{ident.transform_version}, this stack's "
            f"{slot.transform} is v{current}; prepare it again with {prepare}"
        ]
    return []


def transform_version(transform: str) -> str:
    """The version of a preparation step (`transform = ...` slots) in this build."""
    return current_transform_version(transform)


def unpinned_inputs(identity: DerivedIdentity) -> list[GeneratedIdentity]:
    """Leaves of a derivation that are generated, not pinned artifacts (e.g. a local checkpoint)."""
    found: list[GeneratedIdentity] = []
    for ref in identity.inputs:
        if isinstance(ref.identity, GeneratedIdentity):
            found.append(ref.identity)
        elif isinstance(ref.identity, DerivedIdentity):
            found.extend(unpinned_inputs(ref.identity))
    return found


def compare_with_lock(manifest: Manifest, expected: Manifest, where: str, key: str) -> list[str]:
    """A downloaded directory's manifest must list exactly the lock's files."""
    have, want = manifest.by_path(), expected.by_path()
    problems = []
    for path in sorted(set(want) | set(have)):
        if path not in have:
            problems.append(f"{where}: lists no {path}, the lock pins it for {key}")
        elif path not in want:
            problems.append(f"{where}: lists {path}, which the lock does not pin for {key}")
        elif have[path] != want[path]:
            problems.append(
                f"{where}: {path} sha256 {have[path].sha256} ({have[path].size} bytes) listed, the lock pins "
                f"{want[path].sha256} ({want[path].size} bytes)"
            )
    if not problems and manifest.digest != expected.digest:
        problems.append(f"{where}: digest expected {expected.digest} (from the lock), found {manifest.digest}")
    return problems
