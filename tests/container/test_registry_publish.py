"""The publish path for real, against a registry on loopback: what a fresh box does before a
digest is published, and what it does after.

1. compose.yaml as it is before the first publish (a copy; the `cpu` default is the local tag
   `qwen38-stack:<version>-cpu`), no IMAGE_CPU: `docker compose --profile cpu up --no-start`
   tries to pull that tag, cannot, and builds the image itself (BuildKit, through buildx);
2. the image is tagged and pushed to Debian's reference registry (`docker-registry`) on
   127.0.0.1, and the digest the registry serves is read back;
3. `qwen38 image pin cpu 127.0.0.1:PORT/qwen38-stack:<tag>@sha256:...` rewrites the copy;
4. the local image is removed where it was built; on a second daemon with an empty data root
   (an owner's box that never built it) `docker compose pull` fetches it by digest, every layer
   from the registry, `docker compose up -d` starts the profile without building, the server
   turns healthy and `qwen38 validate apis` passes through the published port.

Why a second daemon: on the daemon that built the image, with every image and BuildKit's cache
removed, Docker 20.10 still found all six layers ("Already exists", a 0.4 s "pull" of a manifest).

Opt-in (`make registry-test`, or QWEN38_REGISTRY_TEST=1): root, Debian's docker.io, mmdebstrap
and docker-registry, a buildx plugin (fetched from Debian unless one is installed:
tests/support/image_build.py), ~10 minutes cold on 2 cores. The building daemon (its layers and
BuildKit's cache, so a rerun builds warm), the stand-in base's tarball and the fetched buildx live
under QWEN38_REGISTRY_TEST_DIR (default /tmp/qwen38-registry-test; `make registry-test-clean`
removes them); the fresh box's daemon and the registry's storage are emptied at every start. The
daemons and the registry are stopped at the end, also when a step fails. The checkout's
compose.yaml is never written. Figures go to $QWEN38_REGISTRY_TEST_DIR/result.json
(docs/images.md records them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from entrypoint.images import IMAGES, LOCAL_REPOSITORY, compose_default, local_tag, project_version, unpin_compose_image
from tests.container.compose_project import ComposeProject, validate_apis, wait_healthy
from tests.container.docker_daemon import PrivateDockerDaemon
from tests.container.local_registry import LocalRegistry, RegistryUnavailable
from tests.container.tools import COMPOSE_FILE, REPO, compose_config
from tests.support.image_build import (
    BOOKWORM_PYTHON,
    Record,
    ca_bundle,
    compose_docker_config,
    image_figures,
    standin_base,
    started_daemon,
    wheel_mirror,
)

pytestmark = [
    pytest.mark.container,
    pytest.mark.image,
    pytest.mark.skipif(
        os.environ.get("QWEN38_REGISTRY_TEST") != "1", reason="opt-in: make registry-test (QWEN38_REGISTRY_TEST=1)"
    ),
]

WORK = Path(os.environ.get("QWEN38_REGISTRY_TEST_DIR", "/tmp/qwen38-registry-test"))
PUBLISH_PORT = int(os.environ.get("QWEN38_REGISTRY_TEST_PORT", "18590"))
WHEELS_PORT = PUBLISH_PORT + 1
REGISTRY_PORT = PUBLISH_PORT + 2
PROJECT = "qwen38-registrytest"
CPU = IMAGES["cpu"]
BUILD_TIMEOUT_S = 3600
UP_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def record() -> Iterator[Record]:
    figures = Record(WORK)
    start = time.monotonic()
    yield figures
    figures.add(whole_test_seconds=round(time.monotonic() - start, 1))


@pytest.fixture(scope="module")
def publisher() -> Iterator[PrivateDockerDaemon]:
    """The daemon that builds and pushes (a developer's box, or the publish workflow's runner)."""
    with started_daemon(WORK / "docker") as instance:
        yield instance


@pytest.fixture(scope="module")
def fresh_box(publisher: PrivateDockerDaemon) -> Iterator[PrivateDockerDaemon]:
    """A second daemon with an empty data root at every run: an owner's box that never built the
    image, so every layer it runs comes from the registry."""
    root = WORK / "fresh-box"
    leftover = PrivateDockerDaemon(root)
    if leftover.pidfile.exists():
        raise RuntimeError(f"{leftover.pidfile} exists: a daemon from an earlier run is still up (stop it first)")
    leftover.unmount_leftovers()
    shutil.rmtree(root, ignore_errors=True)
    with started_daemon(root) as instance:
        yield instance


@pytest.fixture(scope="module")
def registry(publisher: PrivateDockerDaemon) -> Iterator[LocalRegistry]:
    instance = LocalRegistry(WORK / "registry", REGISTRY_PORT)
    try:
        instance.start()
    except RegistryUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="module")
def base_image(publisher: PrivateDockerDaemon, record: Record) -> str:
    return os.environ.get("QWEN38_BASE_IMAGE") or standin_base(publisher, WORK, BOOKWORM_PYTHON, record)


@pytest.fixture(scope="module")
def torch_source() -> Iterator[dict[str, str]]:
    with wheel_mirror(WHEELS_PORT) as args:
        yield args


@dataclass
class ProjectFiles:
    directory: Path
    files: tuple[Path, ...]
    docker_config: Path
    key: str

    @property
    def compose_file(self) -> Path:
        return self.directory / "compose.yaml"

    def on(self, daemon: PrivateDockerDaemon) -> ComposeProject:
        return ComposeProject(
            daemon, self.directory, PROJECT, self.files, extra_env={"DOCKER_CONFIG": str(self.docker_config)},
            key=self.key,
        )  # fmt: skip


@pytest.fixture(scope="module")
def project_files(base_image: str, torch_source: dict[str, str], record: Record, tmp_path_factory) -> ProjectFiles:
    """An owner's checkout: compose.yaml as before the first publish (a copy), .env without
    IMAGE_CPU, the key file."""
    from entrypoint.keys import init_key_file

    directory = tmp_path_factory.mktemp("registry-project")
    (directory / "compose.yaml").write_text(unpin_compose_image(COMPOSE_FILE.read_text(), CPU))
    (directory / "secrets").mkdir(mode=0o700)
    key_file = directory / "secrets" / "api_key"
    init_key_file(key_file)
    key_file.chmod(0o644)  # the server's uid reads it; the 0700 directory keeps other users out
    (directory / ".env").write_text(f"PUBLISH_PORT={PUBLISH_PORT}\nLOG_LEVEL=info\n")
    # What this machine needs to build at all, and nothing about which image is used: the copy
    # lives outside the checkout, so the context is named; no registry serves the base image, so
    # the stand-in is; PyTorch's index is out of reach, so the local wheel; the proxy's CA as the
    # secret the Dockerfile reads; builds reach the network through the host (CI-NOTES).
    build: dict = {
        "context": str(REPO),
        "network": "host",
        "args": {"BASE_IMAGE": base_image, **torch_source},
    }
    override: dict = {"services": {name: {"build": build} for name in ("prepare-cpu", "cpu")}}
    bundle = ca_bundle()
    if bundle:
        build["secrets"] = ["pip_cert"]
        override["secrets"] = {"pip_cert": {"file": bundle}}
    (directory / "override.yaml").write_text(yaml.safe_dump(override, sort_keys=False))
    files = (directory / "compose.yaml", directory / "override.yaml")
    return ProjectFiles(directory, files, compose_docker_config(WORK, record), key_file.read_text().strip())


def _remove_images(daemon: PrivateDockerDaemon, *repositories: str) -> None:
    for repository in repositories:
        ids = daemon.docker("image", "ls", "-q", "--filter", f"reference={repository}").stdout.split()
        ids += daemon.docker("image", "ls", "-q", "--filter", f"reference={repository}:*").stdout.split()
        if ids:
            daemon.docker("image", "rm", "-f", *sorted(set(ids)), timeout=300)


@dataclass
class Built:
    tag: str
    image_id: str
    inspect: dict
    output: str


@pytest.fixture(scope="module")
def built(
    publisher: PrivateDockerDaemon, project_files: ProjectFiles, registry: LocalRegistry, base_image: str,
    record: Record,
) -> Built:  # fmt: skip
    """`up --no-start` on the unpublished default: compose's pull fails and it builds instead."""
    project = project_files.on(publisher)
    tag = local_tag(CPU)
    assert compose_default(project_files.compose_file.read_text(), CPU) == tag
    # No such image yet: remove whatever an earlier run left (BuildKit's cache stays: warm reruns).
    project.compose("down", "-v", "--remove-orphans", timeout=300)
    _remove_images(publisher, LOCAL_REPOSITORY, f"{registry.address}/{LOCAL_REPOSITORY}")
    assert publisher.docker("image", "inspect", tag, check=False).returncode != 0
    start = time.monotonic()
    up = project.compose("--progress", "plain", "up", "--no-start", timeout=BUILD_TIMEOUT_S)
    seconds = time.monotonic() - start
    (WORK / "build.log").write_text(up.stdout + up.stderr)
    try:
        assert up.returncode == 0, f"compose up --no-start failed; the end of {WORK}/build.log:\n{up.stderr[-4000:]}"
        inspect = json.loads(publisher.docker("image", "inspect", tag).stdout)[0]
        record.add(compose_build_seconds=round(seconds, 1), **image_figures(publisher, tag, base_image))
    finally:
        project.compose("down", "-v", "--remove-orphans", timeout=300)  # its containers hold the image
    return Built(tag, inspect["Id"], inspect, up.stdout + up.stderr)


