"""What one start of `qwen38 serve` owns on disk and in the process table, and how a later
start recognises (and removes) what a killed one left behind.

Its files in ``CACHE_DIR/run/`` are named in `entrypoint.run_files`: the run lock this module
takes (`RunLock`) and the run record it writes and reads (`RunRecord`).

The instance id is random per start. It is in the engine's environment, which every process
vLLM forks or spawns inherits, and in the ``x-qwen38-instance`` header of every answer. A live
process whose environment carries a recorded instance id is provably a leftover of that
start: the next start kills it and says so. Nothing else is ever killed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from core.atomic import atomic_write_text
from core.errors import LaunchError
from entrypoint.asgi import INSTANCE_ENV

LEFTOVER_EXIT_WAIT_S = 10.0


def new_instance() -> str:
    return secrets.token_hex(8)


# ---- /proc ------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # fields from the state on; comm may hold spaces


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot): a pid plus this is unique."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def process_state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (exited, not yet reaped by its parent)."""
    return process_state(pid) not in (None, "Z")


def process_session(pid: int) -> int | None:
    """The session id of ``pid`` (a process started with setsid leads its own)."""
    fields = _stat_fields(pid)
    return int(fields[3]) if fields else None


def is_running(pid: int, start_time: int | None) -> bool:
    """``pid`` is the very process that had ``start_time`` and is not a zombie."""
    state = process_state(pid)
    return state is not None and state != "Z" and process_start_time(pid) == start_time


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid``."""
    found = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(pid)
    return found


def _cmdline(pid: int) -> bytes | None:
    """The process's command line as /proc has it (NUL-separated; a setproctitle title where
    one was set), or None where it is gone or another user's."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def parallel_workers(engine_pid: int) -> list[int]:
    """The live tensor-parallel worker processes in the engine's process group: vLLM's
    multiprocessing executor titles them ``<prefix>::Worker...`` (setproctitle; the prefix is
    VLLM_PROCESS_NAME_PREFIX, ``VLLM`` by default)."""
    return [
        pid for pid in group_members(engine_pid)
        if pid != engine_pid and b"::Worker" in (_cmdline(pid) or b"").split(b"\0", 1)[0]
    ]  # fmt: skip


def processes_with(entry: str) -> list[int]:
    """Live processes other than this one whose environment holds ``entry`` (``NAME=value``)."""
    marker = entry.encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone, or another user's
        if marker in environ.split(b"\0") and process_alive(pid):
            found.append(pid)
    return found


def processes_of_instance(instance: str, record: RunRecord | None = None) -> list[int]:
    """Live processes of one start: those whose environment carries ``QWEN38_INSTANCE=<instance>``
    and, given that start's run record, the members of its engine's process group.

    The environment alone does not find them all: vLLM names its engine core and workers with
    setproctitle, which overwrites the memory ``/proc/PID/environ`` reads, so their mark is
    lost there. They stay in the process group the supervisor made for the engine (vLLM's
    spawn and fork keep it), which the record names (`engine_group`)."""
    found = set(engine_group(record)) if record is not None and record.instance == instance else set()
    return sorted(found | set(processes_with(f"{INSTANCE_ENV}={instance}")))


def engine_group(record: RunRecord) -> list[int]:
    """Live members of the recorded engine's process group that started no earlier than it.

    The group id is the engine's pid. A live group leader of that id that is not the recorded
    engine (another start time) means the id was reused for someone else's group: nothing of
    it is ours."""
    leader = _stat_fields(record.engine_pid)
    if leader is not None and int(leader[2]) == record.engine_pid and int(leader[19]) != record.engine_start:
        return []
    since = record.engine_start or 0
    return [
        pid for pid in group_members(record.engine_pid)
        if pid != os.getpid() and (process_start_time(pid) or 0) >= since
    ]  # fmt: skip


def describe(pid: int) -> str:
    raw = _cmdline(pid)
    cmd = "?" if raw is None else raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return f"{pid} ({cmd[:60]})"


