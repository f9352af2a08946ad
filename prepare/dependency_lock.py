"""Hash-pinned Python package locks for the images (``docker/lock/``), and the proof that
every locked requirement can be installed as a wheel on its image's platform.

A `LockTarget` is one image platform: its input files (``docker/lock/*.in`` plus this
project's ``pyproject.toml``), Python version, CPU architecture and the glibc of its base
image. ``qwen38 lock deps`` runs uv's cross-platform resolver for each target
(`uv_compile_argv`) and then records, beside the lock, a *wheel listing*: for every locked
``name==version``, the wheel files the package index publishes whose sha256 is one of the
lock's hashes and whose tags the target's pip accepts (`target_tags`).

`check_listing` is pure and offline: it proves a lock and its listing agree (same lock
bytes, same requirements and versions, hashes among the lock's) and that every requirement
has at least one wheel for the platform, re-deriving compatibility from the wheel file
names. The images install with ``--only-binary=:all: --require-hashes``, so this is exactly
what a build needs. `verify_listing_online` re-asks the indexes (with a cache) that every
listed file is still published with that hash and not yanked.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from core.atomic import atomic_write_text
from core.errors import DependencyLockError
from core.manifest import sha256_file

REPO = Path(__file__).resolve().parent.parent
LOCK_DIR = REPO / "docker" / "lock"
PYPI_SIMPLE = "https://pypi.org/simple"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LISTING_FORMAT = 1
COMPILE_COMMAND = "qwen38 lock deps"


@dataclass(frozen=True)
class LockTarget:
    """One image platform's lock: what goes in, for which interpreter and machine."""

    name: str
    images: tuple[str, ...]
    inputs: tuple[str, ...]
    python_version: str
    arch: str
    glibc: tuple[int, int]
    overrides: tuple[str, ...] = ()
    extra_index_urls: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # optional-dependency groups of pyproject.toml resolved too
    seed: str | None = None  # the target whose pins a first resolution starts from

    @property
    def lock_path(self) -> Path:
        return LOCK_DIR / f"{self.name}.txt"

    @property
    def listing_path(self) -> Path:
        return LOCK_DIR / f"{self.name}.wheels.json"

    @property
    def platform_tag(self) -> str:
        return f"manylinux_{self.glibc[0]}_{self.glibc[1]}_{self.arch}"

    @property
    def uv_platform(self) -> str:
        """uv's ``--python-platform`` name: the newest manylinux the base image's glibc runs."""
        return f"{self.arch}-manylinux_{self.glibc[0]}_{self.glibc[1]}"


# Ubuntu 24.04 (the nvidia/cuda 13 bases) has glibc 2.39; Debian 12 (python:3.11-slim) 2.36.
# The CPU image stays on Python 3.11: the torch 2.13.0+cpu wheel these machines can reach, and
# the development venv that runs the same engine, are 3.11.
TARGETS: dict[str, LockTarget] = {
    t.name: t
    for t in (
        LockTarget(
            name="cuda-x86_64",
            images=("docker/Dockerfile.rtx3090",),
            inputs=("cuda.in",),
            python_version="3.12",
            arch="x86_64",
            glibc=(2, 39),
        ),
        LockTarget(
            name="cuda-aarch64",
            images=("docker/Dockerfile.spark",),
            inputs=("cuda.in",),
            python_version="3.12",
            arch="aarch64",
            glibc=(2, 39),
        ),
        LockTarget(
            name="cpu-x86_64",
            images=("docker/Dockerfile.cpu",),
            inputs=("cpu.in",),
            python_version="3.11",
            arch="x86_64",
            glibc=(2, 36),
            overrides=("cpu-engine.overrides.txt", "cpu-image.overrides.txt"),
            extra_index_urls=(PYTORCH_CPU_INDEX,),
        ),
        # The development and test environment (`make setup`): the CPU image's engine plus the
        # test, benchmark and lock tools, and the Triton the CUDA images ship (the split-KV and
        # GDN kernel tests run it on CPU). Resolved from the CPU lock's pins, so every package
        # the two share has the same version and hashes (a test holds them to it).
        LockTarget(
            name="dev-x86_64",
            images=(),
            inputs=("cpu.in", "dev.in"),
            python_version="3.11",
            arch="x86_64",
            glibc=(2, 36),
            overrides=("cpu-engine.overrides.txt",),
            extra_index_urls=(PYTORCH_CPU_INDEX,),
            extras=("test", "bench", "lock"),
            seed="cpu-x86_64",
        ),
    )
}


