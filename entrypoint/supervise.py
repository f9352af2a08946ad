"""`qwen38 serve`'s last step: run vLLM as a child it owns, stop it within a bound.

`begin_start` runs first, before verify and plan: it takes the profile's run lock, kills
what a killed earlier start provably left (`entrypoint.lifecycle`), removes the old
readiness status and refuses an address another process listens on.

`Supervisor.prestart` then forks the engine (`entrypoint.engine_main`) into its own process
group, with a fresh instance id and a parent-death signal, its stdout and stderr piped through
this process (`entrypoint.engine_output`: passed on as they come, and read for the phase of
the start that the readiness gate's heartbeat prints), *held*: it imports vLLM while
this process verifies and plans, and serves only once `Supervisor.run` lets it go
(`abandon` ends it when the preflight refuses the start). `run` runs the readiness gate and
then the watchdog (`entrypoint.watchdog`) in a thread, and waits. It stays the process that gets the signals (PID 2 under tini in the images):

- SIGTERM / SIGINT / SIGHUP: vLLM's API server gets SIGUSR1 (our middleware admits no new
  request and ends what is still open after the drain: the profile's ``shutdown_timeout`` or
  SHUTDOWN_TIMEOUT, `entrypoint.drain`), then SIGTERM (vLLM stops its engine). If the engine
  has not exited ``STOP_MARGIN_S`` after the drain, its whole process group is killed. A
  second signal kills it at once.
- the gate failing, or the watchdog finding a stall or a failed canary (WATCHDOG_ACTION=stop):
  the same stop, with that reason, and the exit code is 1. A worker host's gate that saw its
  head go also has the engine's tensor-parallel workers killed at once: they wait in a
  collective for a peer that is gone and cannot act on SIGTERM, and vLLM's executor would
  wait 5 s, then 4 s after a SIGTERM, before it kills them itself.
- the engine exiting by itself (a crash, kill -9): its process group
  is swept (SIGKILL after ``GROUP_GRACE_S``), the status says why, and the exit code is
  non-zero.
- this process killed (kill -9): the API server has a parent-death signal, and a reaper
  process (`lifecycle.start_reaper`) kills every process of the instance (vLLM spawns its
  engine core on CPU, out of reach of a parent-death signal set here).

In every case the status file ends as ``ready: false`` and the run record is removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from core.errors import LaunchError
from core.profiles import SHUTDOWN_MARGIN_S, Profile
from core.settings import Settings
from entrypoint import lifecycle, run_files
from entrypoint.asgi import INSTANCE_ENV
from entrypoint.drain import DRAIN_ENV, STOP_SIGNAL
from entrypoint.engine_main import GO, HOLD_ENV, die_with_parent
from entrypoint.engine_output import Relay, StartPhase
from entrypoint.launch import Invocation
from entrypoint.ready import ReadyReport, base_url_for, read_status, write_status

STOP_MARGIN_S = float(SHUTDOWN_MARGIN_S)  # after the drain: the engine core's teardown, uvicorn's exit, ours
GROUP_GRACE_S = 5.0  # after the API server exits: its helpers' own cleanup (shared memory)
RELAY_DRAIN_S = 2.0  # after the engine's group is gone: the last bytes it wrote reach our output
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SUPERVISOR_ENV = "QWEN38_SUPERVISOR_PID"
DROPPED_ENV = ("VLLM_API_KEY",)  # vLLM's own narrower key check must not be installed beside ours


def say(message: str) -> None:
    print(f"qwen38: {message}", file=sys.stderr, flush=True)


@dataclass
class Start:
    """A start that holds its profile's run lock; made by `begin_start`."""

    profile: Profile
    settings: Settings
    instance: str
    lock: lifecycle.RunLock
    cleaned: list[str] = field(default_factory=list)

    @property
    def record_path(self):
        return run_files.record_path(self.settings.cache_dir, self.profile.name)


def begin_start(profile: Profile, settings: Settings, serves_api: bool = True) -> Start:
    """Lock, clean up after a killed start, forget the old verdict, check the address (where
    this start serves the API: a multi-host profile's worker host does not)."""
    lock = lifecycle.RunLock(run_files.lock_path(settings.cache_dir, profile.name))
    record = run_files.record_path(settings.cache_dir, profile.name)
    lock.acquire(record)
    try:
        run_files.status_path(settings.cache_dir, profile.name).unlink(missing_ok=True)
        cleaned = lifecycle.clean_leftovers(lifecycle.read_record(record))
        if cleaned:
            say(f"killed {len(cleaned)} processes left by a killed earlier start: {'; '.join(cleaned)}")
        record.unlink(missing_ok=True)
        if serves_api:
            lifecycle.check_address_free(settings.host, settings.port)
    except BaseException:
        lock.release()
        raise
    return Start(profile, settings, lifecycle.new_instance(), lock, cleaned)


def check_interpreter(invocation: Invocation) -> None:
    if not os.path.exists(invocation.argv[0]):
        raise LaunchError(f"engine interpreter {invocation.argv[0]} does not exist")


