"""`qwen38`: one CLI for every step of the flow.

Each step module registers its own subcommands (``register(subparsers)``) and keeps heavy
imports (torch, vLLM) inside the functions that need them, so ``qwen38 --help`` and
``qwen38 render`` stay instant. Expected failures are `StackError`s: printed once as
``qwen38: <code>: <message>``, exit code non-zero, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import httpx

from entrypoint.errors import StackError

# The order is the order of the flow in DESIGN.md; `--help` lists them this way.
COMMAND_MODULES = (
    "entrypoint.settings",
    "entrypoint.profiles",
    "entrypoint.keys",
    "prepare.lock",
    "prepare.commands",
    "prepare.tiny",
    "prepare.generate",
    "prepare.adapter",
    "entrypoint.doctor",
    "entrypoint.toolchain",
    "entrypoint.patches",
    "entrypoint.verify",
    "entrypoint.plan",
    "entrypoint.launch",
    "entrypoint.ready",
    "entrypoint.status",
    "entrypoint.dashboard",
    "entrypoint.validate",
    "entrypoint.generated_docs",
    "entrypoint.images",
    "entrypoint.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen38",
        description="Serve Qwen3.8-27B with a pinned, patched vLLM 0.28.0.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except StackError as exc:
        print(f"qwen38: {exc.code}: {exc}", file=sys.stderr)
        return exc.exit_code
    except httpx.TransportError as exc:
        where = getattr(getattr(exc, "request", None), "url", "the server")
        print(f"qwen38: connection: cannot reach {where}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
