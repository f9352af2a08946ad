"""`qwen38 ready`: run the readiness gate (`entrypoint.ready`) against a deployment, or with
``--quick`` the container healthcheck."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from core.settings import load_serving
from entrypoint import ready
from entrypoint.client import StackClient


def _cmd_ready(args: argparse.Namespace) -> int:
    profile, settings, key = load_serving(args.profile)
    base_url = args.base_url or ready.base_url_for(settings)
    secret = key.get_secret_value() if key else None
    if args.quick:
        ready.healthcheck(profile, settings, base_url, secret)
        print("ready")
        return 0
    with StackClient(base_url, secret) as client:
        report = ready.run_gate(client, profile.served.base, profile.served.adapter, args.timeout)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        for check in report.checks:
            print(f"ok  {check}")
        print(f"ready: {base_url} in {report.seconds:.1f} s")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ready",
        help="run the readiness gate against a deployment",
        description="Prove a deployment is ready: /health, every model id listed, a greedy canary, "
        "and for LoRA profiles an adapter answer that differs from the base.",
    )
    parser.add_argument("--profile", help="profile whose ids to expect (default: the PROFILE setting)")
    parser.add_argument("--base-url", help="server URL (default: from HOST and PORT)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for /health")
    parser.add_argument("--quick", action="store_true", help="healthcheck: recorded gate result + /health")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=_cmd_ready)
