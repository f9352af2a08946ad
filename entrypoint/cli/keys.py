"""`qwen38 key init`: create the API key file once (`entrypoint.keys`), never print the key."""

from __future__ import annotations

import argparse
from pathlib import Path

from entrypoint import keys


def _cmd_key(args: argparse.Namespace) -> int:
    path = Path(args.file)
    created = keys.init_key_file(path)
    print(f"{'created' if created else 'kept'} API key file {path.absolute()} (set API_KEY_FILE={path})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("key", help="create the API key file (never printed)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="create a random key file unless one exists")
    default = keys.DEFAULT_KEY_FILE
    init.add_argument("--file", default=str(default), help=f"key file (default {default})")
    init.set_defaults(func=_cmd_key)
