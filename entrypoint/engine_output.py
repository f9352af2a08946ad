"""The engine's output, passed through as it comes, and what it says about the start.

`qwen38 serve` runs vLLM as a child (`entrypoint.supervise`) whose stdout and stderr are
pipes to the supervisor. A `Relay` thread per stream copies every byte to the supervisor's
own stdout or stderr as soon as it is read (a partial line or a tqdm bar's carriage return
included: nothing is held back, reordered within the stream or dropped; when our own stream
is gone the bytes are still read and discarded, so the engine never blocks on a full pipe),
and hands the text to `StartPhase`, which follows vLLM's own log lines through the start:
loading weights, compiling, profiling the KV cache, capturing CUDA graphs, starting the API
server. While the readiness gate waits for the first ``/health``, `Heartbeat` prints that
phase every `HEARTBEAT_S` seconds with the time spent and the time left of READY_TIMEOUT
(a GPU start can take half an hour, and vLLM is silent for minutes of it).

The markers (`PHASES`) are messages of vLLM 0.28.0 (and uvicorn's last start-up line) as
this build logs them at LOG_LEVEL info; at warning vLLM logs none of them and our heartbeat
is off too (`core.progress`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from core.progress import format_duration, say

HEARTBEAT_S = 30.0
HEARTBEAT_ENV = "QWEN38_HEARTBEAT_S"  # a shorter beat for the tests that start a server
FIRST_PHASE = "starting the engine"
SERVING = "API server up, waiting for its first /health"

# (text in one of vLLM's log lines, the phase it begins), in the order a start goes through them.
PHASES: tuple[tuple[str, str], ...] = (
    ("non-default args:", "starting the engine core process"),  # entrypoints/.../api_utils.py
    ("Initializing a V1 LLM engine", "initializing the engine"),  # v1/engine/core.py
    ("Starting to load model", "loading weights"),  # v1/worker/{gpu,cpu}_model_runner.py
    ("Loading model from scratch", "loading weights"),  # v1/worker/gpu/model_runner.py (V2 runner)
    ("Loading safetensors checkpoint shards", "loading weights"),  # model_loader/weight_utils.py (tqdm)
    ("Loading drafter model", "loading the drafter's weights"),
    ("Model loading took", "profiling / KV cache"),
    ("for vLLM's torch.compile", "compiling (torch.compile / Dynamo)"),  # "Using cache directory: ..."
    ("vLLM's torch.compile cache is disabled", "compiling (torch.compile / Dynamo)"),
    ("Dynamo bytecode transform time", "compiling (torch.compile / Inductor)"),
    ("Compiling a graph for compile range", "compiling (torch.compile / Inductor)"),
    ("Directly load the compiled graph", "compiling (loading compiled graphs from the cache)"),
    ("Warming up model for the compilation", "compiling (torch.compile warm-up)"),  # cpu_model_runner.py
    ("torch.compile took", "profiling / KV cache"),  # compilation/monitor.py
    ("Initial profiling/warmup run took", "profiling / KV cache"),
    ("Profiling CUDA graph memory", "profiling / KV cache"),
    ("Available KV cache memory", "profiling / KV cache"),  # v1/worker/gpu_worker.py
    ("GPU KV cache size", "allocating the KV cache"),  # v1/core/kv_cache_utils.py
    ("Compile and warming up model for size", "warming up"),
    ("Torch profiler disabled for CUDA graph capture", "capturing CUDA graphs"),
    ("Torch profiler enabled for CUDA graph capture", "capturing CUDA graphs"),
    ("Capturing CUDA graphs", "capturing CUDA graphs"),  # the capture's tqdm bar
    ("Graph capturing finished", "warming up"),
    ("Warming up done", "finishing the engine's start"),  # cpu_model_runner.py
    ("init engine (profile, create kv cache, warmup model) took", "starting the API server"),
    ("Starting vLLM server on", "starting the API server"),  # entrypoints/openai/api_server.py
    ("Application startup complete", SERVING),  # uvicorn: the last line before /health answers
)
MAX_PENDING = 1 << 16  # a "line" longer than this is scanned in pieces


class StartPhase:
    """The phase of the engine's start, as its log lines tell it; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._phase = FIRST_PHASE
        self._clock = clock
        self.since = clock()
        self.scanning = True  # off once the API server is up: request logs are not scanned

    @property
    def current(self) -> str:
        with self._lock:
            return self._phase

    def see(self, line: str) -> None:
        """One line of the engine's output (stdout or stderr)."""
        phase = None
        for marker, begins in PHASES:
            if marker in line:
                phase = begins
        if phase is None:
            return
        with self._lock:
            if phase != self._phase:
                self._phase, self.since = phase, self._clock()
            if phase == SERVING:
                self.scanning = False

    def feed(self, pending: bytes, chunk: bytes) -> bytes:
        """Scan the complete lines of ``pending + chunk`` (split at newlines and carriage
        returns, as tqdm redraws); returns the incomplete rest."""
        data = pending + chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0 and len(data) <= MAX_PENDING:
            return data
        done, rest = (data, b"") if cut < 0 else (data[: cut + 1], data[cut + 1 :])
        for line in done.replace(b"\r", b"\n").split(b"\n"):
            if line:
                self.see(line.decode("utf-8", errors="replace"))
        return rest


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError:
            return False  # our stream is gone: keep reading the engine's, discard it
        view = view[n:]
    return True


class Relay:
    """Copies what the engine writes into ``source`` (a pipe's read end, owned from now on)
    to ``target`` (our fd 1 or 2) as it arrives, scanning it for the start's phase."""

    def __init__(self, source: int, target: int, phase: StartPhase, name: str) -> None:
        self.source, self.target, self.phase = source, target, phase
        self.thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    def start(self) -> Relay:
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        pending = b""
        writable = True
        try:
            while True:
                try:
                    chunk = os.read(self.source, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break  # every writer (the engine and its children) has closed it
                if writable:
                    writable = _write_all(self.target, chunk)
                if self.phase.scanning:
                    pending = self.phase.feed(pending, chunk)
                elif pending:
                    pending = b""
        finally:
            os.close(self.source)


def heartbeat_line(phase: str, waited: float, timeout: float) -> str:
    """``qwen38: starting: capturing CUDA graphs (4 min 10 s in, 25 min 50 s left of READY_TIMEOUT)``."""
    left = max(0.0, timeout - waited)
    return f"qwen38: starting: {phase} ({format_duration(waited)} in, {format_duration(left)} left of READY_TIMEOUT)"


def heartbeat_interval() -> float:
    try:
        return max(0.1, float(os.environ.get(HEARTBEAT_ENV, HEARTBEAT_S)))
    except ValueError:
        return HEARTBEAT_S


class Heartbeat:
    """Called with the seconds waited so far at each poll of the readiness gate; prints the
    phase every ``every`` seconds (through `core.progress.say`: LOG_LEVEL applies)."""

    def __init__(
        self,
        phase: Callable[[], str],
        timeout: float,
        every: float | None = None,
        emit: Callable[[str], None] = say,
    ) -> None:
        self.phase, self.timeout, self.emit = phase, timeout, emit
        self.every = heartbeat_interval() if every is None else every
        self.next = self.every

    def __call__(self, waited: float) -> None:
        if waited >= self.next:
            self.emit(heartbeat_line(self.phase(), waited, self.timeout))
            while self.next <= waited:
                self.next += self.every
