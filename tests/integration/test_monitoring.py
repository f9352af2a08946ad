"""The monitoring profile's Prometheus config and dashboard, proven against the real servers.

A real Prometheus (Debian's package; skipped with how to install it where missing) runs the
shipped docker/monitoring/prometheus.yml with compose's network and mounts swapped for the
test's (tests/support/prometheus.py) and scrapes the session's real `cpu` servers: the plain
one (LoRA second id, prefix caching) and the speculative one (DFlash drafter). After real
traffic, every query of every dashboard panel (entrypoint.dashboard) runs through
Prometheus' HTTP API and must return data, except the GPU panels (no DCGM exporter without a
GPU: accepted by Prometheus, empty here). `promtool` checks the shipped config and rules.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest

from entrypoint.client import StackClient
from entrypoint.dashboard import PANELS, check_queries, render_png
from tests.conftest import CACHE_PREFIX_TOKENS, free_port
from tests.support.prometheus import (
    CONFIG,
    RULES,
    binaries,
    host_paths,
    running_prometheus,
    scrape_config_for,
    targets,
    wait_for_scrapes,
)

pytestmark = pytest.mark.integration


def test_promtool_accepts_the_shipped_config_and_rules(tmp_path, api_key_file):
    import yaml

    _, promtool = binaries()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(host_paths(yaml.safe_load(CONFIG.read_text()), api_key_file)))
    checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout + checked.stderr
    rules = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert rules.returncode == 0 and "SUCCESS: 3 rules found" in rules.stdout, rules.stdout + rules.stderr


def _traffic(cpu_server, cpu_spec_server) -> None:
    """Requests whose counters every panel reads: tokens, TTFT/ITL, prefix hits, drafts."""
    from entrypoint.validate.cache_isolation import validate_cache_isolation

    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        # prefix-cache queries and hits
        validate_cache_isolation(client, "qwen3.8-27b", "qwen3.8-27b-mode-b", prefix_tokens=CACHE_PREFIX_TOKENS)
        for model in ("qwen3.8-27b", "qwen3.8-27b-mode-b"):
            client.stream("/v1/completions", {"model": model, "prompt": "Caches are", "max_tokens": 16})
    with StackClient(cpu_spec_server.base_url, cpu_spec_server.api_key) as client:
        for _ in range(2):
            client.stream("/v1/completions", {"model": "qwen3.8-27b", "prompt": "Drafts are", "max_tokens": 24})


def test_every_dashboard_query_returns_data_from_a_real_prometheus_scraping_the_cpu_servers(
    cpu_server, cpu_spec_server, api_key_file, tmp_path
):
    binaries()
    port = free_port()
    servers = [url.removeprefix("http://") for url in (cpu_server.base_url, cpu_spec_server.base_url)]
    config = scrape_config_for(servers, api_key_file, own=f"127.0.0.1:{port}")
    with running_prometheus(config, tmp_path, port) as url:
        scraped = wait_for_scrapes(url, {"qwen38", "qwen38-without-key", "prometheus"}, up={"qwen38"})
        by_job = {}
        for target in scraped:
            by_job.setdefault(target["labels"]["job"], []).append(target)
        # With the key from the file (credentials_file), both servers are read; without it, neither.
        assert sorted(t["health"] for t in by_job["qwen38"]) == ["up", "up"], by_job["qwen38"]
        assert all(t["health"] == "down" and "401" in t["lastError"] for t in by_job["qwen38-without-key"])
        assert "gpu" not in {t["labels"]["job"] for t in targets(url)}  # no exporter: no target, none down

        _traffic(cpu_server, cpu_spec_server)
        wait_for_scrapes(url, {"qwen38"}, up={"qwen38"})
        import time

        time.sleep(3)  # a few more scrapes after the last request

        checks = check_queries(url, rate_interval="1m")
        assert len(checks) == sum(len(p.queries) for p in PANELS)
        gpu_titles = {p.title for p in PANELS if p.needs == "gpu"}
        empty = [f"{c.panel} / {c.legend}: {c.expr}" for c in checks if not c.has_data and c.panel not in gpu_titles]
        assert empty == [], "panel queries without data:\n" + "\n".join(empty)
        assert all(c.series == 0 for c in checks if c.panel in gpu_titles)  # valid PromQL, no exporter here

        values = {(c.panel, c.legend): c.values for c in checks}
        assert any(v > 0 for v in values[("Output tokens/s per model id", "{{model_name}} output")])
        assert all(0 < v <= 1 for v in values[("Prefix-cache hit rate", "hits / queries")])
        (length,) = values[("Speculative acceptance length", "1 + accepted / drafts")]
        assert 1.0 <= length < 1.5  # the tiny random drafter is (almost) never accepted
        assert sorted(values[("Server scraped", "up")]) == [1.0, 1.0]

        rules = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {rule["name"]: rule["health"] for group in rules for rule in group["rules"]}
        assert loaded == {name: "ok" for name in ("Qwen38ServerDown", "Qwen38EngineStalled", "Qwen38SpeculationCollapsed")}

        # The Grafana-less rendering of the panels, from the same Prometheus (docs/monitoring.md).
        picture = render_png(url, tmp_path / "dashboard.png", minutes=2, rate_interval="30s")
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000
