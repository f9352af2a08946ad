"""`qwen38`: one CLI for every step of the flow.

The command line is a layer of its own: each module of this package registers the
subcommands of one topic (``register(subparsers)``) and carries their ``_cmd_*`` functions,
which parse nothing themselves and call the domain modules (core/, prepare/, entrypoint/);
those carry no argparse. Heavy imports (torch, vLLM) stay inside the functions that need
them. A command imports only the module that registers it (`COMMANDS`), so ``qwen38 render``
or a cached ``qwen38 plan`` stay well under a second; ``--help`` imports them all. Expected
failures are `StackError`s: printed once as ``qwen38: <code>: <message>``, exit code
non-zero, no traceback.

``qwen38 bench`` is registered by the ``bench`` package, which the serving images leave out
(built with ``--build-arg WITH_BENCH=true`` they carry it): without it the command says so
in one line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from core.errors import BenchError, StackError

# Command -> the module that registers it. The order is the order of the flow in
# docs/architecture.md; `--help` lists them this way.
COMMANDS = {
    "settings": "entrypoint.cli.settings",
    "profiles": "entrypoint.cli.profiles",
    "key": "entrypoint.cli.keys",
    "lock": "entrypoint.cli.lock",
    "prepare": "entrypoint.cli.prepare",
    "tiny": "entrypoint.cli.generate",
    "generate": "entrypoint.cli.generate",
    "adapter": "entrypoint.cli.adapter",
    "doctor": "entrypoint.cli.doctor",
    "toolchain": "entrypoint.cli.toolchain",
    "patches": "entrypoint.cli.patches",
    "verify": "entrypoint.cli.verify",
    "plan": "entrypoint.cli.plan",
    "render": "entrypoint.cli.render",
    "serve": "entrypoint.cli.serve",
    "ready": "entrypoint.cli.ready",
    "status": "entrypoint.cli.status",
    "dashboard": "entrypoint.cli.dashboard",
    "validate": "entrypoint.cli.validate",
    "docs": "entrypoint.cli.docs",
    "image": "entrypoint.cli.images",
    "bench": "bench.commands",
}
COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))
BENCH_PACKAGE = "bench"
BENCH_MISSING = (
    "the benchmarks are not in this install (the serving images leave the bench package out): build the "
    "image with `--build-arg WITH_BENCH=true`, or run them from a checkout after `make setup`"
)


def bench_installed() -> bool:
    """Whether the ``bench`` package (`qwen38 bench`) can be imported here."""
    return importlib.util.find_spec(BENCH_PACKAGE) is not None


def _bench_missing(args: argparse.Namespace) -> int:
    raise BenchError(BENCH_MISSING)


def _register_missing_bench(subparsers: argparse._SubParsersAction) -> None:
    """`qwen38 bench` where the package is not installed: listed by ``--help``, and says why it cannot run."""
    parser = subparsers.add_parser("bench", help="run a benchmark (not in this install)", add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=_bench_missing)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: with ``command``, only the module that registers it is imported."""
    parser = argparse.ArgumentParser(
        prog="qwen38",
        description="Serve Qwen3.8-27B with a pinned, patched vLLM 0.28.0.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in [COMMANDS[command]] if command in COMMANDS else COMMAND_MODULES:
        if name == COMMANDS["bench"] and not bench_installed():
            _register_missing_bench(subparsers)
            continue
        importlib.import_module(name).register(subparsers)
    return parser


def _connection_error(exc: Exception) -> bool:
    httpx = sys.modules.get("httpx")  # only a command that talked to a server imported it
    return httpx is not None and isinstance(exc, httpx.TransportError)


def _failed(exc: StackError) -> int:
    print(f"qwen38: {exc.code}: {exc}", file=sys.stderr)
    return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    if command == "bench" and not bench_installed():
        return _failed(BenchError(BENCH_MISSING))
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except StackError as exc:
        return _failed(exc)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _connection_error(exc):
            raise
        where = getattr(getattr(exc, "request", None), "url", "the server")
        print(f"qwen38: connection: cannot reach {where}: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)
