"""Shared fixtures: tiny models built once per session, and the real vLLM CPU server
started from the `cpu` profile through `qwen38 serve` (once per session and variant)."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from tests.support.plans import seed_plans  # noqa: F401 (the fixture: one planner run for the session)
from tests.support.session_cache import MODELINFO_STORE, SHARED_CACHE_PARTS, remove_session_cache, session_cache
from tests.support.vllm_views import vllm_views  # noqa: F401 (the fixture: one pair of views for the session)

REPO = Path(__file__).resolve().parent.parent
QWEN38 = [sys.executable, "-m", "entrypoint.cli"]
GPU_DEVICE = Path("/dev/nvidia0")


def _one_openmp_thread_per_process() -> None:
    """Where no GPU is present, every Python of the session (servers, engines, workers, the
    pytest workers themselves) runs one OpenMP thread, unless OMP_NUM_THREADS says otherwise.

    Several of them compute at once on a machine of two cores (the session's three servers
    start and answer their gates beside a test's own engines). With torch's default, one
    thread per core in each, their threads wait for each other at every parallel region,
    spinning, on cores the others need: on the Xeon with AMX (2026-12-06), a selection of the
    serving tests took 295 s on the AVX2 kernels and 137 s on the CPU's own, 171 s and 127 s
    with one thread each (docs/test-suite.md, "Where the time goes"). Set before torch is imported:
    OpenMP reads it once, at load (nothing imported above imports torch), and every child
    inherits it.
    """
    if not GPU_DEVICE.exists():
        os.environ.setdefault("OMP_NUM_THREADS", "1")


_one_openmp_thread_per_process()


def _triton_core_for_the_interpreter() -> None:
    """Where no GPU is present, import Triton's core language under its interpreter first.

    The split-KV kernel tests run under Triton's interpreter, which works only if
    `triton.language` (whose `tl.zeros` & co. are themselves `@triton.jit` functions) was
    first imported with TRITON_INTERPRET=1; later in a session vLLM imports Triton plainly.
    Only the core library is affected: kernels decorated later (vLLM's) stay compiled ones.
    """
    if GPU_DEVICE.exists() or "triton" in sys.modules:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_triton_core_for_the_interpreter()


# What belongs to the machine, not to an owner's deployment: kept from the caller's shell.
MACHINE_KNOBS = {"CUDA_VISIBLE_DEVICES", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY"}
# huggingface_hub's own variables a user of the hub may have exported (tests bring their hub).
HUB_VARIABLES = {"HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_ENABLE_HF_TRANSFER"}


def _hermetic_environment() -> None:
    """The suite is hermetic to the caller's shell: none of our knobs (VLLM_API_KEY,
    API_KEY_FILE, PROFILE, PORT, ...) and none of the hub's variables reach a test or a process
    it starts. Each test sets what it needs. (Seen 2026-12-06: with VLLM_API_KEY exported, a
    compose test failed with "VLLM_API_KEY and API_KEY_FILE are both set".)"""
    from core.settings import Settings

    unset = ({name.upper() for name in Settings.model_fields} - MACHINE_KNOBS) | HUB_VARIABLES
    for name in [name for name in os.environ if name.upper() in unset]:
        del os.environ[name]


_hermetic_environment()


@pytest.fixture(autouse=True, scope="session")
def _neutral_working_directory(tmp_path_factory) -> Iterator[Path]:
    """Tests run in an empty directory, not the checkout: a `.env` an owner keeps beside the
    checkout (the README's setup copies one there) is not read by a test's settings."""
    where = tmp_path_factory.mktemp("cwd")
    saved = os.getcwd()
    os.chdir(where)
    try:
        yield where
    finally:
        os.chdir(saved)


def pytest_configure(config) -> None:
    from tests.support.avx2_kernels import problem_with_switch

    problem = problem_with_switch()
    if problem:
        raise pytest.UsageError(problem)
    # vLLM's model information for the views' children, kept in pytest's cache by the content of
    # each view (tests.support.session_cache.view_vllm_cache): what a run recorded, the next reads.
    if getattr(config, "cache", None) is not None and not MODELINFO_STORE:
        MODELINFO_STORE.append(config.cache.mkdir("qwen38-vllm-modelinfos"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any of our knobs, plus ``extra``."""
    from core.settings import Settings

    knobs = {name.upper() for name in Settings.model_fields} - MACHINE_KNOBS | {"CUDA_VISIBLE_DEVICES"}
    env = {k: v for k, v in os.environ.items() if k.upper() not in knobs}
    # The checkout first; a PYTHONPATH that brings vLLM (the GPU machine's payload) stays.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300):
    return subprocess.run(
        [*QWEN38, *args], env=env or clean_env(), cwd=cwd or os.getcwd(), capture_output=True, text=True, timeout=timeout
    )


def run_cli_here(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`run_cli` in this process: the command line's own entry point (`entrypoint.cli.main`, what
    `python -m entrypoint.cli` exits with) under ``env`` alone, its output captured. For `qwen38
    bench` against a running server: a new Python spent ~4 s importing the bench command (torch
    among it) on every run. A command that raises what the CLI does not turn into a line
    raises here."""
    from entrypoint import cli  # here: imported after this module has set the environment up

    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env, clear=True), redirect_stdout(stdout), redirect_stderr(stderr):
        code = cli.main(list(args))
    return subprocess.CompletedProcess([*QWEN38, *args], code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """MODELS_DIR with the tiny models at tiny/{target,drafter,directions,adapter} (built once)."""
    from prepare.generate import build_tiny_models

    root = tmp_path_factory.mktemp("models")
    build_tiny_models(root / "tiny")
    return root


@pytest.fixture(scope="session")
def api_key_file(tmp_path_factory) -> Path:
    from entrypoint.keys import init_key_file

    path = tmp_path_factory.mktemp("secrets") / "api_key"
    init_key_file(path)
    return path


@dataclass
class Server:
    base_url: str
    api_key: str
    env: dict[str, str]
    process: subprocess.Popen
    log: Path
    cache_dir: Path
    seconds_to_ready: float

    profile: str = "cpu"
    started: float = 0.0  # time.monotonic() at launch
    started_at: float = 0.0  # time.time() at launch

    def status(self) -> dict:
        return json.loads((self.cache_dir / "run" / f"{self.profile}.status.json").read_text())


def pytest_sessionfinish(session, exitstatus) -> None:
    from tests.support.warm_python import stop_all

    stop_all()
    remove_session_cache()


def launch_server(
    tmp: Path, models: Path, key_file: Path, profile: str = "cpu", cache_dir: Path | None = None, **settings: str
) -> Server:
    """`qwen38 serve --profile P` in its own process group; returns at once (see `wait_ready`).

    ``cache_dir`` (default ``tmp/cache``) may be shared by servers that run one after another:
    a restart then reuses the plan and the compile caches. The default one has run files of
    its own but shares plans and vLLM's caches with the session's other servers
    (`session_cache`): a server whose engine another one planned starts as a restart would.

    The watchdog's canary is off unless a test asks for it: its tokens would land in the
    counter deltas the tests read around their own requests."""
    port = free_port()
    if cache_dir is None:
        cache_dir = tmp / "cache"
        cache_dir.mkdir(parents=True, exist_ok=True)
        for part in SHARED_CACHE_PARTS:
            (session_cache() / part).mkdir(exist_ok=True)
            (cache_dir / part).symlink_to(session_cache() / part, target_is_directory=True)
    env = clean_env(
        MODELS_DIR=str(models), API_KEY_FILE=str(key_file), PORT=str(port), CACHE_DIR=str(cache_dir),
        **{"READY_TIMEOUT": "600", "WATCHDOG_CANARY_INTERVAL": "0", **settings},
    )
    log = tmp / "serve.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [*QWEN38, "serve", "--profile", profile], env=env, cwd=tmp, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(
        base_url=f"http://127.0.0.1:{port}", api_key=key_file.read_text().strip(), env=env, process=process,
        log=log, cache_dir=cache_dir, seconds_to_ready=0.0, profile=profile, started=time.monotonic(),
        started_at=time.time(),
    )


def read_verdict(server: Server) -> dict | None:
    """The readiness status this server's own supervisor wrote (an older start's is not it)."""
    try:
        status = json.loads((server.cache_dir / "run" / f"{server.profile}.status.json").read_text())
    except (OSError, ValueError):
        return None
    return status if status.get("pid") == server.process.pid else None


def wait_ready(server: Server, timeout: float = 600) -> Server:
    """Waits for the readiness gate's verdict (the status file); raises with the log tail."""
    start = server.started
    while (status := read_verdict(server)) is None:
        if server.process.poll() is not None or time.monotonic() - start > timeout:
            stop_server(server)
            raise RuntimeError(f"{server.profile} server did not pass its gate; log:\n{server.log.read_text()[-4000:]}")
        time.sleep(1)
    if not status["ready"]:
        stop_server(server)
        raise RuntimeError(f"readiness gate failed: {status['error']}\n{server.log.read_text()[-4000:]}")
    # From launch to the gate's verdict as written, not to when this wait began.
    status_file = server.cache_dir / "run" / f"{server.profile}.status.json"
    server.seconds_to_ready = status_file.stat().st_mtime - server.started_at
    return server


def spec_decode_delta(server: Server, body: dict) -> dict[str, float]:
    """The /metrics counters (bench.stats.COUNTERS: drafts, draft_tokens,
    accepted_tokens, ...) moved by one /v1/completions request."""
    from bench.stats import metric_delta
    from entrypoint.client import StackClient

    with StackClient(server.base_url, server.api_key) as client:
        before = client.metrics()
        client.post_json("/v1/completions", body)
        return metric_delta(before, client.metrics()).counters


def stop_server(*servers: Server) -> None:
    """SIGTERM to every one still running, then the wait for each: several stop side by side
    (each waits mostly on its engine's teardown). One still there 90 s on is killed, group and all."""
    running = [server for server in servers if server.process.poll() is None]
    for server in running:
        server.process.send_signal(signal.SIGTERM)
    wait_stopped(*running)


def wait_stopped(*servers: Server) -> None:
    """The wait of `stop_server` for servers already sent SIGTERM: one still there 90 s on is
    killed, group and all."""
    deadline = time.monotonic() + 90
    for server in servers:
        try:
            server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


# The prompt length of the cache-isolation checks on the `cpu` servers (test_cpu_profile,
# test_monitoring): three of the profile's 640-token KV blocks and a few tokens more, every check
# as with the validator's default 6,000 tokens at a third of the prefill (AVX2 CPUs feel it). Not
# 1,920: its prompts (1,917-1,922 tokens with " Answer:") failed a repeat's hit once on 2026-12-04.
# A prompt of exactly 1,920 tokens ends on a block boundary: its repeat may reuse at most 1,919
# tokens, so 1,280, a state its first sending never kept (vLLM's hybrid cache, on GPUs too); the
# repeat hits from the third sending. (Before patch 0077 many other lengths missed on the second.)
CACHE_PREFIX_TOKENS = 1950

# The session's `cpu` servers, by fixture name: settings over the profile's defaults.
SESSION_SERVERS = {
    "cpu_server": {"QWEN38_HEARTBEAT_S": "5"},  # a start-up heartbeat every 5 s, not 30: test_cpu_profile reads it
    "cpu_spec_server": {"SPECULATION": "true", "PREFIX_CACHING": "false"},
    "cpu_lookup_server": {"SPECULATION": "true", "PREFIX_CACHING": "false", "LOOKUP": "true"},
    "cpu_mtp_server": {"SPECULATION": "mtp", "PREFIX_CACHING": "false"},
}


class SessionServers:
    """The session's servers, launched side by side when the session starts (only those its
    tests ask for): their starts, mostly Python importing vLLM in three processes each, then
    overlap with each other and with the tests that run first, instead of queueing one after
    the other on a 2-core machine. Each is gated before it is handed out, and sent SIGTERM
    once the last test of the session that asks for it is done (`stop` waits for it): an idle
    server still takes ~3 % of a core (its watchdog reading /metrics, vLLM's stats), and the
    later modules, which time what they start, ran beside all four."""

    def __init__(self, factory, models: Path, key_file: Path):
        self.factory, self.models, self.key_file = factory, models, key_file
        self.launched: dict[str, Server] = {}
        self.ready: dict[str, Server] = {}
        self.last_users: dict[str, str] = {}  # server name -> node id of the last test that asks for it
        self.retired: set[str] = set()

    def launch(self, name: str) -> None:
        if name not in self.launched:
            tmp = self.factory.mktemp(name.replace("_", "-"))
            self.launched[name] = launch_server(tmp, self.models, self.key_file, "cpu", **SESSION_SERVERS[name])

    def get(self, name: str) -> Server:
        if name not in self.ready:
            self.launch(name)
            self.ready[name] = wait_ready(self.launched[name])
        return self.ready[name]

    def done_with(self, item: pytest.Item) -> None:
        """After ``item`` (its fixtures torn down): SIGTERM to each server whose last test it was,
        not waited for (its stop overlaps the tests that follow)."""
        for name, nodeid in self.last_users.items():
            if nodeid == item.nodeid and name in self.launched and name not in self.retired:
                self.retired.add(name)
                if self.launched[name].process.poll() is None:
                    self.launched[name].process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        stop_server(*(server for name, server in self.launched.items() if name not in self.retired))
        wait_stopped(*(self.launched[name] for name in self.retired))


SESSION_SERVERS_KEY = pytest.StashKey[SessionServers]()


@pytest.fixture(scope="session", autouse=True)
def session_servers(request, tmp_path_factory) -> Iterator[SessionServers | None]:
    wanted = sorted({name for item in request.session.items for name in getattr(item, "fixturenames", ())
                     if name in SESSION_SERVERS})
    if not wanted:  # no test of this session serves: nothing generated, nothing started
        yield None
        return
    servers = SessionServers(
        tmp_path_factory, request.getfixturevalue("tiny_root"), request.getfixturevalue("api_key_file")
    )
    for item in request.session.items:  # in the order they run
        for name in set(getattr(item, "fixturenames", ())) & set(SESSION_SERVERS):
            servers.last_users[name] = item.nodeid
    for name in wanted:
        servers.launch(name)
    request.config.stash[SESSION_SERVERS_KEY] = servers
    yield servers
    del request.config.stash[SESSION_SERVERS_KEY]
    servers.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    servers = item.config.stash.get(SESSION_SERVERS_KEY, None)
    if servers is not None:
        servers.done_with(item)
    return result


@pytest.fixture(scope="session")
def cpu_server(session_servers) -> Server:
    """The `cpu` profile as users run it: LoRA second id, prefix caching, API key."""
    return session_servers.get("cpu_server")


@pytest.fixture(scope="session")
def cpu_spec_server(session_servers) -> Server:
    """The `cpu` profile with the DFlash drafter on (and prefix caching off, see cpu.toml)."""
    return session_servers.get("cpu_spec_server")


@pytest.fixture(scope="session")
def cpu_mtp_server(session_servers) -> Server:
    """The `cpu` profile with the tiny target's own MTP head drafting (no drafter; prefix caching off)."""
    return session_servers.get("cpu_mtp_server")


@pytest.fixture(scope="session")
def cpu_lookup_server(session_servers) -> Server:
    """`cpu_spec_server` with lookup drafting on (patch 0070): verify block 16 = 1 + 4 + 11."""
    return session_servers.get("cpu_lookup_server")
