"""The benchmark arithmetic: percentiles, per-request timing, /metrics deltas (parsed from
vLLM's Prometheus text format), acceptance figures, consistency checks, and the result
document, table, comparison and plot built from them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench import report
from bench.measurement import PointRun, RequestSpec
from bench.stats import (
    MetricDelta,
    RequestRecord,
    consistency_checks,
    distribution,
    metric_delta,
    percentile,
    speculation,
    summarize,
)
from bench.workloads import WORKLOADS, Point, params_from_args
from core.errors import BenchError
from entrypoint.client import parse_metrics


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(n, q):
    values = [random.Random(i * 7 + n).expovariate(1.0) for i in range(n)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_nonsense():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert distribution([]) is None
    assert distribution([2.0, 4.0]) == {
        "n": 2,
        "mean": 3.0,
        "p50": 3.0,
        "p90": 3.8,
        "p99": 3.98,
        "min": 2.0,
        "max": 4.0,
    }


def _record(index=0, chunks=((0.5, 1), (0.6, 1), (0.9, 3)), **kw) -> RequestRecord:
    chunks = list(chunks)
    streamed = sum(n for _, n in chunks)
    defaults = {
        "job": 0,
        "turn": 0,
        "label": "r",
        "max_tokens": streamed,
        "expected_prompt_tokens": 100,
        "sent_s": 0.0,
        "done_s": 1.0,
        "chunks": chunks,
        "prompt_tokens": 100,
        "completion_tokens": streamed,
        "cached_tokens": 0,
        "finish_reason": "length",
        "stream_done": True,
    }
    defaults.update(kw)
    return RequestRecord(index=index, **defaults)


def test_a_chunk_of_several_tokens_counts_as_several_gaps():
    r = _record()
    assert r.streamed_tokens == 5 and r.ttft_s == 0.5
    gaps = r.token_gaps()
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert len(gaps) == r.streamed_tokens - 1
    assert sum(gaps) == pytest.approx(r.decode_s)
    # mean ITL is exactly the inverse of the single-stream decode rate
    assert r.decode_tok_s == pytest.approx(1 / (sum(gaps) / len(gaps)))


def test_tokens_arriving_with_the_first_add_zero_gaps():
    r = _record(chunks=[(0.2, 2), (0.4, 1)])
    assert r.token_gaps() == pytest.approx([0.0, 0.2])
    assert r.decode_tok_s == pytest.approx(2 / 0.2)


def test_one_token_has_no_decode_rate():
    assert _record(chunks=[(0.3, 1)]).decode_tok_s is None
    assert _record(chunks=[]).ttft_s is None


METRICS_BEFORE = """
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="qwen3.8-27b"} 100.0
vllm:prompt_tokens_total{engine="0",model_name="qwen3.8-27b"} 1000.0
vllm:prefix_cache_queries_total{engine="0",model_name="qwen3.8-27b"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="qwen3.8-27b"} 0.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen3.8-27b"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="qwen3.8-27b"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="qwen3.8-27b"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen3.8-27b",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen3.8-27b",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen3.8-27b",position="2"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen3.8-27b",position="3"} 2.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="qwen3.8-27b"} 2.0
"""


def _after(gen, prompt, queries, hits, drafts, draft_tokens, accepted, per_pos, preempted=0) -> str:
    lines = [
        f'vllm:generation_tokens_total{{engine="0",model_name="qwen3.8-27b"}} {100 + gen}',
        f'vllm:prompt_tokens_total{{engine="0",model_name="qwen3.8-27b"}} {1000 + prompt}',
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="qwen3.8-27b"}} {1000 + queries}',
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="qwen3.8-27b"}} {hits}',
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="qwen3.8-27b"}} {10 + drafts}',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="qwen3.8-27b"}} {40 + draft_tokens}',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="qwen3.8-27b"}} {20 + accepted}',
        f'vllm:num_preemptions_total{{engine="0",model_name="qwen3.8-27b"}} {2 + preempted}',
    ]
    start = [8, 6, 4, 2]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="qwen3.8-27b",position="{i}"}} '
        f"{start[i] + v}"
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines)


def _delta(**kw) -> MetricDelta:
    values = {
        "gen": 10,
        "prompt": 200,
        "queries": 200,
        "hits": 64,
        "drafts": 4,
        "draft_tokens": 16,
        "accepted": 6,
        "per_pos": [3, 2, 1, 0],
    }
    values.update(kw)
    return metric_delta(parse_metrics(METRICS_BEFORE), parse_metrics(_after(**values)))


def test_metric_deltas_and_acceptance_from_prometheus_text():
    delta = _delta()
    assert delta.counters["generation_tokens"] == 10 and delta.counters["prefix_cache_hits"] == 64
    assert delta.accepted_per_position == {0: 3, 1: 2, 2: 1, 3: 0}
    spec = speculation(delta)
    assert spec["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert spec["num_speculative_tokens"] == 4
    assert spec["per_position_acceptance"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert spec["draft_acceptance_rate"] == pytest.approx(6 / 16)


def test_no_drafts_means_no_acceptance_figure():
    delta = _delta(drafts=0, draft_tokens=0, accepted=0, per_pos=[0, 0, 0, 0])
    assert speculation(delta) is None
    assert summarize([_record()], 1.0, delta)["acceptance_length"] is None


def test_deltas_add_up_over_points():
    total = _delta() + _delta(gen=5, per_pos=[1, 0, 0, 0], accepted=1)
    assert total.counters["generation_tokens"] == 15
    assert total.accepted_per_position == {0: 4, 1: 2, 2: 1, 3: 0}


def test_preemptions_are_counted_from_vllms_counter_per_window():
    """vLLM 0.28.0's `vllm:num_preemptions` counter (exposed as `_total`) moved by the window:
    the requests the scheduler took off the GPU for want of KV pages, summed over points."""
    delta = _delta(preempted=5)
    assert delta.counters["preemptions"] == 5
    assert summarize([_record()], 1.0, delta)["preemptions"] == 5
    assert summarize([_record()], 1.0, _delta())["preemptions"] == 0
    assert (delta + _delta(preempted=3)).counters["preemptions"] == 8
    assert delta.to_json()["preemptions"] == 5


def test_a_server_without_the_preemption_counter_counts_none():
    before = parse_metrics('vllm:generation_tokens_total{engine="0"} 1.0\n')
    after = parse_metrics('vllm:generation_tokens_total{engine="0"} 9.0\n')
    assert metric_delta(before, after).counters["preemptions"] == 0


def test_summary_figures():
    records = [_record(0, sent_s=0.0, done_s=1.0), _record(1, sent_s=0.5, done_s=2.0, cached_tokens=64)]
    s = summarize(records, 2.0, _delta())
    assert s["requests"] == 2 and s["completion_tokens"] == 10
    assert s["output_tok_s"] == pytest.approx(10 / 2.0)
    assert s["total_tok_s"] == pytest.approx((10 + 200) / 2.0)
    assert s["prefix_cache"] == {"queries": 200, "hits": 64, "hit_rate": pytest.approx(64 / 200)}
    assert s["ttft_s_with_cached_prefix"]["n"] == 1 and s["ttft_s_without_cached_prefix"]["n"] == 1
    assert s["itl_s"]["n"] == 8
    assert s["cached_tokens"] == 64


def _names(checks, ok=None, fatal=None):
    return {c.name for c in checks if (ok is None or c.ok == ok) and (fatal is None or c.fatal == fatal)}


def test_consistent_numbers_pass_every_check():
    records = [_record(0), _record(1, cached_tokens=64)]
    delta = _delta(gen=10, prompt=200, drafts=4, draft_tokens=16, accepted=4, per_pos=[2, 1, 1, 0])
    checks = consistency_checks(records, delta)
    assert _names(checks, ok=False) == set()
    assert "sum of per-position accepted = accepted tokens" in _names(checks)
    assert "generation tokens = requests + drafts + accepted (every decode step drafted)" in _names(checks)


@pytest.mark.parametrize(
    ("record_kw", "delta_kw", "failed"),
    [
        ({"completion_tokens": 6}, {}, "streamed token ids = usage.completion_tokens"),
        ({"prompt_tokens": 99}, {}, "usage.prompt_tokens = /tokenize of the request"),
        ({"max_tokens": 9}, {}, "usage.completion_tokens = max_tokens (EOS ignored)"),
        ({"stream_done": False}, {}, "every stream ended with [DONE] and a usage chunk"),
        ({}, {"gen": 11}, "/metrics generation tokens = sum of usage.completion_tokens"),
        ({}, {"prompt": 150}, "/metrics prompt tokens = sum of usage.prompt_tokens"),
        ({}, {"accepted": 20, "per_pos": [5, 5, 5, 5]}, "accepted tokens <= draft tokens"),
        ({}, {"accepted": 6, "per_pos": [3, 2, 0, 0]}, "sum of per-position accepted = accepted tokens"),
        ({}, {"accepted": 6, "per_pos": [1, 2, 2, 1]}, "per-position accepted never rises with the position"),
        ({}, {"draft_tokens": 17}, "draft tokens <= drafts x K"),
    ],
)
def test_each_inconsistency_fails_its_check(record_kw, delta_kw, failed):
    records = [_record(0), _record(1, **record_kw)]
    checks = consistency_checks(records, _delta(**delta_kw))
    assert failed in _names(checks, ok=False, fatal=True)


def test_short_drafts_and_cache_mismatches_are_notes_not_failures():
    checks = consistency_checks([_record(0), _record(1)], _delta(draft_tokens=14, accepted=4, per_pos=[2, 1, 1, 0]))
    assert _names(checks, ok=False) == {
        "draft tokens = drafts x K (fixed-depth drafter)",
        "sum of usage cached_tokens = /metrics prefix-cache hits",
    }
    assert _names(checks, ok=False, fatal=True) == set()


# ---- the document, table, comparison, plot ------------------------------------------------


def _doc(scale: float = 1.0, workload: str = "c8") -> dict:
    w = WORKLOADS[workload]
    params = params_from_args(w, {"requests": 2, "concurrency": (1, 2)} if workload == "c8" else {})
    points, runs = [], []
    for n in (1, 2):
        chunks = [(0.5 / scale, 1), (0.6 / scale, 1), (0.9 / scale, 3)]
        records = [_record(0, chunks=chunks), _record(1, chunks=chunks)]
        spec = RequestSpec(body={}, expected_prompt_tokens=100, max_tokens=5)
        points.append(Point(f"concurrency {n}", n, n, [[spec], [spec]]))
        delta = _delta(drafts=4, draft_tokens=16, accepted=4, per_pos=[2, 1, 1, 0])
        runs.append(PointRun(records, 2.0 / scale, delta))
    server = {
        "base_url": "http://127.0.0.1:1",
        "model": "m",
        "models": [],
        "max_model_len": 4096,
        "vllm_version": "0.28.0",
    }
    return report.build_document(
        w,
        params,
        points,
        runs,
        run_settings={"seed": 0},
        server=server,
        machine={"cpu": "x", "cores": 2},
        versions={},
        started_at="now",
    )


def test_document_has_the_promised_top_level_fields():
    doc = _doc()
    assert doc["schema"] == report.SCHEMA and doc["workload"] == "c8"
    for key in (
        "output_tok_s",
        "ttft_s",
        "acceptance_length",
        "requests",
        "parameters",
        "server",
        "machine",
        "versions",
        "points",
        "checks",
    ):
        assert key in doc
    assert len(doc["requests"]) == 4 and doc["output_tok_s"] == pytest.approx(20 / 4.0)
    assert doc["acceptance_length"] == pytest.approx(1 + 8 / 8)
    assert [p["x"] for p in doc["points"]] == [1, 2]
    assert doc["parameters"]["requests"] == 2 and doc["parameters"]["seed"] == 0
    assert doc["preemptions"] == 0 and [p["preemptions"] for p in doc["points"]] == [0, 0]


def test_table_shows_every_point_and_the_checks():
    text = report.table(_doc())
    assert "concurrency 1" in text and "concurrency 2" in text
    header = next(line for line in text.splitlines() if line.startswith("POINT"))
    assert header.split()[-1] == "PREEMPT"
    assert "per-position acceptance 0.50 0.25 0.25 0.00" in text
    assert "checks:" in text


def test_compare_prints_ratios_and_refuses_other_workloads():
    text = report.compare(_doc(1.0), _doc(2.0), ("a.json", "b.json"))
    row = next(line for line in text.splitlines() if line.split()[:3] == ["overall", "output", "tok/s"])
    assert row.split()[-1] == "2.000"
    with pytest.raises(BenchError, match="do not compare"):
        report.compare(_doc(workload="c8"), _doc(workload="c1"), ("a", "b"))


def test_load_result_refuses_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"schema": "other"}')
    with pytest.raises(BenchError, match="expected 'qwen38-bench/1'"):
        report.load_result(path)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    report.plot([_doc(1.0), _doc(2.0)], ["a", "b"], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_copy_fidelity_counts_the_verbatim_prefix():
    assert report.copy_fidelity("\nabcdef", "abcxyz") == pytest.approx(0.5)
    assert report.copy_fidelity("abc", "abc") == 1.0
