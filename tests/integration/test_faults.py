"""Fault injection against the real vLLM 0.28.0 CPU server, loopback only, every wait bounded.

What a new user could do wrong or run into, each kept fixed here:
- every route vLLM registers, asked without the key (read from the server's own route log);
- SIGTERM mid-stream, abort (the `cpu` default) and drain: what the OpenAI and Anthropic
  SDKs see, how long the stop takes, that nothing is left;
- kill -9 of `qwen38 serve` and of its engine, and the restart after it: no orphans, no
  stale ``ready``;
- a second `qwen38 serve` on a busy port, and a gate pointed at another server;
- a reverted or an edited patched file; a corrupted model, its repair, a repair killed
  half-way; a garbage ``.env``.

The stop tests' servers start side by side when the module starts, while the key, port and
patch-delivery tests (which time nothing) run, each with the plans and vLLM caches of the shared
server, so none of them plans or compiles from scratch; the restart after kill -9 runs in the
killed server's own cache directory. The corrupted-model test, whose killed repair is a race
won by polling, runs after them, on a quiet machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.shutdown import stop_mid_stream
from core.profiles import SHUTDOWN_MARGIN_S
from entrypoint.auth import OPEN_PATHS
from entrypoint.drain import SHUTDOWN_MESSAGE
from entrypoint.lifecycle import engine_group, process_alive, processes_of_instance, read_record
from entrypoint.run_files import record_path
from tests.conftest import QWEN38, clean_env, free_port, launch_server, read_verdict, run_cli, stop_server, wait_ready
from tests.support.routes import concrete, logged_routes
from tests.support.vllm_views import env_with_vllm_view, view_without

pytestmark = pytest.mark.integration

# A CPU patch whose file no other patch touches: a view without it lacks it alone.
REVERTED = "0077-cpu-hybrid-block-size-after-handshake.patch"
REVERTED_FILE = "platforms/cpu.py"


def _gone(instance: str, timeout: float, pids: list[int] = ()) -> list[int]:
    """Processes of ``instance``, and of ``pids`` (its engine group as seen while it ran: vLLM's
    engine core and workers carry no readable mark), still alive after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout

    def alive() -> list[int]:
        return sorted(set(processes_of_instance(instance)) | {p for p in pids if process_alive(p)})

    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _engine_processes(server) -> list[int]:
    """The server's engine group from its run record, checked to hold vLLM's engine core."""
    group = engine_group(read_record(record_path(server.cache_dir, server.profile)))
    names = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group]
    assert any(b"EngineCore" in name for name in names), names
    return group


# ---- the key: every route ---------------------------------------------------------------


def test_every_route_vllm_registers_refuses_a_request_without_the_key(cpu_server):
    routes = logged_routes(cpu_server.log.read_text(errors="replace"))
    paths = {path for _, path in routes}
    assert len(routes) >= 30 and {"/invocations", "/tokenize", "/scale_elastic_ep", "/v1/messages"} <= paths
    documented = httpx.get(
        f"{cpu_server.base_url}/openapi.json", headers={"x-api-key": cpu_server.api_key}, timeout=60
    ).json()
    assert set(documented["paths"]) <= paths  # the log is the complete table (it has /docs & co. besides)

    answered: dict[tuple[str, str], tuple[int, int]] = {}
    with httpx.Client(base_url=cpu_server.base_url, timeout=60) as http:
        for method, path in sorted(routes | {("POST", "/a/route/a/later/vllm/adds")}):
            url = concrete(path)
            keyless = http.request(method, url, json={} if method == "POST" else None).status_code
            wrong = http.request(method, url, headers={"Authorization": "Bearer " + "w" * 40}).status_code
            answered[(method, path)] = (keyless, wrong)
    refused = {route for route, codes in answered.items() if codes == (401, 401)}
    open_routes = {route for route in answered if route[1] in OPEN_PATHS}
    assert set(answered) - refused == open_routes, {r: answered[r] for r in set(answered) - refused - open_routes}
    assert all(answered[route][0] == 200 for route in open_routes if route[0] in ("GET", "POST"))


