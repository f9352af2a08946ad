"""The engine process `qwen38 serve` starts: vLLM's OpenAI server, tied to its supervisor's life.

``python -m entrypoint.engine_main --config X`` asks the kernel to SIGKILL this process when
its parent (the supervisor) dies, keeps the supervisor's stop signal (SIGUSR1) from ending it
before the app handles it, then runs ``vllm.entrypoints.openai.api_server`` as ``__main__``
with the same arguments. The processes vLLM starts from here (its engine core and workers:
spawned on CPU, forked on CUDA) are ended by the supervisor's reaper when the supervisor dies
(`entrypoint.lifecycle.start_reaper`), and by its process-group sweep when this one does.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (at once, if it already has)."""
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    supervisor = int(os.environ.get("QWEN38_SUPERVISOR_PID", os.getppid()))
    die_with_parent(supervisor)
    # The supervisor's "stop admitting" signal is handled once the app runs (entrypoint.drain);
    # until then (loading, compiling) it must not end the process: SIGUSR1 would, by default.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sys.argv = [ENGINE_MODULE, *sys.argv[1:]]
    runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
