"""`qwen38 prepare`: the preparation steps, each a subcommand.

Each step's CLI module (`STEPS`) registers its subcommand with ``register(subparsers)``;
``qwen38 prepare --profile P`` (no step named) runs every step the profile still needs
(`prepare.pipeline`), but the drafter's where SPECULATION chooses a method that never reads
it (mtp, off: `entrypoint.resolve.reads_drafter`, verify's own test). Every one of these
commands records what it hashes and leaves it in verify's stat cache under CACHE_DIR when it
ends (`prepare.stat_cache_proofs`): the first `qwen38 serve` then verifies those files
without reading them again.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from core.artifact_lock import LOCK_PATH
from core.progress import say
from entrypoint.cli import download, draft_vocab, requantize
from prepare.stat_cache_proofs import leaving_proofs

STEPS = (download, requantize, draft_vocab)


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
    parser.add_argument(
        "--seed",
        dest="profile_seed",
        metavar="DIR",
        help="with --profile: take files already downloaded from here when their sha256 is the pinned one (a "
        "Hugging Face cache or a folder of files; default: MODELS_SEED_DIR)",
    )
    parser.add_argument("--lock", dest="profile_lock", default=None, help=argparse.SUPPRESS)
    steps = parser.add_subparsers(dest="step", metavar="STEP")
    for step_cli in STEPS:
        step_cli.register(steps)
    for step in dict.fromkeys(steps.choices.values()):
        if step.get_default("func") is not None:
            step.set_defaults(func=_leaving_proofs(step.get_default("func")))
    parser.set_defaults(func=_leaving_proofs(_cmd_prepare_profile))


def _cmd_prepare_profile(args: argparse.Namespace) -> int:
    # A whole profile: its file, the settings and the pipeline, which a named step never needs.
    from core import profiles
    from core.settings import load_settings  # (pydantic-settings: not at the parser's start)
    from entrypoint.resolve import unread_drafter  # (the resolver: only for a whole profile)
    from prepare.pipeline import HubAccess, prepare_profile  # (every step's code: only for a whole profile)

    settings = load_settings(profile=args.profile)
    profile = profiles.load_profile(settings.profile, settings.profiles_dir)
    skipped = unread_drafter(profile, settings.speculation)
    if skipped is not None:
        say(f"qwen38: prepare: drafter skipped: {skipped}")
    hub = HubAccess(
        endpoint=args.profile_endpoint,
        seed_dir=Path(args.profile_seed) if args.profile_seed else settings.models_seed_dir,
        allow_branch_head=settings.allow_branch_head,
    )
    done = prepare_profile(
        profile,
        settings.models_dir,
        lock_path=args.profile_lock or LOCK_PATH,
        hub=hub,
        recheck=args.profile_recheck,
        skip_slots=frozenset({"drafter"}) if skipped is not None else frozenset(),
    )
    if not done:
        say(f"profile {profile.name}: every model directory is prepared")
    for step in done:
        say(f"prepared {step.describe()}")
    return 0


def _leaving_proofs(command):
    """``command``, recording what it hashes; what that proves ends in the stat cache."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        with leaving_proofs(getattr(args, "profile", None)):
            return command(args)

    return run
