"""`qwen38 verify`: prove every file a profile serves matches its manifest and the lock
(`entrypoint.verify`)."""

from __future__ import annotations

import argparse
import json

from core.hashing import available_cores
from entrypoint import verify


def _print_report(report: verify.VerifyReport) -> None:
    for d in report.dirs:
        print(
            f"ok  {d.slot:8} {d.dir}  {d.files} files, {d.bytes / 1e9:.2f} GB "
            f"({d.hashed} hashed, {d.trusted} unchanged since last hashed)  {d.identity}"
        )
    engine = report.engine
    if engine is not None:
        print(f"ok  vllm     {engine.distribution} {engine.version}; patches {engine.patches.status}")
    print(f"identity {report.identity}")
    print(f"verified in {report.elapsed_s:.2f} s; status in {report.status_path}")


def _cmd_verify(args: argparse.Namespace) -> int:
    # the settings and the profiles only once verify runs, as before: its parser stays light
    from core import profiles
    from core.settings import load_settings  # (pydantic-settings: only once verify runs)
    from entrypoint.resolve import reads_drafter  # (which slots SPECULATION reads)

    settings = load_settings(profile=args.profile)
    profile = profiles.load_profile(settings.profile, settings.profiles_dir)
    try:
        report = verify.verify_profile(profile, settings, full=args.full, jobs=args.jobs, lock_path=args.lock,
                                       reads_drafter=reads_drafter(profile, settings.speculation))
    except verify.VerifyFailed as exc:
        if args.json:
            print(json.dumps(exc.report.to_dict(), indent=2, default=str))
        raise
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _print_report(report)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="prove every file the profile serves matches its manifest and the lock (run before launch)",
        description="Verify the profile's model directories (manifest, identity against the lock, "
        "sha256 of every file, trusted from the stat cache while unchanged), the vLLM version and "
        "the delivered patches; write the served identity to CACHE_DIR/verify/status.json.",
    )
    parser.add_argument("--profile", help="profile to verify (default: PROFILE from the settings)")
    parser.add_argument("--full", action="store_true", help="re-hash every file, ignoring the stat cache")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument(
        "--jobs", type=int, default=None, help=f"files hashed in parallel (default: cores, here {available_cores()})"
    )
    parser.add_argument("--lock", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=_cmd_verify)