# ---- the run record -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    profile: str
    instance: str
    supervisor_pid: int
    supervisor_start: int | None
    engine_pid: int  # also the engine's process-group id
    engine_start: int | None
    address: str

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")


def read_record(path: Path) -> RunRecord | None:
    try:
        return RunRecord(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


# ---- the start ------------------------------------------------------------------------------


class RunLock:
    """The exclusive lock of one profile's run files, held by the live supervisor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = None

    def acquire(self, record: Path) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+b")  # noqa: SIM115 (held for the supervisor's life)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            holder = read_record(record)
            who = f"pid {holder.supervisor_pid}, instance {holder.instance}" if holder else "another process"
            raise LaunchError(
                f"{self.path}: profile {self.path.stem} is already being served from this CACHE_DIR ({who}); "
                "stop that `qwen38 serve` first, or give this one its own CACHE_DIR"
            ) from None
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _is_resource_tracker(pid: int) -> bool:
    return b"multiprocessing.resource_tracker" in (_cmdline(pid) or b"")


def kill_instance(
    instance: str,
    record: RunRecord | None = None,
    wait_s: float = LEFTOVER_EXIT_WAIT_S,
    tracker_grace_s: float = 2.0,
) -> list[str]:
    """SIGKILL every live process of ``instance`` (its run record, if given, adds its engine's
    process group); what was killed, for people.

    Python's multiprocessing resource trackers go last: once the processes they serve are
    gone they remove the shared memory those leaked, then exit by themselves."""

    found = processes_of_instance(instance, record)
    described = [describe(pid) for pid in found]
    for pid in found:
        if not _is_resource_tracker(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + tracker_grace_s
    while time.monotonic() < deadline and processes_of_instance(instance, record):
        time.sleep(0.05)
    for pid in processes_of_instance(instance, record):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and processes_of_instance(instance, record):
        time.sleep(0.1)
    still = processes_of_instance(instance, record)
    if still:
        raise LaunchError(
            f"processes {', '.join(map(str, still))} of instance {instance} survived SIGKILL for {wait_s:.0f} s; "
            f"find them with `ps -o pid,stat,cmd -p {','.join(map(str, still))}`"
        )
    return described


def clean_leftovers(record: RunRecord | None) -> list[str]:
    """Kill what a previous start (whose supervisor is gone: we hold the lock) left alive."""
    return [] if record is None else kill_instance(record.instance, record)


def start_reaper(instance: str, record_file: Path | None = None) -> int:
    """Fork a process that kills every process of ``instance`` once this one is gone (with the
    engine's process group from ``record_file``, the run record written once it started).

    A parent-death signal reaches only a process's own children, and vLLM *spawns* its
    engine core on CPU (a new interpreter, no fork hook runs), so when `qwen38 serve` is
    killed with SIGKILL something else has to end its engine. The reaper holds the read end
    of a pipe whose write end only this process has (non-inheritable: the engine's exec
    closes it); the kernel closes it when this process dies, however it dies, and the reaper
    wakes, kills the instance's processes and exits. It runs in its own session, so a signal
    to this process group does not take it too. Returns the write end (keep it open).
    """
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # pragma: no cover (exercised through a child process in the tests)
        code = 0
        try:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGUSR1):
                signal.signal(signum, signal.SIG_DFL)  # none of the parent's handlers
            os.setsid()
            os.closerange(3, read_end)  # the run lock's fd among them: the lock stays the supervisor's
            os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
            while os.read(read_end, 1):
                pass
            record = read_record(record_file) if record_file is not None else None
            killed = kill_instance(instance, record)
            if killed:
                print(f"qwen38: `qwen38 serve` is gone: killed its {len(killed)} engine processes", file=sys.stderr)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(read_end)
    return write_end


def port_answers(address: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``address:port``."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_address_free(host: str, port: int) -> None:
    """Refuse a start whose address another process already listens on (before loading a weight)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(
                    f"{host}:{port} is already in use by another process; stop it or set PORT to a free port"
                ) from None
            raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
