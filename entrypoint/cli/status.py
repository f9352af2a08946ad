"""`qwen38 status`: how a running server is doing (`entrypoint.status`), once or ``--watch``ed."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import asdict

import httpx

from entrypoint import status
from entrypoint.client import StackClient


def _cmd_status(args: argparse.Namespace) -> int:
    # the settings and the gate's module only once the command runs: its parser stays light
    from core.settings import load_serving
    from entrypoint.ready import base_url_for  # (the gate's module: only once the command runs)

    profile, settings, key = load_serving(args.profile)
    base_url = args.base_url or base_url_for(settings)
    secret = key.get_secret_value() if key else None
    with StackClient(base_url, secret, timeout=httpx.Timeout(10.0)) as client:
        summary, previous = status.collect(client, args.interval, settings, profile.name)
        if not args.watch:
            print(json.dumps(asdict(summary), indent=2) if args.json else status.format_status(summary, time.time()))
            return 0
        # Ctrl-C only sets a flag, read between refreshes: a KeyboardInterrupt raised inside
        # an HTTP request can leave httpx's connection pool locked, and the exit then hangs.
        stop = threading.Event()
        previous_handler = signal.signal(signal.SIGINT, lambda *_: stop.set())
        try:
            while not stop.is_set():
                if args.json:
                    print(json.dumps(asdict(summary)), flush=True)
                else:
                    stamp = time.strftime("%H:%M:%S")
                    sys.stdout.write("\x1b[H\x1b[2J" if sys.stdout.isatty() else "")
                    print(f"qwen38 status ({stamp}, every {args.interval:g} s; Ctrl-C ends)")
                    print(status.format_status(summary, time.time()), flush=True)
                if stop.wait(args.interval):
                    break
                summary, previous = status.collect(client, args.interval, settings, profile.name, previous)
        finally:
            signal.signal(signal.SIGINT, previous_handler)
        return 0


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: give 0.1 to 3600 seconds")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="ids, tok/s, queue, KV use, acceptance, uptime and the last canary of a running server",
        description="Read a running server's /metrics (with the API key) and its start's status file, and print "
        "the few figures that say how it is doing; --watch refreshes them.",
    )
    parser.add_argument("--profile", help="profile of the server (default: the PROFILE setting)")
    parser.add_argument("--base-url", help="server URL (default: from HOST and PORT)")
    parser.add_argument("--interval", type=_seconds, default=2.0, help="seconds between the two reads of a rate")
    parser.add_argument("--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="the figures as JSON (one object per refresh)")
    parser.set_defaults(func=_cmd_status)
