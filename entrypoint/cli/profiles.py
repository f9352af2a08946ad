"""`qwen38 profiles`: list the profiles, or print the README's profile table."""

from __future__ import annotations

import argparse

from core import profiles


def _cmd_profiles(args: argparse.Namespace) -> int:
    if args.action == "table":
        print(profiles.render_profiles_table(), end="")
    else:
        for name in profiles.profile_names():
            print(f"{name}: {profiles.load_profile(name).description}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profiles", help="list the profiles, or print the README profile table")
    parser.add_argument("action", nargs="?", choices=["list", "table"], default="list")
    parser.set_defaults(func=_cmd_profiles)
