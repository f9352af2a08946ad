"""Issue 57: `qwen38 bench steps` against the real vLLM 0.28.0 CPU server of the `cpu` profile
served with TORCH_PROFILE_DIR: vLLM's own profiler routes record the trace, and the table's
parts add up to the measured step.

Opt-in (QWEN38_STEP_PROFILE_TEST=1): a server of its own, and vLLM writes a CPU trace of some
70,000 op events per decode step, which takes it minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import clean_env, launch_server, run_cli, stop_server, wait_ready

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("QWEN38_STEP_PROFILE_TEST") != "1", reason="opt-in: QWEN38_STEP_PROFILE_TEST=1 (minutes)"
    ),
]

# The parts of a step sum to it by construction; the rows are rounded to the nanosecond each.
SUM_TOLERANCE_US = 0.01


def test_bench_steps_profiles_steady_decode_steps_of_the_cpu_server(tmp_path, tiny_root, api_key_file):
    traces = tmp_path / "traces"
    traces.mkdir()
    server = wait_ready(launch_server(tmp_path, tiny_root, api_key_file, "cpu", TORCH_PROFILE_DIR=str(traces)))
    try:
        out = tmp_path / "steps.json"
        result = run_cli(
            "bench", "steps", "--base-url", server.base_url, "--model", "qwen3.8-27b",
            "--api-key-file", str(api_key_file), "--trace-dir", str(traces), "--concurrency", "1",
            "--steps", "4", "--warmup-steps", "2", "--out", str(out),
            env=clean_env(), timeout=1500,
        )  # fmt: skip
    finally:
        stop_server(server)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["versions"]["vllm"] == "0.28.0" and doc["versions"]["device"].startswith("CPU: ")
    assert doc["command"].startswith("qwen38 bench steps --base-url")
    (point,) = doc["points"]
    assert point["kind"] == "cpu" and point["concurrency"] == 1 and point["steps"] >= 1
    rows = {row["part"]: row["us_per_step"] for row in point["rows"]}
    assert abs(sum(rows.values()) - point["step_us"]) <= SUM_TOLERANCE_US
    assert rows["gemm_other"] > 0 and rows["attention"] > 0
    assert rows["gdn_conv"] + rows["gdn_recurrent"] > 0
    assert rows["drafter"] == 0  # the `cpu` profile's default: prefix caching, no drafter
    assert out.with_suffix(".md").read_text().startswith("# Step profile")
