"""The planner against the engine it predicts: for a tiny Qwen3.5 hybrid on the CPU
engine, `plan_profile` reports the same "GPU KV cache size" and maximum concurrency
that the real vLLM 0.28.0 engine logs when it starts with the same settings."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from entrypoint.plan import plan_profile
from entrypoint.profiles import Profile
from prepare.generate import int8_embed_pair
from tests.support.vllm_views import child_pythonpath, run_python, vllm_views  # noqa: F401

pytestmark = pytest.mark.integration

ENGINE = r"""
import sys
from vllm import LLM


def main(path):
    LLM(model=path, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20, mamba_ssm_cache_dtype="float32",
        max_model_len=512, max_num_seqs=4, enforce_eager=True, dtype="bfloat16", enable_prefix_caching=False)


if __name__ == "__main__":
    main(sys.argv[1])
"""


def test_cpu_plan_equals_what_the_engine_logs(vllm_views, tmp_path_factory, tmp_path, monkeypatch):
    models = tmp_path_factory.mktemp("models")
    tiny = int8_embed_pair(models / "build")
    (models / "tiny-hybrid").symlink_to(tiny["dequantized"])
    profile = Profile.model_validate(
        {
            "name": "cpu-tiny",
            "description": "tiny hybrid on the CPU engine",
            "platform": "cpu",
            "machine": "any",
            "served": {"base": "tiny"},
            "models": {"target": {"dir": "tiny-hybrid", "generated": "tiny"}},
            "engine": {
                "max_model_len": 512,
                "max_num_seqs": 4,
                "kv_cache_memory_bytes": 64 << 20,
                "mamba_ssm_cache_dtype": "float32",
                "dtype": "bfloat16",
                "enable_prefix_caching": False,
            },
        }
    )
    monkeypatch.setenv("PYTHONPATH", child_pythonpath())
    plan = plan_profile(profile, SimpleNamespace(models_dir=Path(models)), compare=False)

    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    code = f"import runpy, sys; sys.argv = ['e', {str(tiny['dequantized'])!r}]; runpy.run_path({str(script)!r}, run_name='__main__')"
    done = run_python(
        code, None, vllm_views["pycache"], timeout=1200, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="INFO"
    )
    logs = done.stdout + done.stderr
    found = re.search(
        r"GPU KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
        logs,
    )
    assert found, logs[-3000:]
    assert plan.pool_tokens == int(found[1].replace(",", ""))
    assert f"{plan.max_concurrency:.2f}" == found[2]
    # The plan answers for the tree that serves: the installed one (patched by `make setup`).
    from entrypoint.patches import all_present, check_series, find_vllm_dir

    assert plan.patched == all_present(check_series(find_vllm_dir())) and plan.fits
