"""`qwen38 docs`: regenerate what the docs derive from the code (`entrypoint.generated_docs`),
or check that it has not drifted."""

from __future__ import annotations

import argparse

from core.errors import StackError
from entrypoint import generated_docs


def _cmd_docs(args: argparse.Namespace) -> int:
    targets = generated_docs.generated_targets()
    stale = generated_docs.stale_targets(targets)
    if args.check:
        if stale:
            raise StackError(f"generated docs are stale: {', '.join(p.name for p in stale)}; run `qwen38 docs`")
        print("generated docs are up to date")
        return 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(targets[path])
        print(f"updated {path.name}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "docs", help="regenerate .env.example, the settings and profiles tables and the Grafana dashboard"
    )
    parser.add_argument("--check", action="store_true", help="fail if they are stale instead of writing")
    parser.set_defaults(func=_cmd_docs)
