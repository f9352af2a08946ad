"""`entrypoint.client.parse_metrics`: Prometheus text -> `Metrics` (prometheus_client's parser)."""

from __future__ import annotations

from entrypoint.client import parse_metrics

TRICKY = r"""# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="a}b, \"c\" d"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="a}b, \"c\" d"} 2.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="plain"} 7.0
"""


def test_a_label_value_with_a_brace_a_comma_and_an_escaped_quote_is_one_label():
    """The old regex stopped the label set at the first ``}`` and dropped these samples."""
    metrics = parse_metrics(TRICKY)
    tricky = 'a}b, "c" d'
    assert metrics.samples["vllm:request_success_total"][0] == (
        {"engine": "0", "finished_reason": "stop", "model_name": tricky}, 3.0)
    assert metrics.total("vllm:request_success_total", model_name=tricky) == 5.0
    assert metrics.total("vllm:request_success_total") == 12.0
    assert metrics.by_label("vllm:request_success_total", "model_name") == {tricky: 5.0, "plain": 7.0}


def test_samples_keep_their_own_names_and_a_malformed_line_costs_only_itself():
    text = """# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.5"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 4.0
vllm:e2e_request_latency_seconds_sum 9.5
vllm:e2e_request_latency_seconds_count 4.0
not a sample {
process_start_time_seconds 1.7e9
"""
    metrics = parse_metrics(text)
    assert metrics.by_label("vllm:e2e_request_latency_seconds_bucket", "le") == {"0.5": 1.0, "+Inf": 4.0}
    assert metrics.total("vllm:e2e_request_latency_seconds_sum") == 9.5
    assert metrics.total("vllm:e2e_request_latency_seconds_count") == 4.0
    assert metrics.total("process_start_time_seconds") == 1.7e9
    assert parse_metrics("").samples == {}
