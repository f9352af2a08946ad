"""`qwen38 prepare requantize`: int8 embed_tokens / lm_head (/ MTP) (`prepare.requantize`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from prepare import requantize


def _cmd_requantize(args: argparse.Namespace) -> int:
    targets = requantize.parse_targets(args.only)
    result = requantize.requantize_checkpoint(
        args.model, args.out, targets, draft_vocab=args.draft_vocab, workers=args.workers, progress=True
    )
    if result.up_to_date:
        print(f"requantize: {result.dst} is up to date (same input, same options); nothing to do")
        return 0
    for report in result.tensors:
        rows, cols = report.shape
        print(
            f"requantize: {report.name} [{rows} x {cols}] -> int8 group {args.group_size}: "
            f"relative error {report.relative_error:.4%}, {report.seconds:.1f} s"
        )
    modes = sorted(set(result.placed.values()))
    print(
        f"requantize: wrote {result.dst} ({len(result.written)} files written, {len(result.placed)} "
        f"{'/'.join(modes) or 'linked'} from the input) in {result.seconds:.1f} s"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "requantize",
        help="int8 embed_tokens / lm_head (/ MTP) in the compressed-tensors pack-quantized layout",
        description=requantize.__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory to read (never modified)")
    parser.add_argument("--out", required=True, type=Path, help="prepared directory to write (built atomically)")
    parser.add_argument(
        "--only",
        default=",".join(requantize.DEFAULT_TARGETS),
        help=f"comma list of {', '.join(requantize.TARGETS)} (default: %(default)s)",
    )
    parser.add_argument("--draft-vocab", type=Path, default=None, help="a `prepare draft-vocab` output to include")
    parser.add_argument("--workers", type=int, default=None, help="quantization threads (default: CPUs, at most 4)")
    parser.set_defaults(func=_cmd_requantize, group_size=requantize.GROUP_SIZE)