@dataclass
class Pushed:
    repository: str
    tag: str
    digest: str

    @property
    def reference(self) -> str:
        return f"{self.repository}:{self.tag}@{self.digest}"


@pytest.fixture(scope="module")
def pushed(publisher: PrivateDockerDaemon, registry: LocalRegistry, built: Built, record: Record) -> Pushed:
    repository = f"{registry.address}/{LOCAL_REPOSITORY}"
    tag = f"{project_version()}-{CPU.name}"
    publisher.docker("tag", built.tag, f"{repository}:{tag}")
    start = time.monotonic()
    push = publisher.docker("push", f"{repository}:{tag}", timeout=BUILD_TIMEOUT_S)
    record.add(push_seconds=round(time.monotonic() - start, 1))
    said = re.search(rf"{re.escape(tag)}: digest: (sha256:[0-9a-f]{{64}}) size: \d+", push.stdout)
    assert said, push.stdout[-2000:]
    served = registry.manifest_digest(LOCAL_REPOSITORY, tag)
    assert served == said[1], (served, said[1])
    return Pushed(repository, tag, served)


@pytest.fixture(scope="module")
def pinned(project_files: ProjectFiles, built: Built, pushed: Pushed) -> str:
    """`qwen38 image pin` on the copy of compose.yaml; what it printed."""
    checkout_default = compose_default(COMPOSE_FILE.read_text(), CPU)
    argv = ["image", "pin", CPU.name, pushed.reference, "--compose", str(project_files.compose_file)]
    pin = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", *argv],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pin.returncode == 0, pin.stderr
    assert compose_default(COMPOSE_FILE.read_text(), CPU) == checkout_default  # the checkout is never written
    return pin.stdout


