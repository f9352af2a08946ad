"""`qwen38 bench fullscale run` end to end on this CPU: the lent GPU's run at tiny size.

The served copy is the `cpu` profile with its slots marked generated (what `profiles` does to
`single`, `long` and `spark-lora`); `run` generates its models, writes the profile, starts
`qwen38 serve` in a session of its own, waits for the readiness gate, measures c1 / c8 /
depth through the real API with the real benchmarks, reads vLLM's log and the planner, stops
the server and writes the report - the same code path as on the GPU, where only the steps
that need CUDA (patches, bandwidth, requantize's and the adapter's full-size inputs) differ.
"""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from bench import fullscale_steps as fs
from bench.fullscale_run import run
from core.profiles import load_profile
from tests.conftest import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.environ.get("QWEN38_FULLSCALE_TEST") != "1",
        reason="opt-in (2-5 min, set QWEN38_FULLSCALE_TEST=1): the lent GPU's full-scale run rehearsed on "
        "this CPU; its steps and figures are unit-tested in tests/unit/test_fullscale_run.py in every run",
    ),
]

SERVED = {"cpu-full": fs.Served("cpu", None, speculation=False)}
NOT_ON_CPU = ("patches", "bandwidth", "requantize", "adapter")


def test_a_call_that_ends_early_is_resumed_by_the_next_and_the_report_holds_every_figure(tmp_path):
    root, out = tmp_path / "run", tmp_path / "out"
    # Call 1: too short to measure: it prepares, perhaps starts the server, and says what is next.
    first = run(root, budget_s=60, size="tiny", sizes="tiny", served=SERVED, total_bytes=24 << 30,
                skip_prep=NOT_ON_CPU, base_port=free_port(), out=out)
    assert first["done"] is False and first["servers"]["cpu-full"] in ("pending", "starting", "ready")
    assert fs.read_result(root, "generate")["done"] and fs.read_result(root, "profiles")["done"]
    assert (out / "fullscale.json").exists()  # what is known so far comes back with every call
    # Call 2: (starts or finds the server started,) measures, stops, reports.
    second = run(root, budget_s=900, size="tiny", sizes="tiny", served=SERVED, total_bytes=24 << 30,
                 skip_prep=NOT_ON_CPU, base_port=free_port(), out=out)
    assert second["done"] is True, json.dumps(fs.read_result(root, "cpu-full.failed"), indent=1)[-3000:]
    assert second["servers"] == {"cpu-full": "stopped"}

    measure = fs.read_result(root, "cpu-full.measure")
    assert measure["done"] and all(b["exit"] == 0 for b in measure["bench"].values())
    for workload in ("c1", "c8"):
        decode = measure["decode"][workload]
        assert decode["step_ms"] > 0 and decode["tokens_per_step"] == 1.0  # speculation off in this copy
    assert measure["decode"]["c8"]["concurrency"] == 8
    assert [p["prompt_tokens"] > 100 for p in measure["prefill"]] == [True, True]
    # vLLM's own pool (its log) is the planner's, for the copy as served.
    assert measure["pool"]["engine_tokens"] == measure["pool"]["plan_tokens"] > 0
    assert measure["peak"] == {"bytes": None, "method": "no memory samples (no nvidia-smi on this machine)"}
    assert measure["cap_held"] is None
    # Nothing lists GPU processes here, so nothing is seen beside it (on the GPU the sampler's
    # compute-process lines name every other process on the device while it was measured).
    assert measure["measured_alone"] is True and measure["gpu_neighbours_while_measured"] == {}
    assert measure["began"] > fs.read_result(root, "cpu-full.start")["started"]

    ready = fs.read_result(root, "cpu-full.ready")
    assert ready["ready"] and ready["ready_s"] > 0
    calls = fs.read_result(root, "run")["calls"]
    actions = [e["action"] for call in calls for e in call]
    assert len(calls) == 2 and actions.count("start") == 1 and actions.count("measure") == 1

    report = json.loads((out / "fullscale.json").read_text())
    row = report["summary"]["profiles"]["cpu-full"]
    assert row["decode"]["c1"]["step_ms"] == measure["decode"]["c1"]["step_ms"] and row["ready_s"] == ready["ready_s"]
    assert "| cpu-full |" in (out / "fullscale.md").read_text()
    with tarfile.open(out / "logs.tar.xz") as tar:
        assert "logs/cpu-full.log" in tar.getnames()


