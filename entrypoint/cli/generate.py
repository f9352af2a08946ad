"""`qwen38 tiny` and `qwen38 generate`: models of the real architectures and formats, from
nothing, at any size (`prepare.generate`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prepare import generate
from prepare.synthetic import PRESET_NAMES, VARIANTS


def _cmd_generate(args: argparse.Namespace) -> int:
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    result = generate.generate(args.out, args.size, seed=args.seed, only=only, workers=args.workers, layers=args.layers)
    summary = result.summary()
    for name, model in summary["models"].items():
        print(f"{name}: {model['path']} ({model['bytes'] / 1e9:.3f} GB, {model['seconds']:.1f} s)")
    print(f"generate: {summary['bytes'] / 1e9:.3f} GB in {summary['seconds']:.1f} s "
          f"({summary['throughput_mb_s']:.0f} MB/s)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    for name, path in generate.build_tiny_models(Path(args.out), seed=args.seed).items():
        print(f"{name}: {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    tiny = subparsers.add_parser(
        "tiny",
        help="generate the tiny models (target, drafters, directions, adapter) deterministically",
        description="Write tiny models of the real architectures under --out: target/, drafter/, drafter2/, "
        "directions/ and adapter/ (built by the adapter converter). Two runs with the same seed give "
        "byte-identical files (= qwen38 generate --size tiny).",
    )
    tiny.add_argument("--out", required=True, help="output directory (subdirectories are replaced)")
    tiny.add_argument("--seed", type=int, default=generate.DEFAULT_SEED)
    tiny.set_defaults(func=_cmd_tiny)
    parser = subparsers.add_parser(
        "generate",
        help="generate models of the real architectures and formats (tiny to full size), with manifests",
        description="Write generated models under --out: --size tiny is `qwen38 tiny`'s set; full writes "
        "Qwen3.8-27B-shaped W4A16 / GPTQ / NVFP4 / bf16 artifacts under their artifact keys (docs/prepare.md).",
    )
    parser.add_argument("--size", required=True, choices=PRESET_NAMES, help="preset (prepare/synthetic.py)")
    parser.add_argument("--out", required=True, help="output directory (each model's subdirectory is replaced)")
    parser.add_argument("--only", default=None, help=f"comma list of {', '.join([*VARIANTS, generate.DIRECTIONS])}")
    parser.add_argument("--seed", type=int, default=None, help="default: the tiny models' seed")
    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: every core)")
    parser.add_argument("--layers", type=int, default=None, help="target layers (a multiple of 4): a slice, to measure")
    parser.add_argument("--json", default=None, help="write the summary (bytes, seconds, throughput) here")
    parser.set_defaults(func=_cmd_generate)
