"""`qwen38 render`: print the exact vLLM invocation a profile renders to (`entrypoint.launch`),
secrets masked."""

from __future__ import annotations

import argparse
import json
import shlex

from core.settings import load_serving
from entrypoint import launch
from entrypoint.resolve import resolve_on_this_host


def _cmd_render(args: argparse.Namespace) -> int:
    profile, settings, key = load_serving(args.profile)
    invocation = launch.render_invocation(
        profile, settings, key, resolved=resolve_on_this_host(profile, settings)
    )
    public = invocation.public()
    if args.json:
        print(json.dumps(public, indent=2))
        return 0
    print("# command")
    print(shlex.join(public["argv"]))
    print("# environment")
    for name, value in public["env"].items():
        print(f"{name}={value}")
    print(f"# {public['config_path']}")
    print(invocation.config_yaml(), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    render = subparsers.add_parser(
        "render",
        help="print the exact vLLM invocation a profile renders to (secrets masked)",
        description="Print the argv, the environment and the --config YAML `qwen38 serve` would run.",
    )
    render.add_argument("--profile", help="profile to render (default: the PROFILE setting)")
    render.add_argument("--json", action="store_true", help="one JSON object: argv, env, config")
    render.set_defaults(func=_cmd_render)