def get_target(name: str) -> LockTarget:
    try:
        return TARGETS[name]
    except KeyError:
        raise DependencyLockError(f"unknown lock target {name!r}; known: {', '.join(TARGETS)}") from None


# ---- the lock file --------------------------------------------------------------------------


@dataclass(frozen=True)
class LockedRequirement:
    name: str  # canonical
    version: str
    hashes: frozenset[str]


_REQ_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;[^\\]*)?\\?\s*$")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def parse_lock(text: str, source: str = "lock") -> dict[str, LockedRequirement]:
    """``name -> LockedRequirement`` from a ``--generate-hashes`` requirements file."""
    found: dict[str, LockedRequirement] = {}
    current: tuple[str, str, set[str]] | None = None

    def close() -> None:
        if current is None:
            return
        name, version, hashes = current
        if not hashes:
            raise DependencyLockError(
                f"{source}: {name}=={version} has no --hash (regenerate with `{COMPILE_COMMAND}`)"
            )
        found[name] = LockedRequirement(name, version, frozenset(hashes))

    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if raw[0].isspace():
            if current is None:
                raise DependencyLockError(f"{source}:{number}: an option line before any requirement")
            hashes = _HASH.findall(line)
            if not hashes and not line.startswith("#"):
                raise DependencyLockError(f"{source}:{number}: expected --hash=sha256:..., found {line!r}")
            current[2].update(hashes)
            continue
        match = _REQ_LINE.match(line)
        if match is None:
            raise DependencyLockError(f"{source}:{number}: not an exact `name==version` pin: {line!r}")
        close()
        name = canonicalize_name(match.group(1))
        if name in found:
            raise DependencyLockError(f"{source}:{number}: {name} is pinned twice")
        current = (name, match.group(2), set(_HASH.findall(line)))
    close()
    if not found:
        raise DependencyLockError(f"{source}: no requirements")
    return found


# ---- platform compatibility -----------------------------------------------------------------


def target_tags(target: LockTarget) -> frozenset[Tag]:
    """Every wheel tag the target image's pip accepts (CPython ``python_version``, glibc)."""
    major, minor = (int(p) for p in target.python_version.split("."))
    glibc_major, glibc_minor = target.glibc
    platforms = [f"manylinux_{glibc_major}_{m}_{target.arch}" for m in range(glibc_minor, 16, -1)]
    platforms.append(f"manylinux2014_{target.arch}")
    if target.arch == "x86_64":
        platforms += ["manylinux2010_x86_64", "manylinux1_x86_64"]
    platforms.append(f"linux_{target.arch}")
    tags = set(cpython_tags((major, minor), platforms=platforms))
    tags.update(compatible_tags((major, minor), interpreter=f"cp{major}{minor}", platforms=platforms))
    return frozenset(tags)


def wheel_fits(filename: str, name: str, version: str, tags: frozenset[Tag]) -> bool:
    """True when ``filename`` is a wheel of exactly ``name==version`` installable with ``tags``."""
    try:
        wheel_name, wheel_version, _build, wheel_tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return False
    if wheel_name != canonicalize_name(name) or wheel_version != Version(version):
        return False
    return not tags.isdisjoint(wheel_tags)


# ---- the wheel listing ----------------------------------------------------------------------


@dataclass(frozen=True)
class IndexFile:
    filename: str
    sha256: str
    url: str
    yanked: bool = False
    size: int | None = None  # bytes, where the index says (PEP 700)