def engine_environment(invocation: Invocation, instance: str) -> dict[str, str]:
    env = {**os.environ, **invocation.env, INSTANCE_ENV: instance, SUPERVISOR_ENV: str(os.getpid())}
    for name in DROPPED_ENV:
        env.pop(name, None)
    return env


def drain_seconds(invocation: Invocation) -> float:
    return float(invocation.env.get(DRAIN_ENV, 0) or 0)


class Supervisor:
    def __init__(self, invocation: Invocation, start: Start, gate: Callable[..., int] | None) -> None:
        self.invocation = invocation
        self.start = start
        self.gate = gate
        self.bound = drain_seconds(invocation) + STOP_MARGIN_S
        self.pid = 0
        self.stop_reason: str | None = None
        self.stop_started = 0.0
        self.gate_failed = False
        self.failure: str | None = None  # why the gate or the watchdog stopped the engine
        self.workers_wedged = False  # the gate says the TP workers wait on a peer that is gone
        self._final = False
        self._status_lock = threading.Lock()
        self._hold: int | None = None  # the write end of a held engine's pipe
        self.phase = StartPhase()  # what the engine's output says it is doing
        self._relays: list[Relay] = []

    # ---- the child ---------------------------------------------------------------------

    def prestart(self) -> None:
        """Start the engine held (see `entrypoint.engine_main`), with the reaper that ends it
        if this process is killed and the run record that finds it after a crash."""
        # First, before any thread: the reaper, which ends the engine if we are killed.
        self._reaper_pipe = lifecycle.start_reaper(self.start.instance, self.start.record_path)
        read_end, self._hold = os.pipe()
        try:
            self.pid = self._spawn(hold=read_end)
        finally:
            os.close(read_end)
        lifecycle.RunRecord(
            profile=self.start.profile.name,
            instance=self.start.instance,
            supervisor_pid=os.getpid(),
            supervisor_start=lifecycle.process_start_time(os.getpid()),
            engine_pid=self.pid,
            engine_start=lifecycle.process_start_time(self.pid),
            address=f"{self.start.settings.host}:{self.start.settings.port}",
        ).write(self.start.record_path)

    def abandon(self) -> None:
        """End a held engine whose start was refused (it has read no weight and holds nothing
        but its imports: its group is killed at once); the run files and the lock go."""
        try:
            self._kill_group()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self._drain_relays()
            if self._hold is not None:
                os.close(self._hold)
                self._hold = None
        finally:
            self.start.record_path.unlink(missing_ok=True)
            self.start.lock.release()

    def _spawn(self, hold: int | None = None) -> int:
        argv = self.invocation.argv
        env = engine_environment(self.invocation, self.start.instance)
        if hold is not None:
            env[HOLD_ENV] = str(hold)
        if os.isatty(1):  # what a terminal gave the engine before its output went through a pipe
            env.setdefault("VLLM_LOGGING_COLOR", "1")
            env.setdefault("PYTHONUNBUFFERED", "1")
        parent = os.getpid()
        # The engine's stdout and stderr: pipes (close-on-exec here) that relays pass on.
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child execs at once)
            try:
                os.setpgid(0, 0)
                die_with_parent(parent)
                # Ignored across the exec until the app handles it (entrypoint.drain): a stop
                # during the start must not end the engine through SIGUSR1's default action.
                signal.signal(STOP_SIGNAL, signal.SIG_IGN)
                if hold is not None:
                    os.set_inheritable(hold, True)
                os.dup2(out_write, 1)
                os.dup2(err_write, 2)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        os.close(out_write)
        os.close(err_write)
        self._relays = [
            Relay(out_read, 1, self.phase, "stdout").start(),  # where the engine wrote before: our fds 1 and 2
            Relay(err_read, 2, self.phase, "stderr").start(),
        ]
        with contextlib.suppress(OSError):  # either side may win this race; the result is the same
            os.setpgid(pid, pid)
        return pid

    def _drain_relays(self) -> None:
        """Let the engine's last output reach ours (its every writer is gone by now), waiting
        at most RELAY_DRAIN_S in all: a writer outside the group must not hold up the exit."""
        deadline = time.monotonic() + RELAY_DRAIN_S
        for relay in self._relays:
            relay.join(max(0.0, deadline - time.monotonic()))

    # ---- signals -----------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is not None:
            say(f"{reason} again: killing the engine's processes now")
            self._kill_group()
            return
        self.stop_reason = reason
        self.stop_started = time.monotonic()
        drain = drain_seconds(self.invocation)
        how = f"in-flight requests drain for up to {drain:.0f} s" if drain else "in-flight requests are aborted"
        say(f"{reason}: stopping the engine ({how}; every process ends within {self.bound:.0f} s)")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, STOP_SIGNAL)  # the guard: admit nothing new, end what is open after the drain
            os.kill(self.pid, signal.SIGTERM)  # vLLM: stop the engine
        if self.workers_wedged:
            self._kill_parallel_workers()
        signal.setitimer(signal.ITIMER_REAL, self.bound)

    def _kill_parallel_workers(self) -> None:
        workers = lifecycle.parallel_workers(self.pid)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if workers:
            say(f"killed the engine's {len(workers)} tensor-parallel worker(s), which wait on a peer that is gone")

    def _on_signal(self, signum: int, _frame) -> None:
        if self.gate_failed and self.stop_reason is None:
            self.request_stop(self.failure or "the readiness gate failed")
        else:
            self.request_stop(signal.Signals(signum).name)

    def _on_deadline(self, _signum: int, _frame) -> None:
        say(f"the engine did not exit within {self.bound:.0f} s of the stop: killing its processes")
        self._kill_group()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    # ---- the gate ----------------------------------------------------------------------

    def publish(self, report) -> None:
        """Write a readiness verdict, unless the supervisor already wrote its final one."""

        with self._status_lock:
            if self._final:
                return
            report.instance = self.start.instance
            report.pid = os.getpid()
            write_status(self.start.settings, self.start.profile.name, report)

    def _run_gate(self) -> None:
        assert self.gate is not None

        def fail_closed(reason: str = "the readiness gate failed", workers_wedged: bool = False) -> None:
            self.gate_failed, self.failure, self.workers_wedged = True, reason, workers_wedged
            os.kill(os.getpid(), signal.SIGTERM)  # handled on the main thread, like any stop

        try:
            # The gate, then the watchdog, which ends when a stop begins (`stopping`).
            self.gate(self.pid, stop=fail_closed, publish=self.publish, stopping=lambda: self.stop_reason is not None)
        except Exception as exc:  # a bug in the gate must not leave the engine ungated
            say(f"ready: the gate or its watchdog crashed ({type(exc).__name__}: {exc}); stopping the engine (fail closed)")
            fail_closed()

    # ---- the run ---------------------------------------------------------------------

    def run(self) -> int:
        if not self.pid:
            self.prestart()
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGALRM, self._on_deadline)
        if self._hold is not None:  # let the held engine go on
            with contextlib.suppress(BrokenPipeError):  # it died holding: _wait reports it
                os.write(self._hold, GO)
            os.close(self._hold)
            self._hold = None
        if self.gate is not None:
            threading.Thread(target=self._run_gate, name="readiness-gate", daemon=True).start()
        try:
            return self._wait()
        finally:
            self.start.record_path.unlink(missing_ok=True)
            self.start.lock.release()

    def _wait(self) -> int:
        # WNOWAIT: the exited leader stays a zombie, so its pid (the group id) cannot be reused
        # while the group is swept.
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        exited_at = time.monotonic()
        grace = GROUP_GRACE_S
        if self.stop_reason is not None:
            grace = max(0.0, min(grace, self.stop_started + self.bound - exited_at))
        deadline = exited_at + grace
        while lifecycle.group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = [p for p in lifecycle.group_members(self.pid) if p != self.pid]
        if leftovers:
            try:  # the resource trackers last: they remove the shared memory the others leaked
                lifecycle.kill_instance(self.start.instance, wait_s=5.0)
            except LaunchError as exc:
                say(str(exc))
        self._kill_group()  # anything of the group left without the instance's mark
        _, status = os.waitpid(self.pid, 0)
        stopped_at = time.monotonic()  # the engine's processes are gone: what a stop is timed by
        self._drain_relays()
        signal.setitimer(signal.ITIMER_REAL, 0)
        code = os.waitstatus_to_exitcode(status)
        how = f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        if leftovers:
            how += f"; killed {len(leftovers)} of its processes that outlived it"
        if self.stop_reason is not None:
            took = stopped_at - self.stop_started
            say(f"engine stopped {took:.1f} s after {self.stop_reason} ({how})")
            error = f"stopped ({self.stop_reason})"
        else:
            say(f"the engine (pid {self.pid}) exited on its own ({how}); its process group is gone")
            error = f"the engine exited on its own ({how})"
        self._finish(error)
        if self.gate_failed:
            return 1
        if self.stop_reason is not None:
            return 0
        return code if code > 0 else 1

    def _finish(self, error: str) -> None:
        with self._status_lock:
            self._final = True
            settings, profile = self.start.settings, self.start.profile
            previous = read_status(settings, profile.name) or {}
            report = ReadyReport(False, base_url_for(settings), profile.model_ids, 0.0, error=error)
            if previous.get("instance") == self.start.instance and previous.get("error"):
                report.error = previous["error"]  # the gate's reason, when it failed closed
            report.identity = previous.get("identity")
            report.instance = self.start.instance
            report.pid = os.getpid()
            write_status(settings, profile.name, report)


def supervise(invocation: Invocation, start: Start, gate: Callable[..., int] | None = None) -> int:
    """Run the engine until it exits; the exit code of `qwen38 serve`."""
    return Supervisor(invocation, start, gate).run()
