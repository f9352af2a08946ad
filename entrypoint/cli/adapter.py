"""`qwen38 adapter`: build or check the rank-1 LoRA adapter of the spark-lora profile (`prepare.adapter`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from prepare import adapter


def _cmd_build(args: argparse.Namespace) -> int:
    record = adapter.build_adapter(
        args.model, args.directions, args.out, force=args.force, row_chunk=args.row_chunk, progress=True
    )
    counts = ", ".join(f"{n} {fmt}" for fmt, n in sorted(record["formats"].items()))
    print(
        f"adapter: {args.out}: {record['directions']['modules']} modules ({counts}), "
        f"{record['adapter']['size'] / (1 << 20):.1f} MiB, sha256 {record['adapter']['sha256']}"
    )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    derived = adapter.verify_adapter_binding(args.adapter, args.model)
    print(f"adapter: {args.adapter}: {derived.describe()}, built from {args.model} as it is now")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("adapter", help="build or check the rank-1 LoRA adapter (spark-lora)")
    sub = parser.add_subparsers(dest="adapter_command", metavar="ACTION", required=True)

    build = sub.add_parser(
        "build",
        help="turn a directions file into a rank-1 PEFT LoRA for a base model",
        description="B = -c r, A = r^T W for every residual-writing module (docs/adapter.md).",
    )
    build.add_argument("--model", required=True, type=Path, help="base model directory (as stored: NVFP4/FP8/BF16)")
    build.add_argument(
        "--directions",
        required=True,
        type=Path,
        help="directions file (safetensors, docs/adapter.md) in its imported directory, or that directory",
    )
    build.add_argument("--out", required=True, type=Path, help="adapter directory to create")
    build.add_argument("--force", action="store_true", help="replace a non-empty --out")
    build.add_argument(
        "--row-chunk",
        type=int,
        default=adapter.DEFAULT_ROW_CHUNK,
        help=f"weight rows decoded at a time (default {adapter.DEFAULT_ROW_CHUNK})",
    )
    build.set_defaults(func=_cmd_build)

    verify = sub.add_parser(
        "verify",
        help="check that an adapter was built from this base directory as it is now (manifests only)",
        description="Compare the adapter's recorded `model` input with the base's manifest (identity and "
        "digest); `qwen38 verify` checks the files of both against their manifests and the lock.",
    )
    verify.add_argument("--adapter", required=True, type=Path, help="adapter directory")
    verify.add_argument("--model", required=True, type=Path, help="base model directory served with it")
    verify.set_defaults(func=_cmd_verify)
