"""A child Python that has imported torch and vLLM once and forks a fresh process per script.

Many checks run a short script against a view of the installed vLLM in a child Python
(`tests.support.vllm_views.run_python`); most of such a child's time is importing torch and
vLLM (~8 s of one core on the 2-core machine), the same modules every time. A warm Python
imports them once per (view, environment) and then, per script, forks: the script runs in a
new process (its own memory, modules it imports itself, exit code, stdout and stderr), as
`python -c SCRIPT` would, minus the common imports.

Used only where forking is safe: nothing in the warm Python has started threads (importing
torch and vLLM starts none) and no GPU driver is initialised (CUDA cannot be forked, so on a
machine with an NVIDIA GPU every script runs in a plain child). Each script waits for the one
before it on the same warm Python; scripts of different views or environments run side by side.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The modules every script here imports: torch, vLLM's package and its configuration (which
# bring in transformers). Nothing that depends on what a script sets first: the attention
# backends and models are left to the script (e.g. one that swaps vLLM's Triton module in).
PRELOADED = ("torch", "vllm", "vllm.config", "vllm.engine.arg_utils")

# The warm Python's own program: import, say so, then one job per stdin line.
SERVER = r"""
import importlib, json, os, sys

# The protocol has stdout's pipe to itself: what the imports print (vLLM logs to stdout) goes
# to stderr, which the warm Python discards.
protocol = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def run_forked(job, protocol_fd):
    # In the fork: stdin from /dev/null, stdout and stderr to the job's files, then the script
    # in a cleared __main__ as `python -c` runs it (everything here is local: it is cleared).
    import os, sys, traceback
    code = 1
    try:
        os.close(protocol_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        import __main__
        namespace = __main__.__dict__
        builtins = namespace["__builtins__"]
        namespace.clear()
        namespace.update(__name__="__main__", __builtins__=builtins)
        sys.argv = ["-c"]
        try:
            exec(compile(job["code"], "<string>", "exec"), namespace)
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


modules = sys.argv[1:]
if modules and modules[0].startswith("--site="):
    # A site directory of its own first (tests.support.avx2_child), its .pth lines run, as a
    # child started with avx2_child.PRELUDE adds it before anything imports torch.
    import site
    site.addsitedir(modules.pop(0)[len("--site="):])
for name in modules:
    importlib.import_module(name)
protocol.write("ready\n")
protocol.flush()
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        run_forked(job, protocol.fileno())
    protocol.write(json.dumps({"pid": pid}) + "\n")
    protocol.flush()
    _, status = os.waitpid(pid, 0)
    returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    protocol.write(json.dumps({"returncode": returncode}) + "\n")
    protocol.flush()
"""


def forking_is_safe() -> bool:
    """False on a machine with an NVIDIA GPU (a CUDA build may initialise the driver on import)."""
    return not Path("/dev/nvidiactl").exists()


class WarmPython:
    """One warm Python for one environment (see the module's docstring)."""

    def __init__(self, env: dict[str, str], cwd: Path, site: Path | None = None):
        first = [f"--site={site}"] if site is not None else []
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, *first, *PRELOADED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, cwd=cwd, bufsize=0,
        )
        self.lock = threading.Lock()
        self.started = False
        self.pending = b""  # what was read past the last whole line

    def _line(self, deadline: float) -> str:
        """The warm Python's next line, waiting at most until ``deadline`` (time.monotonic).
        Read unbuffered, so that a line already read is never left waiting behind select."""
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            readable, _, _ = select.select([self.process.stdout], [], [], left)
            if readable:
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"the warm Python exited ({self.process.wait()})")
                self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def run(self, code: str, timeout: float) -> subprocess.CompletedProcess:
        """``code`` in a fresh fork; like ``subprocess.run([python, "-c", code], ...)``."""
        with self.lock, tempfile.TemporaryDirectory(prefix="warm-python-") as work:
            deadline = time.monotonic() + timeout
            if not self.started:
                if self._line(deadline).strip() != "ready":
                    raise RuntimeError("the warm Python did not start")
                self.started = True
            out, err = Path(work) / "stdout", Path(work) / "stderr"
            self.process.stdin.write((json.dumps({"code": code, "stdout": str(out), "stderr": str(err)}) + "\n").encode())
            pid = json.loads(self._line(deadline))["pid"]
            try:
                returncode = json.loads(self._line(deadline))["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._line(time.monotonic() + 60)  # its exit status: the warm Python is free again
                raise subprocess.TimeoutExpired([sys.executable, "-c", code], timeout,
                                                output=out.read_text(errors="replace"),
                                                stderr=err.read_text(errors="replace")) from None
            return subprocess.CompletedProcess(
                [sys.executable, "-c", code], returncode, out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_WARM: dict[tuple, WarmPython] = {}
_WARM_LOCK = threading.Lock()


def warm_python(env: dict[str, str], cwd: Path, site: Path | None = None) -> WarmPython:
    """The warm Python for ``env`` and ``cwd`` (and the site directory ``site`` added first, where
    given), started on first use, kept for the session (pytest's PYTEST_CURRENT_TEST, different in
    every test, is left out)."""
    env = {name: value for name, value in env.items() if name != "PYTEST_CURRENT_TEST"}
    key = (str(cwd), str(site), tuple(sorted(env.items())))
    with _WARM_LOCK:
        if key not in _WARM or _WARM[key].process.poll() is not None:
            _WARM[key] = WarmPython(env, cwd, site)
        return _WARM[key]


def stop_all() -> None:
    """Ends every warm Python (each also ends by itself when the session's pipes close)."""
    with _WARM_LOCK:
        for warm in _WARM.values():
            warm.stop()
        _WARM.clear()
