"""`qwen38 doctor`: is this machine ready for a profile (`entrypoint.doctor`)? One line per check."""

from __future__ import annotations

import argparse

from core.errors import StackError
from entrypoint import doctor


def _cmd_doctor(args: argparse.Namespace) -> int:
    # the settings and the resolver only once the checks run: the parser stays as light as doctor's own imports
    from core.settings import load_settings, load_settings_profile
    from entrypoint.resolve import resolve_on_this_host  # (the resolver: only once the checks run)

    settings = load_settings(profile=args.profile)
    profile = load_settings_profile(settings)
    resolved = resolve_on_this_host(profile, settings)
    findings = doctor.diagnose(
        profile,
        resolved,
        cache_dir=settings.cache_dir,
        weights_bytes=doctor.weights_size(settings, profile, reads_drafter=resolved.reads_drafter),
    )
    for finding in findings:
        print(finding.line())
    blockers = [f for f in findings if f.level == "blocker"]
    if blockers and not args.warn_only:
        raise StackError(f"{len(blockers)} blocker(s) for profile {profile.name}: {blockers[0].detail}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this machine for a profile (GPU, driver, CUDA, memory, other processes, JIT toolchain, cache)",
    )
    parser.add_argument("--profile", help="profile to check for (default: the PROFILE setting)")
    parser.add_argument("--warn-only", action="store_true", help="report blockers without failing (image start)")
    parser.set_defaults(func=_cmd_doctor)
