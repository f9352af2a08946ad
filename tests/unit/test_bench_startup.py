"""`qwen38 bench startup` starts the profile the user's settings name, PROFILES_DIR included."""

from __future__ import annotations

from bench.startup import engine_env
from core.profiles import PROFILES_DIR


def test_a_profile_from_profiles_dir_that_needs_a_key_gets_a_throwaway_one(tmp_path, monkeypatch):
    mine = tmp_path / "profiles"
    mine.mkdir()
    (mine / "mine.toml").write_text((PROFILES_DIR / "cpu.toml").read_text())  # require_api_key = true
    monkeypatch.chdir(tmp_path)
    for name in ("VLLM_API_KEY", "API_KEY_FILE", "PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PROFILES_DIR", str(mine))
    env = engine_env("mine", tmp_path)
    assert (tmp_path / "api_key").is_file() and env["API_KEY_FILE"] == str(tmp_path / "api_key")
