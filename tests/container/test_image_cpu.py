"""The CPU image end to end, as a user runs it: build the image, `docker compose --profile cpu
up`, then prove it - preparation exited 0, the server verified its models and passed the
readiness gate, the container healthcheck turned healthy, `qwen38 validate apis` passes against
the published port, models are read-only and the non-root server stops within its grace period.

Opt-in (`make image-test`, or QWEN38_IMAGE_TEST=1): it needs root, Debian's docker.io and
mmdebstrap, and 4-14 minutes cold (docs/images.md has the recorded runs). A private daemon
(tests/container/docker_daemon.py) runs under QWEN38_IMAGE_TEST_DIR (default
/tmp/qwen38-image-test) and is stopped at the end; its layers and pip cache stay there, so a
second run is faster (`make image-test-clean` removes them).

No base image can be pulled on these machines: unless QWEN38_BASE_IMAGE names one, a Debian
bookworm minbase with python3 and its headers (3.11, like python:3.11-slim) built by
mmdebstrap stands in.
Where the PyTorch CPU index is out of reach, the torch wheel comes from the local find-links
directory (PIP_FIND_LINKS), served to the build over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from entrypoint.images import IMAGES, build_args
from tests.container.compose_project import ComposeProject, cli_env, validate_apis, wait_healthy
from tests.container.docker_daemon import PrivateDockerDaemon
from tests.container.tools import COMPOSE_FILE, REPO
from tests.support.image_build import (
    BOOKWORM_PYTHON,
    Record,
    build_image,
    image_figures,
    source_revision,
    standin_base,
    started_daemon,
    wheel_mirror,
)

pytestmark = [
    pytest.mark.container,
    pytest.mark.image,
    pytest.mark.skipif(
        os.environ.get("QWEN38_IMAGE_TEST") != "1", reason="opt-in: make image-test (QWEN38_IMAGE_TEST=1)"
    ),
]

WORK = Path(os.environ.get("QWEN38_IMAGE_TEST_DIR", "/tmp/qwen38-image-test"))
PUBLISH_PORT = int(os.environ.get("QWEN38_IMAGE_TEST_PORT", "18580"))
WHEELS_PORT = PUBLISH_PORT + 1
TAG = "qwen38-stack:cpu-imagetest"
PROJECT = "qwen38-imagetest"
UP_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def record() -> Record:
    return Record(WORK)


@pytest.fixture(scope="module")
def daemon() -> Iterator[PrivateDockerDaemon]:
    with started_daemon(WORK / "docker") as instance:
        yield instance


@pytest.fixture(scope="module")
def base_image(daemon: PrivateDockerDaemon, record: Record) -> str:
    return os.environ.get("QWEN38_BASE_IMAGE") or standin_base(daemon, WORK, BOOKWORM_PYTHON, record)


@pytest.fixture(scope="module")
def cpu_image(daemon: PrivateDockerDaemon, base_image: str, record: Record) -> dict:
    labels = build_args(IMAGES["cpu"], source_revision())
    with wheel_mirror(WHEELS_PORT) as torch_source:
        seconds = build_image(
            daemon, "docker/Dockerfile.cpu", TAG, {"BASE_IMAGE": base_image, **labels, **torch_source},
            WORK / "build.log",
        )  # fmt: skip
    figures = image_figures(daemon, TAG, base_image)
    record.add(build_seconds=round(seconds, 1), **figures)
    inspect = json.loads(daemon.docker("image", "inspect", TAG).stdout)[0]
    return {"labels": labels, "inspect": inspect}


@pytest.fixture(scope="module")
def stack(daemon: PrivateDockerDaemon, cpu_image: dict, record: Record, tmp_path_factory) -> Iterator[ComposeProject]:
    from entrypoint.keys import init_key_file

    project = tmp_path_factory.mktemp("compose-project")
    (project / "secrets").mkdir(mode=0o700)
    key_file = project / "secrets" / "api_key"
    init_key_file(key_file)
    # Compose bind-mounts a file secret with its host mode; the server's uid reads it, while the
    # 0700 directory keeps it from other users of the host (the README's recipe).
    key_file.chmod(0o644)
    (project / ".env").write_text(f"IMAGE_CPU={TAG}\nPUBLISH_PORT={PUBLISH_PORT}\nLOG_LEVEL=info\n")
    # The image was built above: never pull or rebuild it here. (The `cpu` service reserves no
    # GPU, so nothing of `deploy` has to be taken out for this daemon.)
    (project / "override.yaml").write_text(
        "services:\n  prepare-cpu:\n    pull_policy: never\n  cpu:\n    pull_policy: never\n"
    )
    stack = ComposeProject(
        daemon, project, PROJECT, (COMPOSE_FILE, project / "override.yaml"), key=key_file.read_text().strip()
    )
    start = time.monotonic()
    up = stack.compose("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        stack.seconds_to_healthy = wait_healthy(stack, "cpu", start, UP_TIMEOUT_S)
        record.add(up_to_healthy_seconds=round(stack.seconds_to_healthy, 1))
        yield stack
    finally:
        (WORK / "compose.log").write_text(stack.compose("logs", "--no-color").stdout)
        stack.compose("down", "-v", "--remove-orphans", timeout=300)


def test_image_is_patched_labelled_and_runs_as_non_root(daemon, cpu_image):
    labels = cpu_image["inspect"]["Config"]["Labels"]
    expected = cpu_image["labels"]
    assert labels["io.qwen38.vllm.version"] == expected["VLLM_VERSION"] == "0.28.0"
    assert labels["io.qwen38.patchset.sha256"] == expected["PATCHSET_SHA256"]
    assert labels["org.opencontainers.image.revision"] == expected["SOURCE_REVISION"]
    assert labels["io.qwen38.cuda.arch-list"] == "none"
    assert cpu_image["inspect"]["Config"]["User"] == "10001:10001"
    assert cpu_image["inspect"]["Config"]["Healthcheck"]["Test"] == ["CMD", "qwen38", "ready", "--quick"]
    # The shipped vLLM carries the series (proven in the image, not read from a build log that a
    # cached build does not repeat).
    check = daemon.docker("run", "--rm", "--network=none", TAG, "patches", "check", timeout=300)
    assert re.search(r"all \d+ patches delivered in /opt/venv/lib/python3\.\d+/site-packages/vllm", check.stdout)
    assert expected["PATCHSET_SHA256"][:12] in check.stdout


def test_compose_up_prepares_verifies_and_serves_until_healthy(stack):
    prepare = stack.container("prepare-cpu")["State"]
    assert prepare["Status"] == "exited" and prepare["ExitCode"] == 0
    logs = stack.compose("logs", "--no-color", "cpu").stdout
    assert "qwen38: verified cpu" in logs
    assert "qwen38: ready in" in logs and "API key: file /run/secrets/api_key" in logs
    assert stack.key not in stack.compose("logs", "--no-color").stdout


def test_validate_apis_passes_against_the_published_port(stack, record):
    report, seconds = validate_apis(stack.base_url(PUBLISH_PORT), stack.key)
    record.add(validate_apis_seconds=round(seconds, 1), validate_apis_checks=len(report["checks"]))
    base_url = stack.base_url(PUBLISH_PORT)
    gate = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "ready", "--profile", "cpu", "--base-url", base_url],
        cwd=REPO,
        env=cli_env(stack.key),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gate.returncode == 0 and "ok  adapter: qwen3.8-27b-mode-b differs from qwen3.8-27b" in gate.stdout


def test_server_cannot_write_its_models(stack):
    cid = stack.container("cpu")["Id"]
    result = stack.daemon.docker("exec", cid, "touch", "/models/tiny/written-by-server", check=False)
    assert result.returncode != 0 and "Read-only file system" in result.stderr
    assert stack.daemon.docker("exec", cid, "id", "-u").stdout.strip() == "10001"


def test_server_stops_on_sigterm_within_its_grace_period(stack, record):
    start = time.monotonic()
    stopped = stack.compose("stop", "cpu", timeout=180)
    seconds = time.monotonic() - start
    assert stopped.returncode == 0, stopped.stderr
    state = stack.container("cpu")["State"]
    record.add(stop_seconds=round(seconds, 1), stop_exit_code=state["ExitCode"])
    # SIGKILL after the 60 s grace period would show as 137; vLLM exits on SIGTERM well before.
    assert seconds < 60 and state["ExitCode"] != 137, state
