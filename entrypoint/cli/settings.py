"""`qwen38 settings`: the effective settings (secrets masked), or the files generated from them."""

from __future__ import annotations

import argparse
import json

from core import settings


def _cmd_settings(args: argparse.Namespace) -> int:
    if args.action == "example":
        print(settings.render_env_example(), end="")
    elif args.action == "table":
        print(settings.render_settings_table(), end="")
    else:
        print(json.dumps(settings.masked(settings.load_settings()), indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "settings",
        help="show the effective settings, or generate .env.example / the settings table",
        description="Show the effective settings (secrets masked), or print the generated "
        ".env.example or the settings table (docs/settings.md).",
    )
    parser.add_argument("action", nargs="?", choices=["show", "example", "table"], default="show")
    parser.set_defaults(func=_cmd_settings)
