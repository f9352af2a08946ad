"""An owner's first run, through `docker compose`, with models that come from a hub.

What a new owner's box does on `docker compose --profile cpu up -d`, with the one difference
that the models are served by the hub stand-in (tests/hub_server.py) instead of the Hugging
Face hub, reached through `HF_ENDPOINT` as a mirror would be:

- the image's lock pins the target by commit only (`files = "UNPINNED"`, one `known` hash):
  the first prepare reads that commit's listing, checks it, records it in the models volume
  (`artifacts.local.toml`), downloads and verifies;
- a first attempt meets a flipped byte: prepare refuses it with both hashes, nothing is
  installed and the server does not start; the next `up` downloads again and serves;
- `HF_TOKEN_FILE` hands the token to prepare as the Docker secret `hf_token`: the hub sees it
  on every API request, and no log, no container environment holds it;
- `docker compose logs` shows progress lines (the CDN is throttled so a file takes ~25 s,
  more than one progress interval), the pin prepare recorded, the engine's start heartbeat;
- the server turns healthy, `qwen38 validate apis` passes through the published port, and a
  restart verifies from the stat cache prepare left, in under 5 s.

The only test-only pieces are in an override file: the profiles directory (the `cpu` profile
with its target taken from the hub, and a lock naming that artifact) mounted over the image's,
and `network_mode: host` for `prepare-cpu` (the stand-in listens on the host's loopback).

Opt-in (`make first-run-test`, or QWEN38_FIRST_RUN_TEST=1): root, Debian's docker.io and
mmdebstrap, like `make image-test`, whose work directory (daemon, layers, stand-in base) it
shares by default (QWEN38_IMAGE_TEST_DIR): after an image test the build is warm. Figures go
to $QWEN38_IMAGE_TEST_DIR/first-run.json (docs/images.md records them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml

from core.artifact_lock import UNPINNED, ArtifactLock, LockedArtifact, LockedFile, load_lock, write_lock
from entrypoint.images import IMAGES, build_args
from tests.container.compose_project import ComposeProject, cli_env, wait_healthy
from tests.container.docker_daemon import PrivateDockerDaemon
from tests.container.tools import COMPOSE_FILE, REPO
from tests.hub_server import FakeHub
from tests.support.image_build import (
    BOOKWORM_PYTHON,
    Record,
    build_image,
    source_revision,
    standin_base,
    started_daemon,
    wheel_mirror,
)

pytestmark = [
    pytest.mark.container,
    pytest.mark.image,
    pytest.mark.skipif(
        os.environ.get("QWEN38_FIRST_RUN_TEST") != "1", reason="opt-in: make first-run-test (QWEN38_FIRST_RUN_TEST=1)"
    ),
]

WORK = Path(os.environ.get("QWEN38_IMAGE_TEST_DIR", "/tmp/qwen38-image-test"))
PUBLISH_PORT = int(os.environ.get("QWEN38_FIRST_RUN_TEST_PORT", "18585"))
WHEELS_PORT = PUBLISH_PORT + 1
TAG = "qwen38-stack:cpu-imagetest"
PROJECT = "qwen38-firstrun"
UP_TIMEOUT_S = 900
ARTIFACT = "tiny-hub-target"
HUB_REPO = "qwen38-tests/tiny-target"
COMMIT = "7" * 40
WEIGHTS = "model.safetensors"
EXTRA, EXTRA_BYTES = "training_args.bin", 30_000_000
CDN_BYTES_PER_S = 1_200_000  # EXTRA then takes ~25 s: more than one progress interval (20 s)


@pytest.fixture(scope="module")
def record() -> Record:
    return Record(WORK, name="first-run.json")


@pytest.fixture(scope="module")
def daemon() -> Iterator[PrivateDockerDaemon]:
    with started_daemon(WORK / "docker") as instance:
        yield instance


@pytest.fixture(scope="module")
def image(daemon: PrivateDockerDaemon, record: Record) -> str:
    base = os.environ.get("QWEN38_BASE_IMAGE") or standin_base(daemon, WORK, BOOKWORM_PYTHON, record)
    labels = build_args(IMAGES["cpu"], source_revision())
    with wheel_mirror(WHEELS_PORT) as torch_source:
        seconds = build_image(
            daemon, "docker/Dockerfile.cpu", TAG, {"BASE_IMAGE": base, **labels, **torch_source}, WORK / "build.log"
        )
    record.add(build_seconds=round(seconds, 1))
    return TAG


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> dict[str, bytes]:
    """The tiny target as a repo on the hub: what `qwen38 tiny` writes, less our manifest."""
    out = tmp_path_factory.mktemp("tiny")
    made = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "tiny", "--out", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    target = out / "target"
    files = {p.name: p.read_bytes() for p in sorted(target.iterdir()) if p.is_file() and not p.name.startswith("qwen38-")}
    # A file larger than huggingface_hub's 10 MiB write chunk (the staging file, whose size the
    # progress lines report, grows by such chunks), of a kind model repos carry and vLLM does not
    # load beside safetensors weights.
    files[EXTRA] = hashlib.shake_256(b"qwen38 first run").digest(EXTRA_BYTES)
    return files


@pytest.fixture(scope="module")
def hub(upstream: dict[str, bytes]) -> Iterator[FakeHub]:
    instance = FakeHub()
    instance.add_commit(HUB_REPO, COMMIT, {**upstream, "README.md": b"# tiny target\n"})
    instance.start()
    try:
        yield instance
    finally:
        instance.stop()


def _profiles(directory: Path, upstream: dict[str, bytes]) -> Path:
    """The image's profiles/, with `cpu` serving a target from the hub and a lock that pins it
    by commit only (the way the real lock pins the GPU targets), one hash known."""
    profiles = directory / "profiles"
    shutil.copytree(REPO / "profiles", profiles)
    text = (profiles / "cpu.toml").read_text()
    text = text.replace('[models.target]\ndir = "tiny/target"\ngenerated = "tiny"',
                        f'[models.target]\ndir = "hub/target"\nartifact = "{ARTIFACT}"')  # fmt: skip
    # One id: the tiny adapter is bound to the generated target, not to this one.
    text = re.sub(r'\nadapter = "qwen3\.8-27b-mode-b"', "", text)
    text = re.sub(r"\n\[models\.adapter\]\n[^\[]*", "\n", text)
    text = re.sub(r"\n\[lora\]\n[^\[]*", "\n", text)
    (profiles / "cpu.toml").write_text(text)
    weights = upstream[WEIGHTS]
    known = LockedFile(path=WEIGHTS, size=len(weights), sha256=hashlib.sha256(weights).hexdigest())
    lock = load_lock(profiles / "artifacts.lock.toml").with_artifact(
        LockedArtifact(key=ARTIFACT, source="hub", repo=HUB_REPO, revision=COMMIT, files=UNPINNED,
                       exclude=("*.md",), known=(known,), note="the first-run test's target")  # fmt: skip
    )
    write_lock(ArtifactLock(version=lock.version, artifacts=lock.artifacts), profiles / "artifacts.lock.toml")
    return profiles


@dataclass
class FirstRun:
    project: ComposeProject
    hub: FakeHub
    token: str
    upstream: dict[str, bytes]
    refused: str  # what the first `up` printed and logged (the flipped byte)
    up_output: str


@pytest.fixture(scope="module")
def first_run(
    daemon: PrivateDockerDaemon, image: str, hub: FakeHub, upstream: dict[str, bytes], record: Record,
    tmp_path_factory,
) -> Iterator[FirstRun]:  # fmt: skip
    from entrypoint.keys import init_key_file

    directory = tmp_path_factory.mktemp("first-run")
    (directory / "secrets").mkdir(mode=0o700)
    key_file = directory / "secrets" / "api_key"
    init_key_file(key_file)
    key_file.chmod(0o644)  # the server's uid reads it; the 0700 directory keeps other users out
    token = "hf_" + secrets.token_hex(16)
    token_file = directory / "secrets" / "hf_token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o644)  # prepare runs as the image's user, like the server
    profiles = _profiles(directory, upstream)
    (directory / ".env").write_text(
        f"IMAGE_CPU={image}\nPUBLISH_PORT={PUBLISH_PORT}\nLOG_LEVEL=info\n"
        f"HF_ENDPOINT={hub.hub_url}\nHF_TOKEN_FILE=./secrets/hf_token\n"
    )
    mount = f"{profiles}:/opt/qwen38/profiles:ro"
    override = {
        "services": {
            "prepare-cpu": {"pull_policy": "never", "network_mode": "host", "volumes": [mount]},
            # A beat every 5 s instead of 30: the tiny model's start is shorter than one.
            "cpu": {"pull_policy": "never", "volumes": [mount], "environment": {"QWEN38_HEARTBEAT_S": "5"}},
        }
    }
    (directory / "override.yaml").write_text(yaml.safe_dump(override, sort_keys=False))
    project = ComposeProject(
        daemon, directory, PROJECT, (COMPOSE_FILE, directory / "override.yaml"), key=key_file.read_text().strip()
    )
    project.compose("down", "-v", "--remove-orphans", timeout=300)
    try:
        hub.corrupt.add(WEIGHTS)
        refused = project.compose("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        refused_logs = project.compose("logs", "--no-color", "prepare-cpu").stdout
        hub.corrupt.clear()
        hub.throttle = CDN_BYTES_PER_S
        start = time.monotonic()
        up = project.compose("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
        assert up.returncode == 0, up.stdout + up.stderr
        project.seconds_to_healthy = wait_healthy(project, "cpu", start, UP_TIMEOUT_S)
        record.add(first_up_to_healthy_seconds=round(project.seconds_to_healthy, 1))
        hub.throttle = None
        yield FirstRun(project, hub, token, upstream, refused.stdout + refused.stderr + refused_logs, up.stdout)
    finally:
        (WORK / "first-run-compose.log").write_text(project.compose("logs", "--no-color").stdout)
        project.compose("down", "-v", "--remove-orphans", timeout=300)


def _logs(run: FirstRun, service: str | None = None) -> str:
    return run.project.compose("logs", "--no-color", *([service] if service else [])).stdout


def test_a_flipped_byte_is_refused_with_both_hashes_and_nothing_is_served(first_run):
    weights = first_run.upstream[WEIGHTS]
    expected = hashlib.sha256(weights).hexdigest()
    flipped = bytearray(weights)
    flipped[0] ^= 0xFF  # what the stand-in serves under `corrupt`
    assert f"sha256 expected {expected}" in first_run.refused
    assert f"found {hashlib.sha256(bytes(flipped)).hexdigest()}" in first_run.refused
    assert "nothing was installed" in first_run.refused
    assert "prepare-cpu" in first_run.refused and "didn't complete successfully" in first_run.refused


def test_the_commit_is_listed_at_first_use_recorded_in_the_volume_and_served(first_run):
    logs = _logs(first_run, "prepare-cpu")
    assert re.search(
        rf"{ARTIFACT}: pinned \d+ files \(0\.03 GB\) of {HUB_REPO} from the hub's listing: commit {COMMIT}, 1 agree "
        r"with the repository lock's hashes; recorded in /models/artifacts\.local\.toml",
        logs,
    ), logs[-3000:]
    cid = first_run.project.container("cpu")["Id"]
    local = tomllib.loads(first_run.project.daemon.docker("exec", cid, "cat", "/models/artifacts.local.toml").stdout)
    entry = local["artifacts"][ARTIFACT]
    assert entry["revision"] == COMMIT and entry["pinned_by"] == "first-use"
    assert {f["path"]: f["sha256"] for f in entry["files"]} == {
        p: hashlib.sha256(b).hexdigest() for p, b in first_run.upstream.items()
    }
    shown = first_run.project.daemon.docker("exec", cid, "qwen38", "lock", "show").stdout
    assert f"pinned    {ARTIFACT}  {HUB_REPO}@{COMMIT}" in shown and "from: first use (" in shown


def test_progress_lines_and_the_start_heartbeat_are_in_compose_logs(first_run):
    prepare = _logs(first_run, "prepare-cpu")
    # Without a TTY: a line per interval with bytes, percent, rate and time left (a ~25 s download).
    line = rf"qwen38: {ARTIFACT}: download {EXTRA}: [\d.]+ MB of 30.0 MB \(\d+%\), [\d.]+ [kM]B/s, \d+ s left"
    assert re.search(line, prepare), prepare[-3000:]
    server = _logs(first_run, "cpu")
    assert re.search(r"qwen38: starting: .+ \(\d+ s in, .+ left of READY_TIMEOUT\)", server), server[-3000:]


def test_the_token_reaches_the_hub_as_a_secret_and_no_log_or_environment(first_run):
    assert f"Bearer {first_run.token}" in first_run.hub.authorizations
    everything = _logs(first_run) + first_run.refused + first_run.up_output
    assert first_run.token not in everything and first_run.project.key not in everything
    for service in ("prepare-cpu", "cpu"):
        config = first_run.project.container(service)["Config"]
        assert not any(first_run.token in value for value in config["Env"])
    assert not any("hf_token" in m.get("Source", "") for m in first_run.project.container("cpu")["Mounts"])


def test_validate_apis_passes_through_the_published_port(first_run, record):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "validate", "apis", "--json",
         "--base-url", first_run.project.base_url(PUBLISH_PORT)],
        cwd=REPO, env=cli_env(first_run.project.key), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(result.stdout)
    failed = [c for c in report["checks"] if c["outcome"] != "pass"]
    assert result.returncode == 0 and not failed, failed or result.stderr
    record.add(validate_apis_seconds=round(time.monotonic() - start, 1), validate_apis_checks=len(report["checks"]))


def test_a_restart_verifies_from_the_stat_cache_in_under_5_s(first_run, record):
    project = first_run.project
    assert project.compose("restart", "cpu", timeout=300).returncode == 0
    start = time.monotonic()
    wait_healthy(project, "cpu", start, UP_TIMEOUT_S)
    verified = re.findall(r"qwen38: verified cpu in ([\d.]+) s", _logs(first_run, "cpu"))
    assert len(verified) >= 2, verified  # the first start's and the restart's
    record.add(first_verify_seconds=float(verified[0]), restart_verify_seconds=float(verified[-1]))
    assert float(verified[-1]) < 5.0