@pytest.fixture(scope="module")
def pulled(
    publisher: PrivateDockerDaemon, fresh_box: PrivateDockerDaemon, project_files: ProjectFiles, built: Built,
    pushed: Pushed, pinned: str, record: Record,
) -> Iterator[tuple[ComposeProject, dict]]:  # fmt: skip
    """The local image removed where it was built; on the fresh box, compose pulls it by digest."""
    publisher.docker("image", "rm", built.tag, f"{pushed.repository}:{pushed.tag}")
    assert publisher.docker("image", "inspect", built.image_id, check=False).returncode != 0
    box = project_files.on(fresh_box)
    assert box.daemon.docker("image", "ls", "-aq").stdout.split() == []
    try:
        start = time.monotonic()
        pull = box.compose("--progress", "plain", "pull", timeout=BUILD_TIMEOUT_S)
        seconds = time.monotonic() - start
        (WORK / "pull.log").write_text(pull.stdout + pull.stderr)
        assert pull.returncode == 0, pull.stdout + pull.stderr
        inspect = json.loads(fresh_box.docker("image", "inspect", pushed.reference).stdout)[0]
        record.add(compose_pull_seconds=round(seconds, 1), pulled_layers=len(inspect["RootFS"]["Layers"]))
        yield box, {"inspect": inspect, "output": pull.stdout + pull.stderr}
    finally:
        (WORK / "compose.log").write_text(box.compose("logs", "--no-color").stdout)
        box.compose("down", "-v", "--remove-orphans", timeout=300)


