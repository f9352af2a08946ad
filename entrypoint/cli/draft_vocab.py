"""`qwen38 prepare draft-vocab`: the reduced output vocabulary of the MTP draft head
(`prepare.draft_vocab`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from prepare import draft_vocab


def _cmd_draft_vocab(args: argparse.Namespace) -> int:
    result = draft_vocab.build_draft_vocab(
        args.model, args.out, ids_file=args.ids, corpus=args.corpus or (), heldout=args.heldout or (), size=args.size
    )
    state = "is up to date; nothing to do" if result.up_to_date else "written"
    print(f"draft-vocab: {result.out} {state}: {result.size:,} of {result.target_vocab_size:,} tokens")
    cov = result.coverage
    if "corpus" in cov:
        print(f"draft-vocab: corpus coverage {cov['corpus']:.2%} of {cov['corpus_tokens']:,} tokens")
    if "heldout" in cov:
        print(f"draft-vocab: held-out coverage {cov['heldout']:.2%} of {cov['heldout_tokens']:,} tokens")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "draft-vocab",
        help="reduced draft vocabulary for the MTP speculator (pinned ids or counted over a corpus)",
        description=draft_vocab.__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", required=True, type=Path, help="target model directory (config.json, tokenizer)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (built atomically)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ids", type=Path, help="pinned JSON list of token ids")
    source.add_argument("--corpus", type=Path, nargs="+", help="text / JSON Lines files to count tokens over")
    parser.add_argument("--heldout", type=Path, nargs="+", help="held-out text for the coverage report")
    parser.add_argument(
        "--size", type=int, default=None, help=f"ids to keep from a corpus (default {draft_vocab.DEFAULT_SIZE})"
    )
    parser.set_defaults(func=_cmd_draft_vocab)