@dataclass
class Listing:
    target: str
    python: str
    platform: str
    lock_sha256: str
    requirements: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {
            "format": LISTING_FORMAT,
            "target": self.target,
            "python": self.python,
            "platform": self.platform,
            "lock_sha256": self.lock_sha256,
            "requirements": {k: self.requirements[k] for k in sorted(self.requirements)},
        }
        return json.dumps(body, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Listing:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DependencyLockError(f"{source}: not JSON ({exc.msg}); regenerate with `{COMPILE_COMMAND}`") from None
        if body.get("format") != LISTING_FORMAT:
            raise DependencyLockError(f"{source}: format {body.get('format')!r}, expected {LISTING_FORMAT}")
        return cls(body["target"], body["python"], body["platform"], body["lock_sha256"], body["requirements"])


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def build_listing(target: LockTarget, lock_text: str, files_for: Callable[[str], list[IndexFile]]) -> Listing:
    """The listing for a lock: per requirement, the published wheels that fit the target.

    ``files_for(name)`` returns every file an index publishes for a project. Raises when a
    requirement has no wheel for the platform (an ``--only-binary`` install would fail).
    """
    locked = parse_lock(lock_text, target.lock_path.name)
    tags = target_tags(target)
    listing = Listing(target.name, target.python_version, target.platform_tag, sha256_text(lock_text))
    missing = []
    for name in sorted(locked):
        req = locked[name]
        wheels = [
            {"filename": f.filename, "sha256": f.sha256, "url": f.url, "size": f.size}
            for f in files_for(name)
            if f.sha256 in req.hashes and not f.yanked and wheel_fits(f.filename, name, req.version, tags)
        ]
        if not wheels:
            missing.append(f"{name}=={req.version}")
        wheels.sort(key=lambda w: w["filename"])
        listing.requirements[name] = {"version": req.version, "wheels": wheels}
    if missing:
        raise DependencyLockError(
            f"{target.lock_path.name}: no {target.platform_tag} / cp{target.python_version.replace('.', '')} wheel "
            f"with a locked hash for {', '.join(missing)}"
        )
    return listing


def download_bytes(listing: Listing) -> int:
    """Bytes an image build downloads: the largest listed wheel of each requirement (an upper bound)."""
    return sum(max((w.get("size") or 0) for w in r["wheels"]) for r in listing.requirements.values() if r["wheels"])


def check_listing(target: LockTarget, lock_text: str, listing: Listing) -> list[str]:
    """Every way the lock and its listing disagree, or a requirement lacks a platform wheel.

    Pure and offline; an empty list means: every locked requirement has at least one wheel
    whose name, version and tags fit the target and whose sha256 the lock accepts.
    """
    problems: list[str] = []
    lock_name = target.lock_path.name
    if listing.target != target.name:
        problems.append(f"listing is for target {listing.target}, expected {target.name}")
    if listing.python != target.python_version or listing.platform != target.platform_tag:
        problems.append(
            f"listing is for Python {listing.python} on {listing.platform}, "
            f"expected {target.python_version} on {target.platform_tag}"
        )
    if listing.lock_sha256 != sha256_text(lock_text):
        problems.append(f"{lock_name} changed since its wheel listing was made: run `{COMPILE_COMMAND}`")
    locked = parse_lock(lock_text, lock_name)
    tags = target_tags(target)
    for name in sorted(set(listing.requirements) - set(locked)):
        problems.append(f"listing names {name}, which {lock_name} does not pin")
    for name in sorted(locked):
        req = locked[name]
        entry = listing.requirements.get(name)
        if entry is None:
            problems.append(f"{name}=={req.version}: not in the wheel listing")
            continue
        if entry.get("version") != req.version:
            problems.append(f"{name}: locked {req.version}, listed {entry.get('version')}")
            continue
        good = 0
        for wheel in entry.get("wheels", []):
            filename = wheel.get("filename", "")
            if wheel.get("sha256") not in req.hashes:
                problems.append(f"{name}=={req.version}: listed {filename} has a sha256 the lock does not accept")
            elif not wheel_fits(filename, name, req.version, tags):
                problems.append(f"{name}=={req.version}: listed {filename} does not install on {target.platform_tag}")
            else:
                good += 1
        if good == 0:
            problems.append(
                f"{name}=={req.version}: no wheel for cp{target.python_version.replace('.', '')} {target.platform_tag}"
            )
    return problems


# ---- package indexes ------------------------------------------------------------------------

_ANCHOR = re.compile(r"<a\s+([^>]*?)>([^<]+)</a>", re.I)
_HREF = re.compile(r'href="([^"]+)"', re.I)


def parse_simple_page(body: str, content_type: str, base_url: str) -> list[IndexFile]:
    """Files of a PEP 691 (JSON) or PEP 503 (HTML) project page, with their sha256."""
    from urllib.parse import urljoin

    files: list[IndexFile] = []
    if "json" in content_type:
        for item in json.loads(body).get("files", []):
            digest = (item.get("hashes") or {}).get("sha256")
            if digest:
                files.append(
                    IndexFile(
                        item["filename"],
                        digest,
                        urljoin(base_url, item["url"]),
                        bool(item.get("yanked")),
                        item.get("size"),
                    )
                )
        return files
    for attrs, text in _ANCHOR.findall(body):
        href = _HREF.search(attrs)
        if href is None:
            continue
        url = html.unescape(href.group(1))
        digest = re.search(r"#sha256=([0-9a-f]{64})", url)
        if digest is None:
            continue
        files.append(
            IndexFile(
                html.unescape(text).strip(),
                digest.group(1),
                urljoin(base_url, url.split("#")[0]),
                "data-yanked" in attrs,
            )
        )
    return files


class IndexClient:
    """Reads project pages from package indexes and find-links directories (optionally cached)."""

    def __init__(
        self,
        index_urls: Iterable[str],
        find_links: Iterable[Path] = (),
        cache_dir: Path | None = None,
        max_age_s: float = 86400.0,
        timeout_s: float = 60.0,
    ) -> None:
        import httpx

        self.index_urls = [u.rstrip("/") for u in index_urls]
        self.find_links = [Path(p) for p in find_links]
        self.cache_dir = cache_dir
        self.max_age_s = max_age_s
        self._client = httpx.Client(timeout=timeout_s, follow_redirects=True)
        self._local_hashes: dict[Path, str] = {}

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> IndexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def files_for(self, name: str) -> list[IndexFile]:
        files: list[IndexFile] = []
        for index in self.index_urls:
            files.extend(self._index_files(index, canonicalize_name(name)))
        for directory in self.find_links:
            files.extend(self._local_files(directory, canonicalize_name(name)))
        return files

    def _cache_path(self, index: str, name: str) -> Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(index.encode()).hexdigest()[:16]
        return self.cache_dir / key / f"{name}.json"

    def _index_files(self, index: str, name: str) -> list[IndexFile]:
        import httpx

        cached = self._cache_path(index, name)
        if cached is not None and cached.is_file() and time.time() - cached.stat().st_mtime < self.max_age_s:
            return [IndexFile(**item) for item in json.loads(cached.read_text())]
        url = f"{index}/{name}/"
        try:
            response = self._client.get(url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        except httpx.TransportError as exc:
            raise DependencyLockError(f"{url}: cannot reach the package index ({type(exc).__name__})") from None
        if response.status_code == 404:
            files: list[IndexFile] = []
        elif response.status_code != 200:
            raise DependencyLockError(f"{url}: HTTP {response.status_code}")
        else:
            files = parse_simple_page(response.text, response.headers.get("content-type", ""), url)
        if cached is not None:

            atomic_write_text(cached, json.dumps([f.__dict__ for f in files]))
        return files

    def _local_files(self, directory: Path, name: str) -> list[IndexFile]:
        files = []
        for path in sorted(directory.glob("*.whl")):
            try:
                wheel_name = parse_wheel_filename(path.name)[0]
            except InvalidWheelFilename:
                continue
            if wheel_name != name:
                continue
            if path not in self._local_hashes:
                self._local_hashes[path] = sha256_file(path)
            files.append(
                IndexFile(path.name, self._local_hashes[path], f"find-links:{path.name}", size=path.stat().st_size)
            )
        return files


def verify_listing_online(listing: Listing, files_for: Callable[[str], list[IndexFile]]) -> list[str]:
    """Every listed wheel the indexes no longer publish with that sha256, or now mark yanked."""
    problems = []
    for name in sorted(listing.requirements):
        published = {f.filename: f for f in files_for(name)}
        for wheel in listing.requirements[name]["wheels"]:
            found = published.get(wheel["filename"])
            if found is None:
                problems.append(f"{wheel['filename']}: no longer published")
            elif found.sha256 != wheel["sha256"]:
                problems.append(f"{wheel['filename']}: published sha256 {found.sha256} != listed {wheel['sha256']}")
            elif found.yanked:
                problems.append(f"{wheel['filename']}: yanked")
    return problems


# ---- regenerating with uv -------------------------------------------------------------------


def uv_compile_argv(
    target: LockTarget,
    uv: str,
    *,
    output: Path,
    find_links: Iterable[Path] = (),
    extra_index: bool = True,
) -> list[str]:
    """The exact ``uv pip compile`` command that writes ``target``'s lock (pure)."""
    # Paths relative to the repository (uv runs there): they end up in the lock's comments.
    lock_dir = LOCK_DIR.relative_to(REPO)
    argv = [uv, "pip", "compile", "--quiet"]
    argv += [str(lock_dir / name) for name in target.inputs]
    argv.append("pyproject.toml")
    for extra in target.extras:
        argv += ["--extra", extra]
    argv += [
        "--python-version", target.python_version,
        "--python-platform", target.uv_platform,
        "--generate-hashes",
        "--custom-compile-command", f"{COMPILE_COMMAND} --target {target.name}",
        "--output-file", str(output),
    ]  # fmt: skip
    for overrides in target.overrides:
        argv += ["--override", str(lock_dir / overrides)]
    if extra_index:
        for url in target.extra_index_urls:
            argv += ["--extra-index-url", url]
    for directory in find_links:
        argv += ["--find-links", str(directory)]
    return argv


def find_uv(explicit: str | None) -> str:
    if explicit:
        return explicit
    beside = Path(sys.executable).with_name("uv")
    found = shutil.which("uv") or (str(beside) if beside.exists() else None)
    if found is None:
        raise DependencyLockError("uv is not installed: `pip install uv` (or pass --uv PATH)")
    return found


def regenerate(
    target: LockTarget,
    *,
    uv: str,
    find_links: list[Path],
    extra_index: bool,
    upgrade: bool = False,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> tuple[Path, Listing]:
    """Compile ``target``'s lock with uv, then record its wheel listing; both written atomically."""

    staging = target.lock_path.with_name(f".{target.lock_path.name}.incomplete")
    # uv prefers the pins it finds in its output file: start from the current lock so that a
    # regeneration only moves what must move, unless asked to upgrade everything.
    seed = target.lock_path if target.lock_path.is_file() else (TARGETS[target.seed].lock_path if target.seed else None)
    if seed is not None and seed.is_file() and not upgrade:
        shutil.copyfile(seed, staging)
    else:
        staging.unlink(missing_ok=True)
    argv = uv_compile_argv(target, uv, output=staging.relative_to(REPO), find_links=find_links, extra_index=extra_index)
    if upgrade:
        argv.append("--upgrade")
    env = dict(os.environ, UV_NO_CONFIG="1")  # the command line is the whole configuration
    result = run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        staging.unlink(missing_ok=True)
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DependencyLockError(f"uv pip compile for {target.name} failed: {' | '.join(tail)}")
    text = staging.read_text()
    staging.unlink()
    indexes = [PYPI_SIMPLE] + (list(target.extra_index_urls) if extra_index else [])
    with IndexClient(indexes, find_links) as client:
        listing = build_listing(target, text, client.files_for)
    atomic_write_text(target.lock_path, text)
    atomic_write_text(target.listing_path, listing.to_json())
    return target.lock_path, listing


def load_target_files(target: LockTarget) -> tuple[str, Listing]:
    try:
        lock_text = target.lock_path.read_text()
    except FileNotFoundError:
        raise DependencyLockError(
            f"{target.lock_path}: missing; run `{COMPILE_COMMAND} --target {target.name}`"
        ) from None
    try:
        listing = Listing.from_json(target.listing_path.read_text(), str(target.listing_path))
    except FileNotFoundError:
        raise DependencyLockError(
            f"{target.listing_path}: missing; run `{COMPILE_COMMAND} --target {target.name}`"
        ) from None
    return lock_text, listing
