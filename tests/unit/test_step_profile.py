"""Issue 57, `qwen38 bench steps`: the step profile's classifier and table (bench/step_profile.py).

The CPU fixture, tests/fixtures/step_profile_cpu.json.gz, is a real trace of the `cpu` profile
(DFlash drafter on, two streams) recorded through vLLM 0.28.0's /start_profile and
/stop_profile, trimmed to three consecutive steady decode steps: their vLLM scopes, the ops
of 1.5 ms or more, every aten::linear and a few of each custom op (572 events). Trimming drops
events, never moves one, so the nesting is the trace's own. The CUDA document is built here
from the fields Kineto writes for kernels and their launches (cat, name, ts, dur, args.correlation).
The CUDA fixture, tests/fixtures/step_profile_cuda.json.gz, is a real trace of full-scale `single`
with SPECULATION=mtp (generated weights, one stream) on the lent H100 of 2026-12-07, trimmed to
four consecutive steady steps: every host event of that window and the device events they launched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import step_profile as sp
from core.errors import BenchError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "step_profile_cpu.json.gz"
CUDA_FIXTURE = FIXTURE.with_name("step_profile_cuda.json.gz")


@pytest.fixture(scope="module")
def cpu_trace() -> dict:
    return sp.load_trace(FIXTURE)


def _rows(point: dict) -> dict[str, float]:
    return {row["part"]: row["us_per_step"] for row in point["rows"]}


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("aten::_slow_conv2d_forward", "gdn_conv"),
        ("_causal_conv1d_update_kernel", "gdn_conv"),
        ("_C::fused_sigmoid_gating_delta_rule_update_spec_cpu", "gdn_recurrent"),
        ("fused_recurrent_gated_delta_rule_fwd_kernel", "gdn_recurrent"),
        ("_C::chunk_gated_delta_rule_cpu", "gdn_recurrent"),
        ("_C::fused_gdn_gating_cpu", "gdn_gating"),
        ("vllm::cpu_gdn_attention_core", "gdn_other"),
        ("Marlin<256, 1, 8, 8, 4, 8>", "gemm_w4a16"),
        ("machete_mm_kernel", "gemm_w4a16"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm_other"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm_other"),
        ("aten::mm", "gemm_other"),
        ("aten::linear", "gemm_other"),
        ("_C::rms_norm", "norm"),
        ("aten::rsqrt", "norm"),
        ("vllm::unified_attention_with_output", "attention"),
        ("_C::cpu_attn_reshape_and_cache", "attention"),
        ("flash_fwd_splitkv_kernel", "attention"),
        ("_C::rejection_greedy_sample_kernel_impl", "sampling"),
        ("aten::slice", None),
        ("aten::copy_", None),
    ],
)
def test_names_fall_into_their_family(name, part):
    assert sp.family(name) == part


def test_the_cpu_trace_parts_sum_to_the_step_and_name_every_kernel_family(cpu_trace):
    point = sp.analyse(cpu_trace, concurrency=2)
    assert point["kind"] == "cpu"
    assert point["steps"] == 2  # three steady scopes: the last has no successor
    rows = _rows(point)
    # Every microsecond of a step in exactly one row: the sum is the step, not about it.
    # (Each row is rounded to the nanosecond, hence the 0.01 us.)
    assert sum(rows.values()) == pytest.approx(point["step_us"], abs=0.01)
    assert point["parts_sum_us"] == pytest.approx(point["step_us"], abs=0.01)
    assert "device_idle" not in rows  # no device stream in a CPU trace
    for part in ("gemm_other", "gdn_conv", "gdn_recurrent", "attention", "lm_head", "drafter", "sampling",
                 "other_ops", "host_in_step", "host_between"):  # fmt: skip
        assert rows[part] > 0, part
    assert rows["gemm_w4a16"] == 0  # the CPU build's tiny target is bf16
    assert 0.4 < point["step_us"] / 1e6 < 1.5  # the recorded steps took ~0.67 s each
    assert sum(row["share"] for row in point["rows"]) == pytest.approx(1.0, abs=1e-3)


def test_no_steady_step_at_a_concurrency_the_trace_never_ran(cpu_trace):
    with pytest.raises(ValueError, match="no steady decode step at concurrency 3"):
        sp.analyse(cpu_trace, concurrency=3)


def test_the_step_scope_names_vllm_writes_are_parsed(cpu_trace):
    pid_tid = sp.engine_thread(cpu_trace)
    host = [e for e in cpu_trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e["tid"]) == pid_tid]
    steps = sp.steps_of(sp._nest(host))
    assert [(s.prefill_requests, s.decode_requests, s.decode_tokens) for s in steps] == [(0, 2, 10), (0, 2, 10)]


def _x(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def _kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": 7}}  # fmt: skip


def _cuda_step(t0: float, c: int) -> list[dict]:
    """One decode step: a graph launch of the target (GEMM, conv, attention), sampling,
    then the drafter; the kernels run 10 us after their launch."""
    return [
        _x("user_annotation", "execute_context_0(0)_generation_1(4)", t0, 100),
        _x("user_annotation", "gpu_model_runner: forward", t0 + 5, 60),
        _x("cuda_runtime", "cudaGraphLaunch", t0 + 10, 5, correlation=c),
        _x("user_annotation", "gpu_model_runner: postprocess", t0 + 70, 20),
        _x("cpu_op", "aten::linear", t0 + 72, 10),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 75, 2, correlation=c + 1),
        _x("user_annotation", "gpu_model_runner: sample", t0 + 110, 20),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 112, 2, correlation=c + 2),
        _x("user_annotation", "gpu_model_runner: draft", t0 + 140, 30),
        _x("cuda_runtime", "cudaGraphLaunch", t0 + 145, 5, correlation=c + 3),
        _kernel("Marlin<256, 1, 8, 8, 4, 8>", t0 + 20, 40, c),
        _kernel("_causal_conv1d_update_kernel", t0 + 60, 10, c),
        _kernel("flash_fwd_splitkv_kernel", t0 + 75, 15, c),  # 5 us idle before it
        _kernel("nvjet_tst_64x8", t0 + 90, 10, c + 1),
        _kernel("rejection_greedy_sample_kernel", t0 + 120, 5, c + 2),  # 20 us idle before it
        _kernel("Marlin<256, 1, 8, 8, 4, 8>", t0 + 155, 25, c + 3),
    ]


def test_a_cuda_trace_is_read_by_its_kernels_tied_to_their_launches():
    events = _cuda_step(0, 10) + _cuda_step(200, 20) + _cuda_step(400, 30) + _cuda_step(600, 40)
    trace = {"deviceProperties": [{"name": "NVIDIA H100 80GB HBM3"}], "vllm_version": "0.28.0", "traceEvents": events}
    point = sp.analyse(trace, concurrency=1)
    assert point["kind"] == "cuda"
    # Four scopes, three steps (the last scope has no successor), two device windows (the
    # third step's has no next first kernel).
    assert point["steps"] == 2
    assert point["step_us"] == 200  # first kernel to the next step's first kernel
    rows = _rows(point)
    assert rows == pytest.approx({
        "gemm_w4a16": 40, "gemm_other": 0, "gdn_conv": 10, "gdn_recurrent": 0, "gdn_gating": 0, "gdn_other": 0,
        "norm": 0, "attention": 15, "lm_head": 10, "drafter": 25, "sampling": 5, "other_ops": 0,
        # Idle: 5 before the attention, 20 before the sampling, 30 before the drafter; then the
        # device waits on the host from the drafter's end (180) to the next step's first kernel (220).
        "device_idle": 55, "host_between": 40,
    })  # fmt: skip
    assert sum(rows.values()) == point["step_us"]
    assert sp.trace_versions(trace) == {"vllm": "0.28.0", "gpus": ["NVIDIA H100 80GB HBM3"]}


def test_a_real_cuda_trace_splits_the_step_into_parts_that_sum_to_it_and_counts_its_launches(tmp_path, capsys):
    trace = sp.load_trace(CUDA_FIXTURE)
    point = sp.analyse(trace, concurrency=1)
    assert point["kind"] == "cuda" and point["steps"] == 3 and point["tokens_verified_per_step"] == 5  # 1 + 4 MTP
    rows = _rows(point)
    assert sum(rows.values()) == pytest.approx(point["step_us"], abs=0.01)
    # What the lease measured: every part a served target has, the drafter's scope, and device gaps.
    for part in ("gemm_w4a16", "gdn_conv", "gdn_recurrent", "norm", "attention", "lm_head", "drafter", "sampling",
                 "device_idle"):
        assert rows[part] > 0, part
    assert rows["gemm_w4a16"] == max(rows.values())  # the 4-bit weights' GEMMs are the largest part
    assert point["launches_per_step"] == {"device_events": 1627, "cudaGraphLaunch": 9, "kernel_launches": 124,
                                          "memcpy_memset": 88}
    # The idle time, split by the host scope that launched the kernel ending each gap, is all of it;
    # on this trace most of it waits on the step's input preparation.
    idle = point["idle_by_scope_us"]
    assert sum(idle.values()) == pytest.approx(rows["device_idle"], abs=0.01)
    assert max(idle, key=idle.get) == "gpu_model_runner: preprocess"
    assert sp.trace_versions(trace) == {"vllm": "0.28.0", "gpus": ["NVIDIA H100 80GB HBM3"]}
    # The same through `qwen38 bench steps --from-trace` (a trace brought back from a lease).
    from entrypoint.cli import main

    out = tmp_path / "steps.json"
    assert main(["bench", "steps", "--from-trace", str(CUDA_FIXTURE), "--concurrency", "1", "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    assert "9 CUDA-graph launches, 124 eager kernel launches" in text and "NVIDIA H100" in text
    assert "by the host scope that launched the kernel ending each gap: gpu_model_runner: preprocess" in text
    with pytest.raises(BenchError, match="2 traces for 1 concurrencies"):
        sp.from_traces([CUDA_FIXTURE, CUDA_FIXTURE], [1], command="x", machine={})
    capsys.readouterr()
    assert main(["bench", "steps", "--out", str(out)]) != 0
    assert "--base-url, --model, --trace-dir needed against a server (or --from-trace FILE)" in capsys.readouterr().err


def test_idle_gaps_go_to_the_scope_whose_launch_ends_them():
    kernels = [(0, 10, "gemm_other", "a"), (15, 20, "norm", "b"), (18, 30, "norm", "c"), (40, 45, "gemm_other", "a"),
               (120, 130, "norm", "x")]
    # 10-15 ends with b's launch, 30-40 with a's; c overlaps b (no gap); x starts past the window.
    parts, idle = sp.cuda_step_parts(kernels, (0, 100))
    assert idle == {"b": 5, "a": 10} and parts["device_idle"] == 15


def test_the_markdown_names_the_versions_the_command_and_every_row(cpu_trace):
    point = sp.analyse(cpu_trace, concurrency=2)
    doc = {
        "command": "qwen38 bench steps --concurrency 2",
        "versions": {"vllm": "0.28.0", "torch": "2.x", "device": "CPU: AMD EPYC (2 cores)"},
        "points": [point],
    }
    text = sp.markdown(doc)
    assert "`qwen38 bench steps --concurrency 2`" in text and "vLLM 0.28.0" in text and "CPU: AMD EPYC" in text
    for row in point["rows"]:
        assert f"| {row['label']} |" in text
    assert "**100.0 %**" in text


def test_a_new_worker_trace_is_waited_for_and_the_frontend_one_ignored(tmp_path):
    (tmp_path / "vm_1.async_llm.1.pt.trace.json.gz").write_bytes(b"x")
    before = sp.trace_files(tmp_path)
    assert before == set()
    new = tmp_path / "123-rank-0.456.pt.trace.json.gz"
    new.write_bytes(b"{}")
    assert sp.wait_for_trace(tmp_path, before, timeout=5, poll=0.05) == new
    with pytest.raises(BenchError, match="no new worker trace .* after 0 s \\(--trace-timeout"):
        sp.wait_for_trace(tmp_path, {new}, timeout=0.2, poll=0.05)
    # The GPU worker's names (vLLM's rank suffix, and its fallback seen on the H100 of 2026-12-07);
    # a graph capture's trace and another rank's are not rank 0's steps.
    for other in ("graph_capture_rank_0.1.pt.trace.json.gz", "dp0_pp0_tp1_dcp0_ep0_rank1.2.pt.trace.json.gz",
                  "rank10.3.pt.trace.json.gz"):
        (tmp_path / other).write_bytes(b"{}")
    gpu = [tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.7.pt.trace.json.gz", tmp_path / "rank0.8.pt.trace.json.gz"]
    for path in gpu:
        path.write_bytes(b"{}")
    assert sp.trace_files(tmp_path) == {new, *gpu}
