"""Building an image for real on these machines: a stand-in base, `docker build`, its figures.

No registry can be reached here, so no base image can be pulled: `standin_base` makes one with
mmdebstrap from a distribution mirror and ``docker import`` (the recipe of
../shared/CI-NOTES.md). Two stand-ins exist, one per published base:

- `BOOKWORM_PYTHON` for ``python:3.11-slim-bookworm`` (the CPU image): Debian 12 minbase with
  python3, its headers and venv;
- `NOBLE_CUDA_BASE` for ``nvidia/cuda:13.0.1-base-ubuntu24.04`` (the CUDA images): Ubuntu
  24.04 minbase with apt and ca-certificates, and the environment the NVIDIA base declares
  (PATH, NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES). It lacks that base's CUDA
  runtime package (``cuda-cudart-13-0``) and forward-compatibility libraries, which the images
  do not use: torch and the JIT toolchain take their CUDA from the lock's wheels
  (docs/images.md). Ubuntu's archive is verified with the Ubuntu archive keyring, taken from
  its pinned package (`UBUNTU_KEYRING`).

`build_image` runs ``docker build`` with the label build arguments, the host's CA bundle as the
``pip_cert`` secret, the build log kept under the test's work directory, and returns how long
it took; `image_figures` reads the sizes the docs record. `wheel_mirror` serves a local
find-links directory holding the CPU torch to a build over HTTP, where the PyTorch index is out
of reach.

`compose_docker_config` gives ``docker compose`` what it builds with: compose hands builds to
Docker's buildx plugin (``buildx bake``, BuildKit) and, without one, falls back to the classic
builder, which cannot build these Dockerfiles (``RUN --mount`` for the pip cache and the CA
secret). Debian 12's docker.io ships no buildx, so unless one (0.17 or later, compose's minimum)
is installed, Debian unstable's ``docker-buildx`` package is fetched with a private apt
configuration (signature-checked against the Debian archive keyring, the host's apt state
untouched) and put in a ``DOCKER_CONFIG`` directory under the test's work directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.container.docker_daemon import DOCKER_CLI, DaemonUnavailable, PrivateDockerDaemon

REPO = Path(__file__).resolve().parents[2]
UBUNTU_MIRROR = os.environ.get("QWEN38_UBUNTU_MIRROR", "http://archive.ubuntu.com/ubuntu")
# ubuntu-keyring 2023.11.28.1 (noble/main): holds the "Ubuntu Archive Automatic Signing Key
# (2018)", F6ECB3762474EDA9D21B7022871920D1991BC93C, that signs noble's Release files.
UBUNTU_KEYRING = (
    "pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb",
    "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8",
)


@contextlib.contextmanager
def started_daemon(root: Path) -> Iterator[PrivateDockerDaemon]:
    """A private daemon under ``root`` for the length of the block (the test skips without root)."""
    instance = PrivateDockerDaemon(root)
    try:
        instance.start()
    except DaemonUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield instance
    finally:
        instance.stop()


@dataclass
class Record:
    """What a run measured; written to ``work/<name>`` after every addition."""

    work: Path
    figures: dict[str, object] = field(default_factory=dict)
    name: str = "result.json"

    def add(self, **values: object) -> None:
        self.figures.update(values)
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / self.name).write_text(json.dumps(self.figures, indent=2) + "\n")


@dataclass(frozen=True)
class StandinBase:
    """A base image made here, standing in for a published one that cannot be pulled."""

    tag: str
    suite: str
    includes: tuple[str, ...]
    stands_in_for: str
    env: tuple[str, ...] = ()  # ENV lines of the published base that the images rely on
    ubuntu: bool = False


BOOKWORM_PYTHON = StandinBase(
    tag="qwen38-standin/bookworm-python:3.11",
    suite="bookworm",
    includes=("python3", "python3-venv", "python3-dev", "ca-certificates"),
    stands_in_for="python:3.11-slim-bookworm",
)
NOBLE_CUDA_BASE = StandinBase(
    tag="qwen38-standin/noble:24.04",
    suite="noble",
    includes=("apt", "ca-certificates"),
    stands_in_for="nvidia/cuda:13.0.1-base-ubuntu24.04",
    env=(
        "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "NVIDIA_VISIBLE_DEVICES=all",
        "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
    ),
    ubuntu=True,
)


def debian_mirror() -> str:
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        match = re.search(r"^URIs:\s*(\S+)", sources.read_text(), re.M)
        if match:
            return match.group(1)
    return "http://deb.debian.org/debian"


def ubuntu_keyring(work: Path) -> Path:
    """The Ubuntu archive keyring, from its package checked against the pinned sha256."""
    keyring = work / "ubuntu-keyring" / "usr" / "share" / "keyrings" / "ubuntu-archive-keyring.gpg"
    if keyring.is_file():
        return keyring
    path, sha256 = UBUNTU_KEYRING
    deb = work / Path(path).name
    with urllib.request.urlopen(f"{UBUNTU_MIRROR}/{path}", timeout=120) as response:
        body = response.read()
    found = hashlib.sha256(body).hexdigest()
    if found != sha256:
        raise RuntimeError(f"{UBUNTU_MIRROR}/{path}: sha256 {found}, pinned {sha256}")
    deb.write_bytes(body)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "ubuntu-keyring")], check=True, capture_output=True)
    return keyring


def mmdebstrap_argv(base: StandinBase, output: Path, work: Path) -> list[str]:
    argv = ["mmdebstrap", "--variant=minbase", "--format=tar", f"--include={','.join(base.includes)}"]
    if not base.ubuntu:
        return [*argv, base.suite, str(output), debian_mirror()]
    # tini (the images' PID 1) is in universe, as in the published base's sources.
    suites = [f"deb {UBUNTU_MIRROR} {base.suite}{pocket} main universe" for pocket in ("", "-updates", "-security")]
    return [*argv, f"--keyring={ubuntu_keyring(work)}", base.suite, str(output), *suites]


def standin_base(daemon: PrivateDockerDaemon, work: Path, base: StandinBase, record: Record) -> str:
    """The tag of ``base`` in the daemon, made (and its tarball kept in ``work``) when missing."""
    if daemon.docker("image", "inspect", base.tag, check=False).returncode == 0:
        return base.tag
    tar = work / f"{base.tag.split('/')[-1].replace(':', '-')}.tar"
    if not tar.exists():
        start = time.monotonic()
        partial = tar.with_name(f".{tar.stem}.incomplete.tar")
        subprocess.run(mmdebstrap_argv(base, partial, work), check=True, capture_output=True, timeout=900)
        partial.rename(tar)
        record.add(standin_seconds=round(time.monotonic() - start, 1))
    changes = [arg for line in base.env for arg in ("--change", f"ENV {line}")]
    daemon.docker("import", *changes, str(tar), base.tag, timeout=600)
    return base.tag


def ca_bundle() -> str | None:
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("REQUESTS_CA_BUNDLE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def source_revision() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else "0000000"


def build_image(
    daemon: PrivateDockerDaemon,
    dockerfile: str,
    tag: str,
    build_args: dict[str, str],
    log: Path,
    timeout: float = 3600,
) -> float:
    """``docker build`` from the repository; the seconds it took (the log is kept at ``log``)."""
    argv = [DOCKER_CLI, "build", "--network=host", "-f", dockerfile, "-t", tag, "--progress=plain"]
    for key, value in build_args.items():
        argv += ["--build-arg", f"{key}={value}"]
    bundle = ca_bundle()
    if bundle:
        argv += ["--secret", f"id=pip_cert,src={bundle}"]
    start = time.monotonic()
    with log.open("w") as handle:
        result = subprocess.run(
            [*argv, "."],
            cwd=REPO,
            env={**os.environ, **daemon.env()},
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    if result.returncode != 0:
        raise AssertionError(f"docker build -f {dockerfile} failed; the end of {log}:\n{log.read_text()[-4000:]}")
    return time.monotonic() - start


def image_figures(daemon: PrivateDockerDaemon, tag: str, base: str) -> dict[str, object]:
    """Image and base sizes, and the size of the layer that copies the venv in."""
    inspect = json.loads(daemon.docker("image", "inspect", tag).stdout)[0]
    base_inspect = json.loads(daemon.docker("image", "inspect", base).stdout)[0]
    layers = [
        json.loads(line)
        for line in daemon.docker("history", "--no-trunc", "--format", "{{json .}}", tag).stdout.splitlines()
    ]
    venv = next((layer["Size"] for layer in layers if "/opt/venv /opt/venv" in layer["CreatedBy"]), None)
    return {"image_bytes": inspect["Size"], "base_image_bytes": base_inspect["Size"], "venv_layer": venv,
            "base_image": base}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def wheel_mirror(port: int) -> Iterator[dict[str, str]]:
    """Build arguments for torch's source: a local find-links directory over HTTP, if any."""
    local = os.environ.get("QWEN38_WHEELS_DIR") or os.environ.get("PIP_FIND_LINKS", "")
    directory = Path(local) if local and not local.startswith(("http:", "https:")) else None
    if directory is None or not any(directory.glob("torch-2.13.0+cpu-*.whl")):
        yield {}
        return
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"TORCH_INDEX_URL": "", "WHEELS_URL": f"http://127.0.0.1:{port}/"}
    finally:
        server.shutdown()
        server.server_close()


