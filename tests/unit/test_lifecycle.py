"""A start owns its profile's run files and its processes: a second start refuses, a start
after a killed one removes exactly that one's leftovers, and the supervisor stops an engine
within its bound even when the engine ignores SIGTERM. The real server's lifecycle (kill -9,
SIGTERM mid-stream, restart) is tests/integration/test_faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.errors import LaunchError
from core.profiles import load_profile
from core.settings import Settings
from entrypoint.lifecycle import (
    RunRecord,
    engine_group,
    process_alive,
    process_start_time,
    process_state,
    processes_of_instance,
    read_record,
)
from entrypoint.run_files import record_path, status_path
from entrypoint.supervise import begin_start
from tests.conftest import REPO, free_port


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(_env_file=None, cache_dir=tmp_path / "cache", port=free_port())


def _sleeper(instance: str) -> subprocess.Popen:
    env = {**os.environ, "QWEN38_INSTANCE": instance}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)


def _wait_gone(process: subprocess.Popen, timeout: float = 10) -> bool:
    try:
        process.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_start_kills_the_leftovers_of_the_recorded_instance_and_nothing_else(settings, capsys):
    left, other = _sleeper("aaaa000011112222"), _sleeper("bbbb000011112222")
    try:
        RunRecord("cpu", "aaaa000011112222", 1, None, left.pid, None, "127.0.0.1:1").write(
            record_path(settings.cache_dir, "cpu")
        )
        start = begin_start(load_profile("cpu"), settings)
        start.lock.release()
        assert _wait_gone(left) and left.returncode == -signal.SIGKILL
        assert other.poll() is None  # not ours: untouched
        assert f"killed 1 processes left by a killed earlier start: {left.pid} (" in capsys.readouterr().err
        assert not record_path(settings.cache_dir, "cpu").exists()
    finally:
        for process in (left, other):
            process.kill()
            process.wait()


def test_a_start_forgets_the_previous_verdict_before_anything_else(settings):
    path = status_path(settings.cache_dir, "cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"ready": True, "instance": "0" * 16}))
    begin_start(load_profile("cpu"), settings).lock.release()
    assert not path.exists()


def test_a_second_start_for_the_same_profile_and_cache_refuses(settings):
    first = begin_start(load_profile("cpu"), settings)
    try:
        RunRecord("cpu", first.instance, os.getpid(), None, os.getpid(), None, "x").write(first.record_path)
        with pytest.raises(LaunchError, match=f"already being served from this CACHE_DIR \\(pid {os.getpid()}"):
            begin_start(load_profile("cpu"), settings)
    finally:
        first.lock.release()
    begin_start(load_profile("cpu"), settings).lock.release()  # the lock went with its holder


def test_an_address_in_use_is_refused_before_verify_or_plan(settings):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", settings.port))
        busy.listen()
        with pytest.raises(LaunchError) as info:
            begin_start(load_profile("cpu"), settings)
    assert str(info.value) == (
        f"127.0.0.1:{settings.port} is already in use by another process; stop it or set PORT to a free port"
    )


SUPERVISED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import entrypoint.supervise as supervise
    from entrypoint.launch import Invocation
    from core.profiles import load_profile
    from core.settings import Settings

    supervise.STOP_MARGIN_S = 2.0
    settings = Settings(_env_file=None, cache_dir=Path(sys.argv[1]), port=int(sys.argv[2]))
    start = supervise.begin_start(load_profile("cpu"), settings)
    print(start.instance, flush=True)
    engine = [sys.executable, "-c", sys.argv[3]]
    invocation = Invocation(engine, {}, {"shutdown-timeout": 0}, Path("unused.yaml"), "k")
    sys.exit(supervise.supervise(invocation, start))
    """
)

