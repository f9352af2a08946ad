"""`qwen38 prepare download`: fetch pinned artifacts, prove them, then write their manifest
(`prepare.download`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.artifact_lock import LOCK_PATH, effective_lock, load_lock
from core.errors import DownloadError
from prepare import download


def _cmd_download(args: argparse.Namespace) -> int:
    # the settings and the pins' code only when a download runs: `qwen38 prepare`'s parser stays light
    from core.settings import load_settings
    from prepare.pinning import check_pinnable, pin_at_first_use  # (the hub client: only for a download)

    lock_path = Path(args.lock)
    settings = load_settings(profile=args.profile)
    models_dir = Path(settings.models_dir)
    lock = effective_lock(load_lock(lock_path), models_dir)
    targets = download.resolve_targets(args.profile, args.artifacts, lock, lock_path, settings.profiles_dir)
    source = Path(args.source) if args.source else None
    if source is not None:
        local = [t for t in targets if lock.get(t.artifact).source == "local"]
        if len(local) != 1:
            raise DownloadError("--from names the file of exactly one user-supplied artifact; name that one")
    # Check every pin before fetching anything: fail in the first second, not after 20 GB.
    for target in targets:
        check_pinnable(lock.get(target.artifact), lock_path, allow_branch_head=settings.allow_branch_head)
    seed_dir = Path(args.seed) if args.seed else settings.models_seed_dir
    for target in targets:
        artifact = pin_at_first_use(
            lock.get(target.artifact),
            models_dir,
            allow_branch_head=settings.allow_branch_head,
            endpoint=args.endpoint,
            lock_path=lock_path,
        )
        download.download_artifact(
            artifact,
            models_dir / target.dir,
            endpoint=args.endpoint,
            source=source if artifact.source == "local" else None,
            seed_dir=seed_dir,
            prune=args.prune,
            recheck=args.recheck,
            jobs=args.jobs,
            lock_path=lock_path,
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "download",
        help="download pinned artifacts, verify their sha256 and write their manifests",
        description="Download the pinned revision of each ARTIFACT (or of every downloaded slot "
        "of --profile P) into MODELS_DIR, resumably, verifying each file's sha256 before it is "
        "moved into place, then write the directory's manifest. Artifacts named here land in "
        "MODELS_DIR/<artifact key>.",
    )
    parser.add_argument("artifacts", nargs="*", metavar="ARTIFACT", help="artifact keys of the lock")
    parser.add_argument("--profile", help="download every artifact slot of this profile")
    parser.add_argument("--from", dest="source", metavar="PATH", help="copy a user-supplied artifact from here")
    parser.add_argument("--endpoint", help="hub endpoint (default: HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument(
        "--seed",
        metavar="DIR",
        help="take files already downloaded from here when their sha256 is the pinned one: a Hugging Face "
        "cache or a folder of files (default: MODELS_SEED_DIR)",
    )
    parser.add_argument("--prune", action="store_true", help="delete files in the directory the lock does not list")
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="hash the files already in place even when the manifest says the directory is up to date, "
        "and fetch again whatever does not match",
    )
    parser.add_argument("--jobs", type=int, default=None, help="files hashed in parallel (default: cores)")
    parser.add_argument("--lock", default=str(LOCK_PATH), help=argparse.SUPPRESS)
    parser.set_defaults(func=_cmd_download)
