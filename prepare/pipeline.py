"""`qwen38 prepare --profile P`: make every model directory of a profile exist, once.

Each model slot of the profile says where its directory comes from:

- ``generated = "tiny"``: `qwen38 tiny` writes it (with the other tiny models);
- ``artifact`` alone: the pinned download (`prepare.download`), in the slot's directory;
- ``artifact`` + ``transform``: a preparation step (`prepare.transforms`) applied to the
  pinned download of ``artifact``, which lands first where `qwen38 prepare download KEY`
  puts it (``MODELS_DIR/<key>``, or the directory of a slot of the same profile that
  serves that artifact as downloaded). ``requantize-int8`` reads that download;
  ``adapter-build`` reads the profile's target (the base model) and the downloaded
  directions file.

A slot the caller names in ``skip_slots`` gets no step: `qwen38 prepare --profile` names the
downloaded drafter where SPECULATION serves mtp or off, which never read it.

`plan_profile` turns a profile and the lock into these steps (pure); `prepare_profile`
first refuses anything it cannot do - an artifact the lock does not pin (the lock's own
one-line message), a transform this build lacks - before fetching a byte, then runs each
step that is not already done. Every step is idempotent: a download whose directory
already carries the lock's manifest with every file at its size, a derived directory
whose manifest has exactly the identity the step would write, or a tiny model directory
with a manifest, is left alone; so a second run does nothing (the compose ``prepare``
service runs this on every ``up``). `qwen38 verify` then proves the content; when it finds
altered bytes, ``--recheck`` hashes what is in place instead of trusting sizes, and fetches
or rebuilds whatever does not match its manifest (a missing or extra file included; the tiny
models are generated again). One run at a time per MODELS_DIR (a lock): it first removes the
``.<name>.<id>.incomplete`` staging directories a killed run left beside the ones it builds.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core import progress
from core.artifact_lock import LOCK_PATH, ArtifactLock, effective_lock, load_lock
from core.atomic import remove_stale_staging
from core.errors import PrepareError
from core.identity import GeneratedIdentity
from core.manifest import MANIFEST_NAME, Manifest, is_current
from core.profiles import ModelSlot, Profile
from prepare.download import default_dir, download_artifact
from prepare.generate import GENERATOR_VERSION, build_tiny_models
from prepare.pinning import check_pinnable, pin_at_first_use
from prepare.requantize import requantize_checkpoint
from prepare.slot_identity import check_slot_identity
from prepare.transforms import transform_module


@dataclass(frozen=True)
class Step:
    """One thing `prepare_profile` may do: make ``directory`` by ``action``."""

    slot: str  # the profile slot it serves, e.g. "target", or "target input"
    directory: Path
    action: str  # "tiny", "download", or a transform name
    artifact: str | None = None
    inputs: tuple[Path, ...] = ()  # what a transform reads, in the order it takes them

    def describe(self) -> str:
        what = f"{self.action} {self.artifact}" if self.artifact and self.action == "download" else self.action
        return f"{self.slot}: {what} -> {self.directory}"


def _slots(profile: Profile) -> list[tuple[str, ModelSlot]]:
    return [(name, slot) for name, slot in profile.models if slot is not None]


def input_dir(profile: Profile, models_dir: Path, artifact: str) -> Path:
    """Where the download of ``artifact`` that a transform reads lives."""

    for _, slot in _slots(profile):
        if slot.artifact == artifact and slot.transform is None:
            return models_dir / slot.dir
    return models_dir / default_dir(artifact)


def plan_profile(profile: Profile, models_dir: Path, skip_slots: frozenset[str] = frozenset()) -> list[Step]:
    """Every step the profile's directories need, downloads before the transforms that read them.

    A slot named in ``skip_slots`` (the drafter the chosen SPECULATION never reads) gets no step
    of its own; a transform of another slot still downloads its input where it always lands
    (`input_dir`), even when that is the skipped slot's directory."""
    downloads: list[Step] = []
    derived: list[Step] = []
    tiny: list[Step] = []

    def download(slot_name: str, artifact: str, directory: Path) -> None:
        if not any(s.directory == directory for s in downloads):
            downloads.append(Step(slot_name, directory, "download", artifact))

    slots = dict(_slots(profile))
    for name, slot in slots.items():
        if name in skip_slots:
            continue
        directory = models_dir / slot.dir
        if slot.generated is not None and slot.transform is not None:
            raise PrepareError(
                f"profile {profile.name}: {name} is {slot.transform} of a generated model, which this pipeline "
                f"does not chain; run `qwen38 {slot.generated}` and `qwen38 prepare {slot.transform.split('-')[0]}` "
                "as the GPU test tier does"
            )
        if slot.generated is not None:
            tiny.append(Step(name, directory, slot.generated))
        elif slot.transform is None:
            download(name, slot.artifact, directory)  # type: ignore[arg-type]
        else:
            source = input_dir(profile, models_dir, slot.artifact)  # type: ignore[arg-type]
            download(f"{name} input", slot.artifact, source)  # type: ignore[arg-type]
            inputs: tuple[Path, ...] = (source,)
            if slot.transform == "adapter-build":
                base = slots["target"]
                if base.transform is not None or base.artifact is None:
                    raise PrepareError(
                        f"profile {profile.name}: adapter-build reads the target as downloaded, but the target "
                        "slot is not a plain artifact"
                    )
                inputs = (models_dir / base.dir, source)
            derived.append(Step(name, directory, slot.transform, slot.artifact, inputs))
    return tiny + downloads + derived


