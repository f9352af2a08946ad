"""`qwen38 serve`: verify, plan, then run vLLM for a profile under a supervisor (`entrypoint.serve`)."""

from __future__ import annotations

import argparse

from entrypoint import serve


def _cmd_serve(args: argparse.Namespace) -> int:
    return serve.serve_profile(args.profile, ready_gate=not args.no_ready_gate)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="verify, plan, then run vLLM for a profile under a supervisor (readiness gate, bounded stop)",
        description="Run the start-up flow: verify the pinned artifacts, plan memory, render the "
        "invocation and run vLLM as a child this process supervises: it runs the readiness gate, "
        "stops the server if the gate fails, and on SIGTERM stops every engine process within "
        "the profile's drain plus a fixed margin.",
    )
    parser.add_argument("--profile", help="profile to serve (default: the PROFILE setting)")
    parser.add_argument("--no-ready-gate", action="store_true", help="do not run the readiness gate")
    parser.set_defaults(func=_cmd_serve)