# compose (v2.3x and later) refuses an older buildx: "compose build requires buildx 0.17.0 or later".
BUILDX_MINIMUM = (0, 17)
# Where the docker CLI, and compose after it, look for CLI plugins besides $DOCKER_CONFIG/cli-plugins.
BUILDX_PLUGIN_DIRS = (
    Path.home() / ".docker" / "cli-plugins",
    Path("/usr/local/lib/docker/cli-plugins"),
    Path("/usr/local/libexec/docker/cli-plugins"),
    Path("/usr/lib/docker/cli-plugins"),
    Path("/usr/libexec/docker/cli-plugins"),
)
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")


def buildx_version(plugin: Path) -> str | None:
    """``docker-buildx version``'s version ("0.29.1+ds1"), or None where it does not run."""
    try:
        result = subprocess.run([str(plugin), "version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    fields = result.stdout.split()
    return fields[1].lstrip("v") if result.returncode == 0 and len(fields) >= 2 else None


def _new_enough(version: str | None) -> bool:
    numbers = re.match(r"(\d+)\.(\d+)", version or "")
    return numbers is not None and (int(numbers[1]), int(numbers[2])) >= BUILDX_MINIMUM


def _debian_buildx(work: Path) -> Path:
    """Debian unstable's docker-buildx plugin, unpacked under ``work`` (apt checks its signature)."""
    apt = work / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "parts"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    if not DEBIAN_KEYRING.is_file():
        raise RuntimeError(f"{DEBIAN_KEYRING} is missing: apt-get install -y debian-archive-keyring")
    (apt / "sources.list").write_text(f"deb [signed-by={DEBIAN_KEYRING}] {debian_mirror()} unstable main\n")
    options = [
        "-q",
        "-o", f"Dir::State::Lists={apt / 'lists'}",
        "-o", f"Dir::Cache={apt / 'cache'}",
        "-o", f"Dir::Etc::SourceList={apt / 'sources.list'}",
        "-o", f"Dir::Etc::SourceParts={apt / 'parts'}",
        "-o", "Dir::Etc::Preferences=/dev/null",
        "-o", f"Dir::Etc::PreferencesParts={apt / 'parts'}",
        "-o", "APT::Sandbox::User=root",
    ]  # fmt: skip
    for argv in (["apt-get", *options, "update"], ["apt-get", *options, "download", "docker-buildx"]):
        result = subprocess.run(argv, cwd=apt, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            step = f"apt-get {argv[-1]} docker-buildx" if argv[-1] == "download" else "apt-get update"
            raise RuntimeError(f"{step} (Debian unstable) failed: {result.stderr.strip()[-500:]}")
    deb = max(apt.glob("docker-buildx_*.deb"), key=lambda path: path.stat().st_mtime)
    unpacked = apt / "docker-buildx"
    shutil.rmtree(unpacked, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True, capture_output=True)
    return unpacked / "usr" / "libexec" / "docker" / "cli-plugins" / "docker-buildx"


def compose_docker_config(work: Path, record: Record | None = None) -> Path:
    """A DOCKER_CONFIG directory whose ``cli-plugins`` hold a buildx compose builds with."""
    config = work / "docker-config"
    target = config / "cli-plugins" / "docker-buildx"
    target.parent.mkdir(parents=True, exist_ok=True)
    wanted = os.environ.get("QWEN38_BUILDX")
    candidates = [Path(wanted)] if wanted else [target, *(d / "docker-buildx" for d in BUILDX_PLUGIN_DIRS)]
    found = next((path for path in candidates if path.is_file() and _new_enough(buildx_version(path))), None)
    if found is None and wanted:
        raise RuntimeError(f"QWEN38_BUILDX={wanted}: not a docker-buildx plugin of version 0.17 or later")
    if found is None:
        found = _debian_buildx(work)
    if found != target:
        target.unlink(missing_ok=True)
        shutil.copy2(found, target)
    version = buildx_version(target)
    if not _new_enough(version):
        raise RuntimeError(f"{found}: buildx {version or '(does not run)'}; compose needs 0.17 or later")
    if record is not None:
        record.add(buildx_version=version)
    return config