def test_the_key_opens_every_api_as_bearer_or_as_x_api_key(cpu_server):
    import anthropic
    import openai

    ids = [m.id for m in openai.OpenAI(base_url=f"{cpu_server.base_url}/v1", api_key=cpu_server.api_key).models.list()]
    assert "qwen3.8-27b" in ids
    claude = anthropic.Anthropic(base_url=cpu_server.base_url, api_key=cpu_server.api_key, max_retries=0)
    message = claude.messages.create(model="qwen3.8-27b", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    # (the Anthropic SDK sends the key as x-api-key)
    assert message.usage.output_tokens >= 1
    with httpx.Client(base_url=cpu_server.base_url, headers={"x-api-key": cpu_server.api_key}, timeout=60) as http:
        assert http.post("/tokenize", json={"model": "qwen3.8-27b", "prompt": "hi"}).status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/version").json()["version"].startswith("0.28.0")


# ---- a busy port, another server ----------------------------------------------------------


def test_a_second_serve_on_a_busy_port_fails_at_once_and_never_reports_ready(
    cpu_server, tiny_root, api_key_file, tmp_path
):
    port = cpu_server.base_url.rsplit(":", 1)[1]
    env = clean_env(MODELS_DIR=str(tiny_root), API_KEY_FILE=str(api_key_file), PORT=port, CACHE_DIR=str(tmp_path))
    started = time.monotonic()
    result = run_cli("serve", "--profile", "cpu", env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (
        f"qwen38: launch: 127.0.0.1:{port} is already in use by another process; stop it or set PORT to a free port\n"
    )
    assert time.monotonic() - started < 60
    assert not (tmp_path / "run" / "cpu.status.json").exists()


def test_the_gate_and_the_healthcheck_refuse_a_server_started_by_another_instance(cpu_server, api_key_file, tmp_path):
    from core.errors import ReadinessError
    from entrypoint.client import StackClient
    from entrypoint.ready import run_gate

    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        with pytest.raises(ReadinessError, match="is answered by another server"):
            run_gate(client, "qwen3.8-27b", None, timeout=30, instance="0" * 16)
    # A status that says ready, for a server that is not the one answering on the port.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "cpu.status.json").write_text(json.dumps({"ready": True, "instance": "f" * 16}))
    env = clean_env(API_KEY_FILE=str(api_key_file), CACHE_DIR=str(tmp_path))
    stale = run_cli("ready", "--quick", "--profile", "cpu", "--base-url", cpu_server.base_url, env=env, timeout=60)
    assert stale.returncode == 2 and "is answered by another server (instance " in stale.stderr
    own_status = {"ready": True, "instance": cpu_server.status()["instance"]}
    (tmp_path / "run" / "cpu.status.json").write_text(json.dumps(own_status))
    own = run_cli("ready", "--quick", "--profile", "cpu", "--base-url", cpu_server.base_url, env=env, timeout=60)
    assert own.returncode == 0 and own.stdout == "ready\n", own.stderr


# ---- patch delivery ---------------------------------------------------------------------------


@pytest.fixture
def view_env(tiny_root, api_key_file, tmp_path):
    """A view of the installed vLLM without patch 0077, and the CLI's environment seeing it."""
    view = view_without(REVERTED, tmp_path / "view")
    env = clean_env(MODELS_DIR=str(tiny_root), API_KEY_FILE=str(api_key_file), CACHE_DIR=str(tmp_path / "cache"),
                    PORT=str(free_port()))  # fmt: skip
    return view, env_with_vllm_view(env, view)


def test_a_reverted_patch_stops_verify_and_serve_on_the_cpu_profile_until_it_is_applied(view_env, tmp_path):
    view, env = view_env
    check = run_cli("patches", "check", env=env, cwd=tmp_path)
    verify = run_cli("verify", "--profile", "cpu", env=env, cwd=tmp_path)
    assert check.returncode == 2 and verify.returncode == 2
    apply = f"qwen38 patches apply --vllm-dir {view}"
    assert verify.stderr == (
        f"qwen38: verify: patches: profile cpu runs the patched engine, but {REVERTED} is not delivered in {view} "
        f"(not applied to {REVERTED_FILE}); apply the series with `{apply}`\n"
    )
    serve = run_cli("serve", "--profile", "cpu", env=env, cwd=tmp_path, timeout=120)
    assert serve.returncode == 2 and serve.stderr.startswith("qwen38: verify: patches: profile cpu runs the patched")
    assert "serving profile" not in serve.stdout and not (tmp_path / "cache" / "run" / "cpu.status.json").exists()

    repaired = subprocess.run([*QWEN38, *shlex.split(apply)[1:]], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert repaired.returncode == 0, repaired.stderr
    again = run_cli("verify", "--profile", "cpu", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert ";patches=" in again.stdout and "incomplete" not in again.stdout


def test_an_edited_patched_file_is_caught_at_verify_naming_the_file(view_env, tmp_path):
    view, env = view_env
    edited = view / REVERTED_FILE
    edited.write_text(edited.read_text() + "\n# a local edit\n")
    verify = run_cli("verify", "--profile", "cpu", env=env, cwd=tmp_path)
    assert verify.returncode == 2
    assert verify.stderr.startswith(
        f"qwen38: verify: patches: profile cpu runs the patched engine, but {REVERTED} cannot be proven delivered "
        f"in {view}: no known state (not vLLM 0.28.0, or edited): {REVERTED_FILE}; reinstall the engine"
    )


# ---- stopping: SIGTERM mid-stream, kill -9, restart -------------------------------------------


# The stop tests' servers: settings over the `cpu` profile's.
STOP_SERVERS = {"sigterm": {}, "drain": {"SHUTDOWN_TIMEOUT": "4"}, "kill": {}}


@pytest.fixture(scope="module", autouse=True)
def launched_stop_servers(request, tmp_path_factory, tiny_root, api_key_file, cpu_server) -> Iterator[dict]:
    """The stop tests' servers, launched side by side when the module starts (where a stop test
    of it is selected): their starts, mostly Python importing vLLM on one core each, overlap
    with each other and with the tests above, which time nothing, instead of queueing. Each has
    a CACHE_DIR of its own whose plans and vLLM caches are the session's, where the shared
    server (same profile and settings) left them: no start here is cold."""
    if not any(item.module is request.module and "stop_servers" in item.fixturenames
               for item in request.session.items if isinstance(item, pytest.Function)):
        yield {}
        return
    launched = {name: launch_server(tmp_path_factory.mktemp(f"stop-{name}"), tiny_root, api_key_file, **settings)
                for name, settings in STOP_SERVERS.items()}
    try:
        yield launched
    finally:
        stop_server(*launched.values())  # nothing where its test stopped it


@pytest.fixture(scope="module")
def stop_servers(launched_stop_servers) -> dict:
    """The stop tests' servers, all gated before any test stops one, so no stop is timed beside a
    starting server."""
    return {name: wait_ready(server) for name, server in launched_stop_servers.items()}


def _kill(server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


def test_sigterm_mid_stream_ends_every_stream_with_a_clear_error_and_exits_within_the_bound(stop_servers):
    server = stop_servers["sigterm"]  # cpu: shutdown_timeout 0, abort
    instance, engine = server.status()["instance"], _engine_processes(server)
    try:
        result = stop_mid_stream(server.process, server.base_url, server.api_key, timeout=120)
    finally:
        _kill(server)
    assert result["exit_code"] == 0 and result["exit_s"] <= SHUTDOWN_MARGIN_S, result
    for client in result["clients"]:
        assert client["outcome"] == "error" and SHUTDOWN_MESSAGE in client["detail"], client
        assert client["seconds_after_stop"] <= 5.0, client
    assert client["detail"].startswith("openai.APIError")
    assert result["clients"][1]["detail"].startswith("anthropic.APIStatusError")
    assert "503" in result["late_request"] or "Connection error" in result["late_request"], result["late_request"]
    assert _gone(instance, 5, engine) == []
    status = json.loads((server.cache_dir / "run" / "cpu.status.json").read_text())
    assert status["ready"] is False and status["error"] == "stopped (SIGTERM)"


def test_sigterm_with_a_drain_lets_a_short_answer_finish_and_ends_long_ones_at_the_drain(stop_servers):
    server = stop_servers["drain"]
    drain = int(STOP_SERVERS["drain"]["SHUTDOWN_TIMEOUT"])
    instance, engine = server.status()["instance"], _engine_processes(server)
    try:
        result = stop_mid_stream(server.process, server.base_url, server.api_key, short_tokens=24, timeout=120)
    finally:
        _kill(server)
    long_openai, long_anthropic, short = result["clients"]
    assert short["outcome"] == "finished" and short["detail"] == "finish_reason=length", short
    for client in (long_openai, long_anthropic):
        assert client["outcome"] == "error" and SHUTDOWN_MESSAGE in client["detail"], client
        assert drain - 0.5 <= client["seconds_after_stop"] <= drain + 3, client
        assert client["events"] > client["events_at_stop"]  # they kept streaming during the drain
    assert "503" in result["late_request"], result["late_request"]  # nothing new is admitted meanwhile
    assert result["exit_code"] == 0 and result["exit_s"] <= drain + SHUTDOWN_MARGIN_S, result
    assert _gone(instance, 5, engine) == []


def test_kill_9_of_serve_or_of_its_engine_leaves_no_process_and_no_stale_ready(
    tmp_path, tiny_root, api_key_file, stop_servers
):
    first = stop_servers["kill"]
    cache = first.cache_dir  # the restart below runs in the same CACHE_DIR
    first_instance = first.status()["instance"]
    engine = _engine_processes(first)
    assert len(engine) >= 3  # API server, its resource tracker, engine core (the CPU worker runs in it)
    os.kill(first.process.pid, signal.SIGKILL)  # qwen38 serve itself: no cleanup code runs in it
    first.process.wait()
    assert _gone(first_instance, 15, engine) == []  # its reaper ended them
    env = {**first.env, "PYTHONPATH": clean_env()["PYTHONPATH"]}
    healthcheck = run_cli("ready", "--quick", "--profile", "cpu", env=env, timeout=60)
    assert healthcheck.returncode != 0  # the file still says ready: true, the healthcheck does not believe it

    (tmp_path / "second").mkdir()
    second = launch_server(tmp_path / "second", tiny_root, api_key_file, cache_dir=cache)
    try:
        wait_ready(second)
        assert second.status()["instance"] != first_instance
        engine = read_record(record_path(cache, "cpu"))
        assert engine.supervisor_pid == second.process.pid
        group = _engine_processes(second)
        os.kill(engine.engine_pid, signal.SIGKILL)  # vLLM's API server
        assert second.process.wait(timeout=30) != 0
        assert _gone(engine.instance, 10, group) == []
    finally:
        _kill(second)
    status = read_verdict(second)
    assert status["ready"] is False and "exited on its own (killed by SIGKILL" in status["error"]


# ---- a corrupted model, its repair, a repair killed half-way ---------------------------------


def test_a_corrupted_model_is_repaired_by_the_command_verify_prints_even_after_a_killed_repair(
    tiny_root, api_key_file, tmp_path
):
    models = tmp_path / "models"
    shutil.copytree(tiny_root / "tiny", models / "tiny", symlinks=True)
    target = models / "tiny" / "target"
    weights = bytearray((target / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (target / "model.safetensors").write_bytes(bytes(weights))
    (target / "tokenizer.json").unlink()
    env = clean_env(MODELS_DIR=str(models), API_KEY_FILE=str(api_key_file), CACHE_DIR=str(tmp_path / "cache"))

    broken = run_cli("verify", "--profile", "cpu", env=env, cwd=tmp_path)
    assert broken.returncode == 2
    hint = re.search(r"regenerate it with `([^`]+)`", broken.stderr).group(1)
    assert hint == "qwen38 prepare --profile cpu --recheck"
    command = [*QWEN38, *shlex.split(hint)[1:]]

    killed = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((models / "tiny").glob(".*.incomplete")) and time.monotonic() < deadline:
        assert killed.poll() is None, "the repair finished before it could be interrupted"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    leftovers = list((models / "tiny").glob(".*.incomplete"))
    assert leftovers

    repaired = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert repaired.returncode == 0, repaired.stderr
    for leftover in leftovers:
        assert f"removed {leftover}, left by an interrupted run" in repaired.stdout
        assert not leftover.exists()
    assert f"prepared target: tiny -> {target}" in repaired.stdout
    verified = run_cli("verify", "--profile", "cpu", env=env, cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr
    unchanged = run_cli(*shlex.split(hint)[1:], env=env, cwd=tmp_path, timeout=300)
    assert unchanged.stdout == "profile cpu: every model directory is prepared\n"  # nothing left to repair


# ---- a garbage .env ---------------------------------------------------------------------------


def test_a_garbage_env_line_stops_serve_with_the_line_named(tiny_root, api_key_file, tmp_path):
    (tmp_path / ".env").write_text(f"MODELS_DIR={tiny_root}\nPORT=\"19000\n")
    result = run_cli("serve", "--profile", "cpu", env=clean_env(API_KEY_FILE=str(api_key_file)), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "qwen38: settings: .env:2: cannot parse `PORT=...`; write NAME=value, with any quote closed on the same line\n"
    )