def check_plan(steps: list[Step], lock: ArtifactLock, lock_path: Path | str, allow_branch_head: bool = False) -> None:
    """Refuse, before any work, what cannot be done: unpinned artifacts, missing transforms.

    An artifact the repository lock pins by commit only passes (prepare pins its files at
    first use); one with no revision only with ``allow_branch_head``."""

    for step in steps:
        if step.action == "download":
            artifact = lock.get(step.artifact, lock_path)  # type: ignore[arg-type]
            check_pinnable(artifact, lock_path, allow_branch_head=allow_branch_head)
    for step in steps:
        if step.action not in ("download", "tiny"):
            try:
                transform_module(step.action)
            except PrepareError as exc:
                raise PrepareError(f"{step.slot} {step.directory}: {exc}") from None


# ----------------------------------------------------------------------------- running


def _tiny_is_current(directory: Path, recheck: bool) -> bool:
    """A tiny model directory this generator wrote (with ``recheck``: every byte as listed).

    Without ``recheck`` its file sizes are not compared (docs/prepare.md: a tiny model is
    generated again when its manifest is missing or of another generator version)."""

    def ours(manifest: Manifest) -> bool:
        identity = manifest.identity
        return isinstance(identity, GeneratedIdentity) and identity.generator_version == str(GENERATOR_VERSION)

    return is_current(directory, ours, sizes=False, sha256=recheck)


def _run_tiny(step: Step, models_dir: Path, recheck: bool, tiny_slots: list[Step]) -> bool:
    """Generate the tiny models unless every tiny slot of the profile is current."""
    if all(_tiny_is_current(s.directory, recheck) for s in tiny_slots):
        return False

    root = step.directory.parent
    if root == models_dir:
        raise PrepareError(f"{step.slot}: tiny models live in a subdirectory of MODELS_DIR, got {step.directory}")
    build_tiny_models(root)
    return True


@dataclass(frozen=True)
class HubAccess:
    """How prepare reaches files it does not have: the hub's endpoint, a directory of files
    already downloaded, and whether an artifact with no revision may pin its branch head."""

    endpoint: str | None = None
    seed_dir: Path | None = None
    allow_branch_head: bool = False


def _pin_artifacts(
    steps: list[Step], lock: ArtifactLock, models_dir: Path, hub: HubAccess, lock_path: Path | str, say
) -> ArtifactLock:
    """The lock with every downloaded artifact's files pinned (read from the hub at first use)."""

    for key in dict.fromkeys(step.artifact for step in steps if step.action == "download"):
        artifact = lock.get(key, lock_path)  # type: ignore[arg-type]
        if not artifact.is_pinned:
            lock = lock.with_artifact(
                pin_at_first_use(
                    artifact,
                    models_dir,
                    allow_branch_head=hub.allow_branch_head,
                    endpoint=hub.endpoint,
                    lock_path=lock_path,
                    say=say,
                )
            )
    return lock


def _run_download(
    step: Step,
    lock: ArtifactLock,
    lock_path: Path | str,
    hub: HubAccess,
    recheck: bool,
    say: Callable[[str], None],
) -> bool:

    artifact = lock.get(step.artifact, lock_path)  # type: ignore[arg-type]
    if is_current(step.directory, artifact.expected_manifest(), sha256=recheck):
        return False
    download_artifact(
        artifact,
        step.directory,
        endpoint=hub.endpoint,
        seed_dir=hub.seed_dir,
        lock_path=lock_path,
        recheck=recheck,
        say=say,
    )
    return True


