"""`qwen38 key init`: a private key file, created once, and no directory made by a typo."""

from __future__ import annotations

import stat

from tests.conftest import clean_env, run_cli


def test_key_init_never_creates_a_directory_it_was_not_asked_for(tmp_path):
    target = tmp_path / "nonexistent-dir" / "x"
    result = run_cli("key", "init", "--file", str(target), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"qwen38: settings: --file {target}: directory {target.parent} does not exist; create it first "
        f"(`mkdir -p -m 700 {target.parent}`) or name a file in an existing directory\n"
    )
    assert not target.parent.exists()


def test_key_init_creates_the_default_private_directory_and_a_0600_key_once(tmp_path):
    first = run_cli("key", "init", env=clean_env(), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    key = tmp_path / "secrets" / "api_key"
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    content = key.read_text()
    assert content.strip() not in first.stdout  # never printed
    again = run_cli("key", "init", env=clean_env(), cwd=tmp_path)
    assert again.returncode == 0 and "kept" in again.stdout and key.read_text() == content