@dataclass
class Running:
    project: ComposeProject
    up_output: str


@pytest.fixture(scope="module")
def stack(pulled: tuple[ComposeProject, dict], record: Record) -> Running:
    box, _ = pulled
    start = time.monotonic()
    up = box.compose("up", "-d", timeout=UP_TIMEOUT_S)
    assert up.returncode == 0, up.stdout + up.stderr
    box.seconds_to_healthy = wait_healthy(box, "cpu", start, UP_TIMEOUT_S)
    record.add(up_to_healthy_seconds=round(box.seconds_to_healthy, 1))
    return Running(box, up.stdout + up.stderr)


def test_compose_builds_the_unpublished_default_instead_of_pulling_it(built):
    # compose asked a registry for the local tag first, failed, and built it: the one command
    # works before anything is published.
    assert re.search(rf"Image {re.escape(built.tag)} Pulling", built.output), built.output[-3000:]
    assert re.search(rf"Image {re.escape(built.tag)} Built", built.output), built.output[-3000:]
    assert "falling back to the classic builder" not in built.output  # BuildKit, through buildx
    config = built.inspect["Config"]
    assert config["User"] == "10001:10001" and config["Healthcheck"]["Test"] == ["CMD", "qwen38", "ready", "--quick"]
    assert config["Labels"]["io.qwen38.lock"] == "docker/lock/cpu-x86_64.txt"


def test_the_pushed_digest_is_what_the_registry_serves_and_what_pin_wrote(pushed, pinned, built, registry,
                                                                            project_files):  # fmt: skip
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", pushed.digest)
    assert registry.manifest_digest(LOCAL_REPOSITORY, pushed.digest) == pushed.digest
    assert pinned.strip() == f"compose.yaml: cpu now pulls {pushed.reference} (was: built locally as {built.tag})"
    assert compose_default(project_files.compose_file.read_text(), CPU) == pushed.reference
    config = compose_config("cpu", files=project_files.files, project_directory=project_files.directory)
    assert {config["services"][name]["image"] for name in ("prepare-cpu", "cpu")} == {pushed.reference}


def test_compose_pulls_the_pinned_digest_and_it_is_the_image_that_was_built(built, pushed, pulled):
    _, result = pulled
    inspect = result["inspect"]
    assert inspect["Id"] == built.image_id  # the same image, back by digest
    assert "Already exists" not in result["output"], result["output"][-3000:]  # every layer from the registry
    assert f"{pushed.repository}@{pushed.digest}" in inspect["RepoDigests"]
    assert inspect["Config"]["User"] == "10001:10001"


def test_up_after_the_pin_starts_the_pulled_image_without_building_and_turns_healthy(stack, built, pushed):
    assert "Building" not in stack.up_output and " Built" not in stack.up_output, stack.up_output[-3000:]
    for service in ("prepare-cpu", "cpu"):
        container = stack.project.container(service)
        assert container["Image"] == built.image_id and container["Config"]["Image"] == pushed.reference
    prepare = stack.project.container("prepare-cpu")["State"]
    assert prepare["Status"] == "exited" and prepare["ExitCode"] == 0
    logs = stack.project.compose("logs", "--no-color").stdout
    assert "qwen38: verified cpu" in logs and "qwen38: ready in" in logs
    assert stack.project.key not in logs


def test_validate_apis_passes_through_the_published_port(stack, record):
    report, seconds = validate_apis(stack.project.base_url(PUBLISH_PORT), stack.project.key)
    record.add(validate_apis_seconds=round(seconds, 1), validate_apis_checks=len(report["checks"]))
