"""`qwen38 status` against the session's real `cpu` server (tests/conftest.py `cpu_server`)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.conftest import QWEN38, REPO, run_cli
from tests.support.engine_pause import StreamingRequest

pytestmark = pytest.mark.integration


def _status(server, *args: str, **env: str):
    return run_cli("status", "--profile", "cpu", *args, env={**server.env, **env}, timeout=60)


def test_status_shows_the_ids_instance_and_gate_verdict_of_this_very_start(cpu_server):
    shown = _status(cpu_server, "--interval", "0.5")
    assert shown.returncode == 0, shown.stderr
    lines = dict(line.split(None, 1) for line in shown.stdout.splitlines() if line.strip())
    instance = cpu_server.status()["instance"]
    assert lines["server"] == f"{cpu_server.base_url} (instance {instance}; /health 200)"
    assert lines["verdict"] == "ready"
    assert lines["models"] == "qwen3.8-27b, qwen3.8-27b-mode-b"
    assert lines["acceptance"] == "- (no speculative decoding)"
    assert lines["queue"].endswith("waiting") and lines["uptime"] != "-"


def test_status_json_counts_the_tokens_of_a_running_request(cpu_server):
    # The whole context (32,768 positions, less the prompt): on a loaded 2-core machine 3,000
    # tokens were done before the status command had sampled twice. The request is cancelled.
    request = StreamingRequest(cpu_server, "qwen3.8-27b", 32000)
    request.start()
    try:
        assert request.first_token.wait(60) and request.error is None
        shown = _status(cpu_server, "--json", "--interval", "1")
        still_running = request.is_alive()
    finally:
        request.cancel()
    assert shown.returncode == 0, shown.stderr
    assert still_running, "the request ended before the status was read: the figures below prove nothing"
    figures = json.loads(shown.stdout)
    assert figures["running"] >= 1 and figures["output_tok_s"] > 0
    assert 0 <= figures["kv_usage"] <= 1
    assert 0 < figures["uptime_s"] < time.time() - cpu_server.started_at + 60
    assert figures["verdict"] == "ready" and figures["instance"] == cpu_server.status()["instance"]


def test_status_watch_refreshes_until_ctrl_c(cpu_server):
    process = subprocess.Popen(
        [*QWEN38, "status", "--profile", "cpu", "--watch", "--json", "--interval", "0.5"],
        env=cpu_server.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        frames = [json.loads(process.stdout.readline()) for _ in range(2)]
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert all(frame["model_ids"] == ["qwen3.8-27b", "qwen3.8-27b-mode-b"] for frame in frames)


def test_a_wrong_key_is_one_line_and_another_starts_file_is_not_this_servers(cpu_server, tmp_path):
    wrong = tmp_path / "wrong_key"
    wrong.write_text("0" * 32 + "\n")
    wrong.chmod(0o600)
    refused = _status(cpu_server, API_KEY_FILE=str(wrong))
    assert refused.returncode == 2
    assert refused.stderr.strip() == f"qwen38: monitoring: {cpu_server.base_url}/metrics answered 401: wrong or missing API key"
    elsewhere = _status(cpu_server, "--interval", "0.2", CACHE_DIR=str(tmp_path / "other-cache"))
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "verdict     unknown" in elsewhere.stdout and "no status file of this start here" in elsewhere.stdout