def test_a_copy_served_with_mtp_measures_users_at_each_concurrency_with_its_depth(tmp_path):
    """The many-users rehearsal (issue 55's lease): the copy is served as an owner serves it,
    SPECULATION=mtp in `qwen38 serve`'s environment (no drafter read), and `--workloads users`
    measures every concurrency with the MTP depth as its drafted tokens per step."""
    root, out = tmp_path / "run", tmp_path / "out"
    # The CPU build cannot copy a hybrid target's speculative state for prefix caching (Triton).
    served = {"cpu-mtp-full": fs.Served("cpu", None, settings=(("SPECULATION", "mtp"), ("PREFIX_CACHING", "false")))}
    result = run(root, budget_s=900, size="tiny", sizes="tiny", served=served, total_bytes=24 << 30,
                 skip_prep=NOT_ON_CPU, base_port=free_port(), out=out, workloads=("users",))
    failed = fs.read_result(root, "cpu-mtp-full.failed")
    assert result["done"] is True and failed is None, json.dumps(failed, indent=1)[-3000:]
    measure = fs.read_result(root, "cpu-mtp-full.measure")
    assert list(measure["bench"]) == ["users"] and measure["bench"]["users"]["exit"] == 0
    rows = measure["users"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    depth = load_profile("cpu").speculative.depth("mtp")
    for row in rows:
        assert row["speculative_tokens"] == depth and row["tokens_per_step"] >= 1.0 and row["step_ms"] > 0
        assert row["preemptions"] == 0 and row["ttft_s"]["p50"] > 0
    log = (root / "logs" / "cpu-mtp-full.log").read_text(errors="replace")
    assert "Qwen3_5MTP" in log or '"method": "mtp"' in log or "'method': 'mtp'" in log, log[-3000:]
    assert "| cpu-mtp-full | 4 |" in (out / "fullscale.md").read_text()


def test_a_profiled_copy_measures_its_step_by_part_into_the_report(tmp_path):
    """Issue 57's lease rehearsed: a copy served with its own TORCH_PROFILE_DIR, `qwen38 bench
    steps` run by the full-scale runner against it, the step's parts in the report's table."""
    root, out = tmp_path / "run", tmp_path / "out"
    served = {"cpu-steps-full": fs.Served("cpu", None, speculation=False, profiled=True, workloads=("steps",))}
    result = run(root, budget_s=900, size="tiny", sizes="tiny", served=served, total_bytes=24 << 30,
                 skip_prep=NOT_ON_CPU, base_port=free_port(), out=out)
    failed = fs.read_result(root, "cpu-steps-full.failed")
    assert result["done"] is True and failed is None, json.dumps(failed, indent=1)[-3000:]
    measure = fs.read_result(root, "cpu-steps-full.measure")
    assert measure["bench"]["steps"]["exit"] == 0, measure["bench"]["steps"]["tail"]
    [point] = measure["steps"]
    assert point["concurrency"] == 1 and point["kind"] == "cpu" and point["tokens_verified_per_step"] == 1
    assert sum(r["ms"] for r in point["rows"]) == pytest.approx(point["step_ms"], abs=1e-3)
    assert any(fs.trace_dir(root, "cpu-steps-full").glob("*rank-0*.pt.trace.json*"))
    text = (out / "fullscale.md").read_text()
    assert "| ms per steady step | cpu-steps-full C1 |" in text and "| **step** (tokens verified) |" in text
