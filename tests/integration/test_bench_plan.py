"""`qwen38 bench plan`: a cold plan, the same plan reused from the cache, and a re-plan
after a knob change, timed as a user runs them and recorded with the load average."""

from __future__ import annotations

import json

import pytest

from tests.conftest import clean_env, run_cli

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_plan_bench_times_cold_cached_and_replanned(tiny_root, tmp_path):
    out = tmp_path / "plan.json"
    done = run_cli("bench", "plan", "--profile", "cpu", "--out", str(out), env=clean_env(MODELS_DIR=str(tiny_root)),
                   cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads(out.read_text())["profiles"]["cpu"]
    assert [runs[k]["reused"] for k in ("cold", "cached", "replan")] == [False, True, False]
    assert runs["cached"]["pool_tokens"] == runs["cold"]["pool_tokens"]
    assert runs["replan"]["max_model_len"] == runs["cold"]["max_model_len"] // 2
    assert runs["cached"]["seconds"] < runs["cold"]["seconds"]  # no vLLM import when reused
    assert all(len(run["loadavg_before"]) == 3 for run in runs.values())
    assert "plan cpu: cold" in done.stdout
