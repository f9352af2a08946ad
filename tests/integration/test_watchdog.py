"""The watchdog (entrypoint.watchdog) in the real `qwen38 serve` of the `cpu` profile.

A server of its own with short knobs (a canary every 3 s, a stall after 6 s), speculation on
with the tiny drafter (random weights: never accepted, the acceptance warning's real case)
and WATCHDOG_ACTION=mark, so one server shows each problem and its recovery. A stall is
induced by pausing vLLM's engine core (SIGSTOP, always resumed): its API server keeps
answering /health and /metrics, the silent failure the watchdog is for. The last test
stalls a second server with the same knobs but the default action, `stop` (started beside the
first, with the session's plans and vLLM caches: no new plan or compile).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from entrypoint.canary import CANARY_TOKENS
from entrypoint.lifecycle import group_members
from tests.conftest import launch_server, read_verdict, run_cli, stop_server, wait_ready
from tests.support.engine_pause import StreamingRequest, engine_core_pid, paused

pytestmark = pytest.mark.integration

BASE = "qwen3.8-27b"
KNOBS = {
    "SPECULATION": "true",
    "PREFIX_CACHING": "false",
    "WATCHDOG_STALL_TIMEOUT": "6",
    "WATCHDOG_CANARY_INTERVAL": "3",
    "WATCHDOG_CANARY_TIMEOUT": "4",
}


# The module's servers: `watched` shows each problem and its recovery, `stopping` the default
# action (no canary of its own: it idles until the last test stalls it).
SERVERS = {
    "watched": {"WATCHDOG_ACTION": "mark", **KNOBS},
    "stopping": {k: v for k, v in KNOBS.items() if k != "WATCHDOG_CANARY_INTERVAL"},
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_root, api_key_file) -> Iterator[dict]:
    """Both servers, launched side by side (their starts overlap instead of queueing) and gated
    before the first test."""
    launched = {name: launch_server(tmp_path_factory.mktemp(name), tiny_root, api_key_file, "cpu", **settings)
                for name, settings in SERVERS.items()}
    try:
        yield {name: wait_ready(server) for name, server in launched.items()}
    finally:
        stop_server(*launched.values())


@pytest.fixture(scope="module")
def watched(servers):
    return servers["watched"]


def _status_until(server, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = read_verdict(server)
        if status is not None and predicate(status):
            return status
        time.sleep(0.25)
    raise AssertionError(f"{what} not seen within {timeout:.0f} s; status: {read_verdict(server)}")


def _lines(server, text: str) -> list[str]:
    return [line for line in server.log.read_text(errors="replace").splitlines() if text in line]


def _quick(server):
    return run_cli("ready", "--quick", "--profile", "cpu", env=server.env, timeout=60)


def test_a_quiet_server_gets_the_canary_on_its_interval_and_the_status_records_it(watched):
    status = _status_until(watched, lambda s: (s.get("watchdog") or {}).get("canaries", 0) >= 2, 60, "two canaries")
    canary = status["watchdog"]["last_canary"]
    assert canary["ok"] is True and canary["tokens"] == CANARY_TOKENS
    assert canary["same_as_gate"] is True  # greedy, alone in the batch: the gate's answer again
    assert 0 < canary["seconds"] < 4
    assert status["ready"] is True and status["watchdog"]["healthy"] is True
    assert _quick(watched).returncode == 0
    assert _lines(watched, "watchdog: canary failed") == []


def test_a_drafter_that_is_never_accepted_is_one_warning_and_stays_healthy(watched):
    # ~64 drafts per request at acceptance length 1 (one draft per step): the 200-draft window closes.
    for _ in range(4):
        run = StreamingRequest(watched, BASE, 64)
        run.run()
        assert run.error is None and run.tokens == 64
    status = _status_until(watched, lambda s: (s.get("watchdog") or {}).get("warning"), 60, "the acceptance warning")
    acceptance = status["watchdog"]["acceptance"]
    assert acceptance["low"] is True and acceptance["length"] < 1.5 and acceptance["drafts"] >= 200
    assert status["ready"] is True  # a warning, never unhealthy: the output stays exact
    assert len(_lines(watched, "watchdog: speculative acceptance collapsed: acceptance length")) == 1


def test_a_paused_engine_with_a_request_running_is_a_stall_until_it_resumes(watched):
    request = StreamingRequest(watched, BASE, 200)
    request.start()
    assert request.first_token.wait(60) and request.error is None
    with paused(engine_core_pid(watched)):
        status = _status_until(watched, lambda s: not s["ready"], 30, "the stall")
        assert status["error"].startswith("watchdog: engine stalled: 1 request(s) running and no token generated")
        assert status["watchdog"]["problem_kind"] == "stall"
        quick = _quick(watched)
        assert quick.returncode != 0 and "qwen38: ready: unhealthy: watchdog: engine stalled" in quick.stderr
        (line,) = _lines(watched, "qwen38: watchdog: engine stalled")
        assert line.endswith("marked unhealthy (WATCHDOG_ACTION=mark)")
        # /health stays green the whole time: only the watchdog sees it
        assert watched.process.poll() is None
    status = _status_until(watched, lambda s: s["ready"], 30, "the recovery")
    assert status["error"] is None and status["watchdog"]["healthy"] is True
    assert len(_lines(watched, "qwen38: watchdog: recovered: the engine makes progress again")) == 1
    request.join(120)
    assert request.error is None and request.tokens == 200  # the paused request finished, every token
    assert _quick(watched).returncode == 0


def test_a_paused_idle_engine_fails_the_canary_and_a_later_canary_heals_it(watched):
    _status_until(watched, lambda s: s["ready"], 30, "a healthy server")
    failures = read_verdict(watched)["watchdog"]["canary_failures"]
    with paused(engine_core_pid(watched)):
        status = _status_until(watched, lambda s: not s["ready"], 30, "the failed canary")
        assert status["error"] == f"watchdog: canary failed: no answer from {BASE} within 4 s (WATCHDOG_CANARY_TIMEOUT)"
        assert status["watchdog"]["canary_failures"] == failures + 1
        shown = run_cli("status", "--profile", "cpu", "--interval", "0.5", env=watched.env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "verdict     unhealthy: watchdog: canary failed" in shown.stdout and "FAILED" in shown.stdout
    status = _status_until(watched, lambda s: s["ready"], 40, "a canary that answers again")
    assert status["watchdog"]["last_canary"]["ok"] is True
    assert len(_lines(watched, "qwen38: watchdog: recovered: a canary answered")) >= 1


def test_a_bench_request_with_no_answer_within_its_timeout_fails_naming_the_flag(watched):
    """A request whose first token does not come within --request-timeout (here: the engine
    paused; at full size a 112k-token prefill took longer than the 300 s default) ends the
    bench with one line that names the flag to raise."""
    _status_until(watched, lambda s: s["ready"], 30, "a healthy server")
    with paused(engine_core_pid(watched)):
        result = run_cli(
            "bench", "c1", "--base-url", watched.base_url, "--model", BASE, "--warmup", "0",
            "--requests", "1", "--output-tokens", "8", "--request-timeout", "2",
            env=watched.env, timeout=120,  # the server's own API_KEY_FILE: the key bench reads
        )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "the server sent nothing within the request timeout" in result.stderr
    assert "raise --request-timeout (seconds)" in result.stderr and "Traceback" not in result.stderr
    _status_until(watched, lambda s: s["ready"], 40, "the server healthy again after the pause")


def test_by_default_a_stall_stops_the_engine_and_serve_exits_1_saying_why(servers):
    stop_server(servers["watched"])  # done with: nothing else runs while this one is timed
    server = servers["stopping"]
    try:
        engine_pid = json.loads((server.cache_dir / "run" / "cpu.run.json").read_text())["engine_pid"]
        request = StreamingRequest(server, BASE, 400)
        request.start()
        assert request.first_token.wait(60) and request.error is None
        with paused(engine_core_pid(server)):
            code = server.process.wait(timeout=90)
    finally:
        stop_server(server)
    assert code == 1
    log = server.log.read_text(errors="replace")
    assert "qwen38: watchdog: engine stalled: 1 request(s) running" in log
    assert "stopping the engine (WATCHDOG_ACTION=stop)" in log
    assert "qwen38: the watchdog found the engine stalled: stopping the engine" in log
    status = server.status()
    assert status["ready"] is False and "engine stalled" in status["error"]
    assert group_members(engine_pid) == []  # the paused engine core too: killed, not left behind
    request.join(30)
    assert request.error is not None or request.tokens < 400  # the stream ended with the engine
