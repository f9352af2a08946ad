"""`qwen38`: one CLI for every step of the flow.

Each step module registers its own subcommands (``register(subparsers)``) and keeps heavy
imports (torch, vLLM) inside the functions that need them. A command imports only the
module that registers it (`COMMANDS`), so ``qwen38 render`` or a cached ``qwen38 plan``
stay well under a second; ``--help`` imports them all. Expected failures are
`StackError`s: printed once as ``qwen38: <code>: <message>``, exit code non-zero, no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from core.errors import StackError

# Command -> the module that registers it. The order is the order of the flow in
# DESIGN.md; `--help` lists them this way.
COMMANDS = {
    "settings": "core.settings",
    "profiles": "core.profiles",
    "key": "entrypoint.keys",
    "lock": "prepare.lock",
    "prepare": "prepare.commands",
    "tiny": "prepare.generate",
    "generate": "prepare.generate",
    "adapter": "prepare.adapter",
    "doctor": "entrypoint.doctor",
    "toolchain": "entrypoint.toolchain",
    "patches": "entrypoint.patches",
    "verify": "entrypoint.verify",
    "plan": "entrypoint.plan",
    "render": "entrypoint.launch",
    "serve": "entrypoint.serve",
    "ready": "entrypoint.ready",
    "status": "entrypoint.status",
    "dashboard": "entrypoint.dashboard",
    "validate": "entrypoint.validate",
    "docs": "entrypoint.generated_docs",
    "image": "entrypoint.images",
    "bench": "bench",
}
COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: with ``command``, only the module that registers it is imported."""
    parser = argparse.ArgumentParser(
        prog="qwen38",
        description="Serve Qwen3.8-27B with a pinned, patched vLLM 0.28.0.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in [COMMANDS[command]] if command in COMMANDS else COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _connection_error(exc: Exception) -> bool:
    httpx = sys.modules.get("httpx")  # only a command that talked to a server imported it
    return httpx is not None and isinstance(exc, httpx.TransportError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except StackError as exc:
        print(f"qwen38: {exc.code}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _connection_error(exc):
            raise
        where = getattr(getattr(exc, "request", None), "url", "the server")
        print(f"qwen38: connection: cannot reach {where}: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
