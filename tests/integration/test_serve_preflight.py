"""`qwen38 serve` refuses before loading a weight: a profile that cannot fit its KV pool
never reaches vLLM's engine (the held engine, importing vLLM meanwhile, is gone with nothing
it printed), and a plan is reused across restarts while nothing it depends on changed."""

from __future__ import annotations

import re

import pytest

from entrypoint.lifecycle import processes_with
from tests.conftest import clean_env, free_port, run_cli

pytestmark = pytest.mark.integration


def test_a_profile_that_cannot_fit_is_refused_before_vllm_loads_anything(tiny_root, api_key_file, tmp_path):
    env = clean_env(MODELS_DIR=str(tiny_root), API_KEY_FILE=str(api_key_file), CACHE_DIR=str(tmp_path / "cache"),
                    PORT=str(free_port()), KV_CACHE_MEMORY_BYTES=str(2 << 20))
    result = run_cli("serve", "--profile", "cpu", env=env, timeout=600)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("qwen38: plan: profile cpu: a 32,768-token request does not fit the 2,097,152-byte KV pool")
    assert "lower MAX_MODEL_LEN or raise KV_CACHE_MEMORY_BYTES" in last
    assert "qwen38: verified cpu" in result.stdout
    assert not (tmp_path / "cache" / "run" / "cpu.vllm.yaml").exists()  # nothing was rendered to run
    assert not re.search(r"^(INFO|WARNING|ERROR) \d\d-\d\d ", result.stdout + result.stderr, re.M)  # no vLLM log line
    assert processes_with(f"CACHE_DIR={tmp_path / 'cache'}") == []  # the held engine went with the refusal

    again = run_cli("serve", "--profile", "cpu", env=env, timeout=600)
    assert again.returncode == 2 and again.stderr == result.stderr  # the cached verdict, same line


def test_a_context_the_model_cannot_take_is_refused_before_anything_is_hashed(tiny_root, api_key_file, tmp_path):
    env = clean_env(MODELS_DIR=str(tiny_root), API_KEY_FILE=str(api_key_file), CACHE_DIR=str(tmp_path / "cache"),
                    PORT=str(free_port()), MAX_MODEL_LEN="100000")
    result = run_cli("serve", "--profile", "cpu", env=env, timeout=120)
    assert result.returncode == 2 and "qwen38: verified" not in result.stdout
    assert result.stderr.strip() == (
        f"qwen38: settings: MAX_MODEL_LEN=100000: above the 32,768 positions the model is made for "
        f"({tiny_root / 'tiny' / 'target' / 'config.json'}); use at most 32,768"
    )