def _run_requantize(step: Step, recheck: bool, say: Callable[[str], None]) -> bool:
    force = recheck and step.directory.exists() and not is_current(step.directory, sizes=False, sha256=True)
    result = requantize_checkpoint(
        step.inputs[0], step.directory, progress=True, allow_unmanifested_input=False, force=force
    )
    if result.up_to_date:
        return False
    say(f"{step.slot}: requantized {len(result.tensors)} tables into {step.directory} in {result.seconds:.1f} s")
    return True


def _derived_is_current(
    step: Step, profile: Profile, lock: ArtifactLock, lock_path: Path | str, recheck: bool
) -> bool:
    """A transform's output whose identity verify accepts and whose files are all there
    (with ``recheck``: every byte as listed)."""

    slot = dict(_slots(profile))[step.slot]

    def accepted(manifest: Manifest) -> bool:
        return not check_slot_identity(step.slot, slot, manifest, lock, step.directory / MANIFEST_NAME, lock_path)

    return is_current(step.directory, accepted, sha256=recheck)


def _run_adapter_build(step: Step, profile: Profile, lock: ArtifactLock, lock_path: Path | str, recheck: bool) -> bool:
    if _derived_is_current(step, profile, lock, lock_path, recheck):
        return False
    base, directions_dir = step.inputs
    files = lock.get(step.artifact, lock_path).require_pinned(lock_path)  # type: ignore[arg-type]
    if len(files) != 1:
        raise PrepareError(f"{lock_path}: artifact {step.artifact} pins {len(files)} files; adapter-build reads one")
    adapter = transform_module("adapter-build")
    adapter.build_adapter(
        base, directions_dir / files[0].path, step.directory, force=step.directory.exists(), progress=True
    )
    return True


def prepare_profile(
    profile: Profile,
    models_dir: Path,
    *,
    lock_path: Path | str = LOCK_PATH,
    hub: HubAccess = HubAccess(),
    recheck: bool = False,
    skip_slots: frozenset[str] = frozenset(),
    say: Callable[[str], None] = progress.say,
) -> list[Step]:
    """Run every step the profile still needs; returns what was done (empty: nothing was needed).

    ``skip_slots``: slots the engine will not read, which get no step (`plan_profile`).

    ``recheck`` hashes the downloaded and derived directories already in place and fetches
    or rebuilds those whose bytes differ from their manifest (the repair `qwen38 verify`
    names); without it, a directory is trusted when its manifest and file sizes are right.
    """
    models_dir = Path(models_dir)
    steps = plan_profile(profile, models_dir, skip_slots)
    lock: ArtifactLock | None = None
    if any(step.artifact is not None for step in steps):
        lock = effective_lock(load_lock(lock_path), models_dir)
        check_plan(steps, lock, lock_path, hub.allow_branch_head)
    with _one_preparer(models_dir):
        if lock is not None:
            lock = _pin_artifacts(steps, lock, models_dir, hub, lock_path, say)
        return _run_steps(steps, profile, models_dir, lock, lock_path, hub, recheck, say)


PREPARE_LOCK = ".qwen38-prepare.lock"


@contextmanager
def _one_preparer(models_dir: Path) -> Iterator[None]:
    """One `prepare --profile` per MODELS_DIR; holding it, staging leftovers are provably stale."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / PREPARE_LOCK, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(
                f"{models_dir}: another `qwen38 prepare --profile` is running here; wait for it"
            ) from None
        yield


def _remove_staging_leftovers(steps: list[Step], say: Callable[[str], None]) -> None:
    """What a killed run left beside the directories it was building (``.<name>.<id>.incomplete``)."""

    for parent in sorted({step.directory.parent for step in steps}):
        for removed in remove_stale_staging(parent):
            say(f"removed {removed}, left by an interrupted run")


def _run_steps(steps, profile, models_dir, lock, lock_path, hub, recheck, say) -> list[Step]:
    _remove_staging_leftovers(steps, say)
    tiny_slots = [step for step in steps if step.action == "tiny"]
    done: list[Step] = []
    for step in steps:
        if step.action == "tiny":
            if step is not tiny_slots[0]:
                continue  # one run of the generator writes (and one check covers) every tiny slot
            ran = _run_tiny(step, models_dir, recheck, tiny_slots)
        elif step.action == "download":
            ran = _run_download(step, lock, lock_path, hub, recheck, say)  # type: ignore[arg-type]
        elif step.action == "requantize-int8":
            ran = _run_requantize(step, recheck, say)
        elif step.action == "adapter-build":
            ran = _run_adapter_build(step, profile, lock, lock_path, recheck)  # type: ignore[arg-type]
        else:  # check_plan refused it already; kept for a transform added to the registry only
            raise PrepareError(f"{step.slot}: no preparation step {step.action!r} is wired into `prepare --profile`")
        if ran:
            done.append(step)
    return done