# Stands in for an engine that hangs on SIGTERM, with a helper process in its group.
STUBBORN_ENGINE = textwrap.dedent(
    """
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)
    """
)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_an_engine_that_ignores_sigterm_is_killed_with_its_whole_group_at_the_bound(tmp_path):
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, str(tmp_path / "cache"), str(free_port()), STUBBORN_ENGINE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        instance = supervisor.stdout.readline().strip()
        deadline = time.monotonic() + 30
        # The stubborn engine forks its helper at once, before the supervisor has installed its
        # handlers: wait for those too (seen once under the full suite: the SIGTERM came first).
        while (len(processes_of_instance(instance)) < 2 or not catches(supervisor.pid, signal.SIGTERM)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(processes_of_instance(instance)) == 2  # the engine and its helper
        assert catches(supervisor.pid, signal.SIGTERM)
        stopped = time.monotonic()
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=20) == 0
        took = time.monotonic() - stopped
        assert 2.0 <= took < 6.0, took  # the 2 s bound, then SIGKILL to the group
        assert processes_of_instance(instance) == []
        err = supervisor.stderr.read()
        assert "did not exit within 2 s of the stop: killing its processes" in err
        status = json.loads((tmp_path / "cache" / "run" / "cpu.status.json").read_text())
        assert status["ready"] is False and status["error"] == "stopped (SIGTERM)"
        assert not (tmp_path / "cache" / "run" / "cpu.run.json").exists()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        for pid in processes_of_instance(instance):
            os.kill(pid, signal.SIGKILL)


GATED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import entrypoint.supervise as supervise
    from entrypoint.launch import Invocation
    from core.profiles import load_profile
    from entrypoint.ready import Watcher
    from core.settings import Settings

    settings = Settings(_env_file=None, cache_dir=Path(sys.argv[1]), port=int(sys.argv[2]))
    settings = settings.model_copy(update={"ready_timeout": 2.0})  # under the knob's 10 s minimum, for the test
    start = supervise.begin_start(load_profile("cpu"), settings)
    engine = [sys.executable, "-c", "import time; time.sleep(300)"]  # never answers /health
    invocation = Invocation(engine, {}, {}, Path("unused.yaml"), "k")
    gate = Watcher(load_profile("cpu"), settings, None, instance=start.instance)
    sys.exit(supervise.supervise(invocation, start, gate=gate.run))
    """
)


def test_a_gate_that_cannot_pass_stops_the_supervised_engine_and_says_why(tmp_path):
    supervisor = subprocess.run(
        [sys.executable, "-c", GATED, str(tmp_path / "cache"), str(free_port())],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60,
    )  # fmt: skip
    assert supervisor.returncode == 1
    assert "qwen38: the readiness gate failed: stopping the engine" in supervisor.stderr
    status = json.loads((tmp_path / "cache" / "run" / "cpu.status.json").read_text())
    assert status["ready"] is False and "did not answer 200 within 2 s" in status["error"]
    assert not (tmp_path / "cache" / "run" / "cpu.run.json").exists()


# A worker host whose head went: the gate stops the engine saying its TP workers are wedged.
# The engine stands in for vLLM's headless one: on SIGTERM its executor waits for its worker,
# which (blocked in a collective with the departed head) never acts on SIGTERM.
WORKER_HOST = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import entrypoint.supervise as supervise
    from entrypoint import lifecycle
    from entrypoint.launch import Invocation
    from core.profiles import load_profile
    from core.settings import Settings

    supervise.STOP_MARGIN_S = 30.0
    settings = Settings(_env_file=None, cache_dir=Path(sys.argv[1]), port=int(sys.argv[2]))
    start = supervise.begin_start(load_profile("cpu"), settings)
    engine = [sys.executable, "-c", sys.argv[3]]
    invocation = Invocation(engine, {}, {"shutdown-timeout": 0}, Path("unused.yaml"), "k")

    def gate(pid, stop, publish, stopping):
        deadline = time.monotonic() + 30
        while not (workers := lifecycle.parallel_workers(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("workers", *workers, flush=True)
        stop("the head 10.0.0.1:29501 stopped answering for 6 s", workers_wedged=True)
        return 1

    sys.exit(supervise.supervise(invocation, start, gate=gate))
    """
)

HEADLESS_ENGINE = textwrap.dedent(
    """
    import os, signal, sys, time
    import setproctitle
    worker = os.fork()
    if worker == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        setproctitle.setproctitle("VLLM::Worker_TP1")
        time.sleep(300)
        os._exit(0)

    def executor_shutdown(*_):
        os.waitpid(worker, 0)
        sys.exit(0)

    signal.signal(signal.SIGTERM, executor_shutdown)
    time.sleep(300)
    """
)


