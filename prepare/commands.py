"""`qwen38 prepare`: the preparation steps, each a subcommand.

Each step module exposes ``register(subparsers)`` and is listed in `STEP_MODULES`;
``qwen38 prepare --profile P`` (no step named) runs every step the profile still needs.
"""

from __future__ import annotations

import argparse
import importlib

STEP_MODULES: tuple[str, ...] = ("prepare.download", "prepare.requantize", "prepare.draft_vocab")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prepare", help="download pinned artifacts and prepare model directories")
    parser.add_argument("--profile", help="prepare every model directory this profile serves")
    parser.add_argument(
        "--endpoint",
        dest="profile_endpoint",
        metavar="URL",
        help="hub endpoint for the downloads of --profile (default: HF_ENDPOINT or https://huggingface.co)",
    )
    parser.add_argument(
        "--recheck",
        dest="profile_recheck",
        action="store_true",
        help="with --profile: hash the directories already in place and fetch or rebuild whatever does not "
        "match its manifest (the repair `qwen38 verify` names)",
    )
    parser.add_argument("--lock", dest="profile_lock", default=None, help=argparse.SUPPRESS)
    steps = parser.add_subparsers(dest="step", metavar="STEP")
    for name in STEP_MODULES:
        importlib.import_module(name).register(steps)
    parser.set_defaults(func=_cmd_prepare_profile)


def _cmd_prepare_profile(args: argparse.Namespace) -> int:
    from entrypoint import profiles
    from entrypoint.settings import load_settings
    from prepare.artifact_lock import LOCK_PATH
    from prepare.pipeline import prepare_profile

    settings = load_settings(profile=args.profile)
    profile = profiles.load_profile(settings.profile, settings.profiles_dir)
    done = prepare_profile(
        profile,
        settings.models_dir,
        lock_path=args.profile_lock or LOCK_PATH,
        endpoint=args.profile_endpoint,
        recheck=args.profile_recheck,
    )
    if not done:
        print(f"profile {profile.name}: every model directory is prepared")
    for step in done:
        print(f"prepared {step.describe()}")
    return 0
