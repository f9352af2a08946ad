"""`qwen38 plan` as a user runs it: the profile comes from PROFILES_DIR, and the plan leaves
vLLM's model information where the engine of that shape will look for it (so the engine's
first start does not import vLLM a second time to inspect the model class)."""

from __future__ import annotations

import json

import pytest

from core.profiles import PROFILES_DIR, load_profile
from entrypoint.compile_cache import vllm_cache_root
from entrypoint.resolve import resolve
from tests.conftest import clean_env, run_cli
from tests.support.plans import user_settings

pytestmark = pytest.mark.integration


def test_plan_reads_its_profile_from_profiles_dir_and_records_the_model_info(tiny_root, tmp_path):
    mine = tmp_path / "profiles"
    mine.mkdir()
    text = (PROFILES_DIR / "cpu.toml").read_text()
    assert "max_model_len = 32768" in text
    (mine / "mine.toml").write_text(text.replace("max_model_len = 32768", "max_model_len = 2048"))
    cache = tmp_path / "cache"
    env = clean_env(PROFILES_DIR=str(mine), MODELS_DIR=str(tiny_root), CACHE_DIR=str(cache))
    done = run_cli("plan", "--profile", "mine", "--json", "--no-compare", env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert (plan["profile"], plan["max_model_len"], plan["fits"], plan["reused"]) == ("mine", 2048, True, False)

    resolved = resolve(load_profile("mine", mine), user_settings("cpu", models_dir=tiny_root))
    info = vllm_cache_root(cache, resolved) / "modelinfos" / "vllm-model_executor-models-qwen3_5-Qwen3_5ForCausalLM.json"
    recorded = json.loads(info.read_text())
    assert recorded["modelinfo"]["architecture"] == "Qwen3_5ForCausalLM" and recorded["modelinfo"]["is_hybrid"]
