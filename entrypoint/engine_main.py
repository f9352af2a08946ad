"""The engine process `qwen38 serve` starts: vLLM's OpenAI server, tied to its supervisor's life.

``python -m entrypoint.engine_main --config X`` asks the kernel to SIGKILL this process when
its parent (the supervisor) dies, and makes every process it forks ask the same of *its*
parent, then runs ``vllm.entrypoints.openai.api_server`` as ``__main__`` with the same
arguments. vLLM forks its engine core and workers (``VLLM_WORKER_MULTIPROC_METHOD=fork``, its
default): if the supervisor is killed with SIGKILL, the API server dies, then its engine
core, then the workers, instead of living on under PID 1 holding memory (a GPU's, on a GPU).
A child vLLM *spawns* instead (a fresh interpreter, e.g. once CUDA was initialised) does not
run the fork hook; the supervisor's process-group sweep and the next start's leftover check
(`entrypoint.lifecycle`) cover those.
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
_parent_at_fork: int | None = None


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (at once, if it already has)."""
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _before_fork() -> None:
    global _parent_at_fork
    _parent_at_fork = os.getpid()


def _after_fork_in_child() -> None:
    if _parent_at_fork is not None:
        die_with_parent(_parent_at_fork)


def main() -> None:
    supervisor = int(os.environ.get("QWEN38_SUPERVISOR_PID", os.getppid()))
    die_with_parent(supervisor)
    # The supervisor's "stop admitting" signal is handled once the app runs (entrypoint.drain);
    # until then (loading, compiling) it must not end the process: SIGUSR1 would, by default.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    sys.argv = [ENGINE_MODULE, *sys.argv[1:]]
    runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
