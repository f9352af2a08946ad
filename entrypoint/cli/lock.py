"""`qwen38 lock`: pin artifacts in ``profiles/artifacts.lock.toml`` (`core.artifact_lock`,
`prepare.pinning`), and the images' package locks (`prepare.dependency_lock`).

- ``qwen38 lock update KEY`` asks the hub (through huggingface_hub) for every file of the
  artifact's repo at its pinned revision and writes each file's size and sha256: the LFS
  sha256 the hub publishes, or, for small files kept in git, the sha256 of the bytes
  fetched at that commit (checked against the git blob id the hub lists).
  ``--revision REV`` pins a new revision first (a branch or tag is resolved to its commit).
- ``qwen38 lock update KEY --from PATH`` pins a ``local`` artifact (user-supplied, no repo)
  by hashing the user's own file or directory.
- ``qwen38 lock show`` (or ``status``) lists every artifact, where its pin came from (the
  repository lock, this machine's first use, the owner's ALLOW_BRANCH_HEAD) and what is
  still unpinned.

- ``qwen38 lock deps`` regenerates the images' hash-pinned Python package locks under
  ``docker/lock/`` (uv's cross-platform resolver) and their wheel listings;
  ``--check`` proves, offline, that every locked requirement has a wheel for its image's
  platform; ``--check-online`` asks the package indexes again (see
  `prepare.dependency_lock`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core.artifact_lock import LOCK_PATH, effective_lock, load_lock, local_lock_path, write_lock
from core.errors import ArtifactError, DependencyLockError
from prepare.pinning import describe_change, pin_hub_artifact, pin_local_artifact


def _cmd_update(args: argparse.Namespace) -> int:
    lock_path = Path(args.lock)
    lock = load_lock(lock_path)
    artifact = lock.get(args.artifact, lock_path)
    if args.source is not None:
        if args.revision is not None:
            raise ArtifactError("--from and --revision exclude each other")
        new = pin_local_artifact(artifact, Path(args.source))
    else:
        if artifact.source == "local":
            raise ArtifactError(
                f"artifact {artifact.key} is user-supplied: pin it with `{artifact.pin_command()}`"
            )
        if args.revision is not None and not args.revision.strip():
            raise ArtifactError("--revision is empty")
        new = pin_hub_artifact(artifact, revision=args.revision, endpoint=args.endpoint)
    write_lock(lock.with_artifact(new), lock_path)
    print(describe_change(artifact, new))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from core.settings import load_settings  # pydantic's settings only for `lock show`, not `lock update`

    lock_path = Path(args.lock)
    models_dir = Path(args.models_dir) if args.models_dir else Path(load_settings().models_dir)
    lock = effective_lock(load_lock(lock_path), models_dir)
    print(f"repository lock: {lock_path}")
    print(f"machine-local lock: {local_lock_path(models_dir)}")
    unpinned = 0
    for key in sorted(lock.artifacts):
        art = lock.artifacts[key]
        what = art.unpinned()
        where = f"{art.repo}@{art.revision}" if art.source == "hub" else "local"
        if what is None:
            print(f"pinned    {key}  {where}  {len(art.files)} files, {art.total_size / 1e9:.2f} GB; "
                  f"from: {art.provenance}")
        elif art.pinned_at_first_use:
            known = f" ({len(art.known)} file hashes known)" if art.known else ""
            print(f"at first use  {key}  {where}  the first prepare reads its files from the hub's listing of "
                  f"this commit{known}")
        else:
            unpinned += 1
            print(f"UNPINNED  {key}  {where}  {what}; pin with `{art.pin_command()}`")
    return 1 if (unpinned and args.strict) else 0


def _cmd_deps(args: argparse.Namespace) -> int:
    from prepare import dependency_lock as deps  # the package locks' code only for `lock deps`

    targets = [deps.get_target(name) for name in (args.target or list(deps.TARGETS))]
    if args.check or args.check_online:
        failed = 0
        for target in targets:
            lock_text, listing = deps.load_target_files(target)
            problems = deps.check_listing(target, lock_text, listing)
            if args.check_online and not problems:
                indexes = [deps.PYPI_SIMPLE, *target.extra_index_urls]
                cache = Path(args.cache_dir) if args.cache_dir else None
                with deps.IndexClient(indexes, [Path(p) for p in args.find_links or []], cache_dir=cache) as client:
                    problems = deps.verify_listing_online(listing, client.files_for)
            failed += bool(problems)
            for problem in problems:
                print(f"{target.name}: {problem}")
            if not problems:
                where = "published on the indexes" if args.check_online else "in the recorded listing"
                print(f"ok  {target.name}: {len(listing.requirements)} requirements, each with a "
                      f"{target.platform_tag} wheel {where} ({deps.download_bytes(listing) / 1e9:.2f} GB of wheels)")
        if failed:
            raise DependencyLockError(f"{failed} of {len(targets)} package locks failed the check (see above)")
        return 0
    uv = deps.find_uv(args.uv)
    for target in targets:
        path, listing = deps.regenerate(
            target,
            uv=uv,
            find_links=[Path(p) for p in args.find_links or []],
            extra_index=not args.no_extra_index,
            upgrade=args.upgrade,
        )
        wheels = sum(len(r["wheels"]) for r in listing.requirements.values())
        print(f"wrote {path.relative_to(deps.REPO)}: {len(listing.requirements)} requirements, "
              f"{wheels} {target.platform_tag} wheels listed")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lock",
        help="pin artifacts (HF repo, revision, per-file sha256) in profiles/artifacts.lock.toml",
        description="Pin artifacts in the artifact lock.",
    )
    actions = parser.add_subparsers(dest="lock_action", metavar="ACTION", required=True)

    update = actions.add_parser(
        "update",
        help="fill an artifact's file sizes and sha256 from the hub (or from a local file)",
        description="Fill ARTIFACT's file sizes and sha256 for its pinned revision from the hub "
        "(endpoint: HF_ENDPOINT or --endpoint), or from --from PATH for a user-supplied artifact.",
    )
    update.add_argument("artifact", metavar="ARTIFACT", help="artifact key in the lock")
    update.add_argument("--revision", help="pin this revision first (commit, branch or tag; stored as a commit)")
    update.add_argument("--from", dest="source", metavar="PATH", help="pin a local artifact from this file/dir")
    update.add_argument("--endpoint", help="hub endpoint (default: HF_ENDPOINT or https://huggingface.co)")
    update.add_argument("--lock", default=str(LOCK_PATH), help=argparse.SUPPRESS)
    update.set_defaults(func=_cmd_update)

    for name in ("show", "status"):
        show = actions.add_parser(
            name,
            help="list every artifact, its pin and where the pin came from"
            + (" (the same as `show`)" if name == "status" else ""),
            description="List every artifact with its revision, files and where its pin came from: the "
            "repository lock, this machine's first use (MODELS_DIR/artifacts.local.toml) or the owner's "
            "ALLOW_BRANCH_HEAD; and what is still unpinned, with the command that pins it.",
        )
        show.add_argument("--strict", action="store_true", help="exit 1 when anything is unpinned")
        show.add_argument("--models-dir", help="whose machine-local lock to read (default: MODELS_DIR)")
        show.add_argument("--lock", default=str(LOCK_PATH), help=argparse.SUPPRESS)
        show.set_defaults(func=_cmd_show)

    deps = actions.add_parser(
        "deps",
        help="regenerate (or --check) the images' hash-pinned package locks in docker/lock/",
        description="Regenerate docker/lock/<target>.txt with `uv pip compile --generate-hashes` for each "
        "image platform (Python version, CPU architecture, glibc), then record which published wheels "
        "install there (<target>.wheels.json). --check proves offline that every locked requirement has "
        "a wheel for its platform; --check-online asks the package indexes again.",
    )
    deps.add_argument("--target", action="append", help="only this target (repeatable; default: all)")
    deps.add_argument("--check", action="store_true", help="offline: each lock agrees with its wheel listing")
    deps.add_argument("--check-online", action="store_true", help="also confirm every listed wheel is still published")
    deps.add_argument("--cache-dir", help="cache index pages here for --check-online (one day)")
    deps.add_argument("--upgrade", action="store_true", help="re-resolve everything instead of keeping current pins")
    deps.add_argument(
        "--find-links", action="append", metavar="DIR", help="also take wheels from this directory (repeatable)"
    )
    deps.add_argument(
        "--no-extra-index",
        action="store_true",
        help="skip a target's extra index (the PyTorch CPU index) when it cannot be reached; use --find-links",
    )
    deps.add_argument("--uv", help="the uv executable (default: uv on PATH or beside this Python)")
    deps.set_defaults(func=_cmd_deps)

