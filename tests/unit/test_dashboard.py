"""The Grafana dashboard the monitoring profile provisions, checked as Grafana reads it:
generated from entrypoint/dashboard.py and not drifted, every panel on the provisioned data
source, laid out without overlaps, each query named. (That each query returns data from a
real Prometheus scraping the real server: tests/integration/test_monitoring.py.)"""

from __future__ import annotations

import json

from entrypoint.dashboard import (
    DASHBOARD_PATH,
    DATASOURCE_UID,
    PANELS,
    dashboard_json,
    outside_grafana,
    render_dashboard,
)
from tests.conftest import run_cli

WANTED = {
    "output tok/s per model id": "vllm:generation_tokens_total",
    "TTFT": "vllm:time_to_first_token_seconds_bucket",
    "inter-token latency": "vllm:inter_token_latency_seconds_bucket",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "KV-cache usage": "vllm:kv_cache_usage_perc",
    "prefix-cache hits": "vllm:prefix_cache_hits_total",
    "acceptance (accepted)": "vllm:spec_decode_num_accepted_tokens_total",
    "acceptance (drafts)": "vllm:spec_decode_num_drafts_total",
    "GPU utilisation": "DCGM_FI_DEV_GPU_UTIL",
    "GPU memory": "DCGM_FI_DEV_FB_USED",
}


def test_the_committed_dashboard_is_the_generated_one():
    assert DASHBOARD_PATH.read_text() == dashboard_json(), "regenerate with `qwen38 docs`"
    shown = run_cli("dashboard", "json")
    assert shown.returncode == 0 and json.loads(shown.stdout) == render_dashboard()


def test_the_dashboard_covers_what_the_issue_asks_for():
    exprs = " ".join(q.expr for p in PANELS for q in p.queries)
    missing = {what: metric for what, metric in WANTED.items() if metric not in exprs}
    assert missing == {}


def test_every_panel_reads_the_provisioned_datasource_and_names_its_queries():
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    assert dashboard["panels"], "no panels"
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and all(t["expr"] and t["legendFormat"] for t in panel["targets"])
        assert all(t["datasource"]["uid"] == DATASOURCE_UID for t in panel["targets"])
        assert panel["fieldConfig"]["defaults"]["unit"]


def test_panels_fit_the_24_column_grid_without_overlapping():
    cells = set()
    for panel in json.loads(DASHBOARD_PATH.read_text())["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_queries_outside_grafana_have_no_grafana_variables_left():
    for panel in PANELS:
        for query in panel.queries:
            assert "$" not in outside_grafana(query.expr), query.expr