def test_a_worker_host_whose_head_went_has_its_wedged_tp_workers_killed_at_once(tmp_path):
    started = time.monotonic()
    supervisor = subprocess.run(
        [sys.executable, "-c", WORKER_HOST, str(tmp_path / "cache"), str(free_port()), HEADLESS_ENGINE],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert supervisor.returncode == 1, supervisor.stderr
    (worker,) = supervisor.stdout.split()[1:]  # the gate found the one titled VLLM::Worker_TP1
    assert not process_alive(int(worker))
    assert "killed the engine's 1 tensor-parallel worker(s), which wait on a peer that is gone" in supervisor.stderr
    assert "did not exit within" not in supervisor.stderr and took < 15, took  # not at the 30 s bound
    status = json.loads((tmp_path / "cache" / "run" / "cpu.status.json").read_text())
    assert status["ready"] is False and status["error"] == "stopped (the head 10.0.0.1:29501 stopped answering for 6 s)"


def test_when_serve_is_killed_its_reaper_ends_every_process_of_the_instance(tmp_path):
    """What a parent-death signal cannot do: the engine core vLLM spawns (a new interpreter)
    outlives the API server; the reaper, woken by its pipe closing, kills it too. The
    "engine" leads its own process group, as the supervisor starts it, and its child carries
    no readable mark (as vLLM's setproctitle leaves its engine core): the run record's group
    finds it."""
    instance = "cccc000011112222"
    record = tmp_path / "cpu.run.json"
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from pathlib import Path
        from entrypoint.lifecycle import RunRecord, process_start_time, start_reaper
        start_reaper({instance!r}, Path({str(record)!r}))
        env = {{**os.environ, "QWEN38_INSTANCE": {instance!r}}}
        sleep = "import time; time.sleep(300)"
        inner = ("import os, subprocess, sys, time; env = dict(os.environ); env.pop('QWEN38_INSTANCE'); "
                 f"subprocess.Popen([sys.executable, '-c', {{sleep!r}}], env=env); time.sleep(300)")
        engine = subprocess.Popen([sys.executable, "-c", inner], env=env, process_group=0)
        RunRecord("cpu", {instance!r}, os.getpid(), process_start_time(os.getpid()), engine.pid,
                  process_start_time(engine.pid), "127.0.0.1:1").write(Path({str(record)!r}))
        print("started", flush=True)
        time.sleep(300)
        """
    )
    serve = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    engine = []
    try:
        assert serve.stdout.readline().strip() == "started"
        run = read_record(record)
        deadline = time.monotonic() + 20
        while len(engine_group(run)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        engine = engine_group(run)
        assert len(engine) == 2  # a spawned "engine" and its own child
        assert processes_of_instance(instance) == [run.engine_pid]  # the child's mark is not readable
        assert processes_of_instance(instance, run) == engine
        serve.kill()  # SIGKILL: no cleanup code runs in it
        serve.wait()
        deadline = time.monotonic() + 10
        while any(process_alive(pid) for pid in engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in engine if process_alive(pid)] == []
    finally:
        for pid in engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_reused_group_id_is_not_taken_for_the_engines_group(tmp_path):
    """A live group leader whose start time is not the recorded engine's owns that group id
    now: nothing of it is killed."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    try:
        stale = RunRecord("cpu", "dddd000011112222", 1, None, other.pid, 1, "127.0.0.1:1")
        assert engine_group(stale) == []
        assert processes_of_instance("dddd000011112222", stale) == []
        assert engine_group(RunRecord("cpu", "dddd000011112222", 1, None, other.pid,
                                      process_start_time(other.pid), "127.0.0.1:1")) == [other.pid]
    finally:
        other.kill()
        other.wait()


# ---- a held engine: started before verify and plan, let go or abandoned ------------------

# The supervisor side of `qwen38 serve`: prestart, then "preflight" (argv[4]: go or refuse).
HELD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import entrypoint.supervise as supervise
    from entrypoint.launch import Invocation
    from core.profiles import load_profile
    from core.settings import Settings

    settings = Settings(_env_file=None, cache_dir=Path(sys.argv[1]), port=int(sys.argv[2]))
    start = supervise.begin_start(load_profile("cpu"), settings)
    invocation = Invocation([sys.executable, "-c", sys.argv[3]], {}, {}, Path("unused.yaml"), "k")
    supervisor = supervise.Supervisor(invocation, start, gate=None)
    supervisor.prestart()
    print("held", supervisor.pid, start.instance, flush=True)
    sys.stdin.readline()  # the test looks at the held engine here
    if sys.argv[4] == "refuse":
        supervisor.abandon()
        supervise.begin_start(load_profile("cpu"), settings).lock.release()  # the lock went
        print("abandoned", flush=True)
        sys.exit(2)
    sys.exit(supervisor.run())
    """
)

# The engine side: entrypoint.engine_main's own hold(), importing a module that prints (as
# importing vLLM logs) on both streams.
HELD_ENGINE = textwrap.dedent(
    """
    import os, sys
    from entrypoint.engine_main import HOLD_ENV, hold
    go = hold(int(os.environ[HOLD_ENV]), ["json", "noisy_import"])
    assert "noisy_import" in sys.modules
    print("served" if go else "refused", flush=True)
    """
)
NOISY_IMPORT = 'import sys\nprint("imported while held")\nprint("a warning while held", file=sys.stderr)\n'


def _held(tmp_path, decision: str, engine: str = HELD_ENGINE) -> subprocess.Popen:
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "noisy_import.py").write_text(NOISY_IMPORT)
    return subprocess.Popen(
        [sys.executable, "-c", HELD, str(tmp_path / "cache"), str(free_port()), engine, decision],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "modules")])},
    )  # fmt: skip


def test_a_held_engine_runs_once_let_go_and_prints_what_it_printed_while_held(tmp_path):
    supervisor = _held(tmp_path, "go")
    try:
        word, pid, instance = supervisor.stdout.readline().split()
        assert word == "held"
        # Its marked environment shows in /proc once the new process has run its first
        # instructions: on a loaded machine (the unit tests on two workers) not always at once.
        deadline = time.monotonic() + 10
        while processes_of_instance(instance) != [int(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_of_instance(instance) == [int(pid)]
        assert read_record(record_path(tmp_path / "cache", "cpu")).engine_pid == int(pid)
        time.sleep(1.0)  # the engine imports, then waits for its word
        assert process_state(int(pid)) in ("S", "R")
        out, err = supervisor.communicate("\n", timeout=30)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 1  # an engine that exits by itself: the supervisor says so
    assert out.splitlines() == ["imported while held", "served"]
    assert "a warning while held" in err and "exited on its own (exit 0)" in err
    assert not record_path(tmp_path / "cache", "cpu").exists()


def test_an_abandoned_engine_is_gone_at_once_with_nothing_it_printed(tmp_path):
    supervisor = _held(tmp_path, "refuse")
    try:
        _, pid, instance = supervisor.stdout.readline().split()
        time.sleep(0.5)
        abandoned = time.monotonic()
        out, err = supervisor.communicate("\n", timeout=30)
        took = time.monotonic() - abandoned
    finally:
        supervisor.kill()
    assert supervisor.returncode == 2 and out.splitlines() == ["abandoned"], (out, err)
    assert err == "" and took < 5.0, took  # nothing of the engine's shows; no grace period waited
    assert process_state(int(pid)) is None and processes_of_instance(instance) == []
    assert not record_path(tmp_path / "cache", "cpu").exists()


def test_an_engine_that_dies_while_held_is_reported_when_let_go(tmp_path):
    dying = "import sys; print('cannot import vLLM', file=sys.stderr); sys.exit(3)"
    supervisor = _held(tmp_path, "go", engine=dying)
    try:
        supervisor.stdout.readline()
        time.sleep(1.0)  # dead before its word: the write to its pipe finds no reader
        out, err = supervisor.communicate("\n", timeout=30)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 3, err
    assert "cannot import vLLM" in err and "exited on its own (exit 3)" in err
