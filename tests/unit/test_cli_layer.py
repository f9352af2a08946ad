"""The command line is a layer of its own: argparse, ``register(subparsers)`` and the
``_cmd_*`` functions live in `entrypoint.cli` only; the domain modules of core/, prepare/
and entrypoint/ carry none of it. And ``qwen38 bench`` without the bench package (the
serving images leave it out) says so in one line, while ``qwen38 --help`` still works."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from entrypoint import cli
from tests.conftest import REPO, clean_env

DOMAIN_PACKAGES = ("core", "prepare", "entrypoint")
CLI_PACKAGE = REPO / "entrypoint" / "cli"
NO_BENCH = "import sys; sys.modules['bench'] = None; from entrypoint.cli import main; sys.exit(main(sys.argv[1:]))"


def _cli_parts(path: Path) -> list[str]:
    """What of a command line ``path`` holds: argparse imports, `register` and `_cmd_*` functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            found.append(f"{node.lineno}: import argparse")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "argparse":
            found.append(f"{node.lineno}: from argparse import ...")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            node.name == "register" or node.name.startswith("_cmd_")
        ):
            found.append(f"{node.lineno}: def {node.name}")
    return found


def test_no_domain_module_carries_the_command_line():
    offenders = [
        f"{path.relative_to(REPO)}:{part}"
        for package in DOMAIN_PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if not path.is_relative_to(CLI_PACKAGE)
        for part in _cli_parts(path)
    ]
    assert offenders == [], "move the command line into entrypoint/cli/"


def test_the_check_sees_each_kind_of_command_line(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import argparse\nfrom argparse import Namespace\n\n\ndef register(subparsers):\n    pass\n\n\n"
        "def _cmd_go(args):\n    pass\n\n\ndef registered():\n    pass\n"
    )
    assert _cli_parts(module) == ["1: import argparse", "2: from argparse import ...", "5: def register",
                                  "9: def _cmd_go"]


def test_every_command_module_of_entrypoint_is_in_the_cli_package():
    ours = [m for m in cli.COMMAND_MODULES if not m.startswith("bench.")]
    assert ours and all(m.startswith("entrypoint.cli.") for m in ours)
    assert cli.COMMANDS["bench"] == "bench.commands"


# ---- qwen38 bench without the bench package ----------------------------------------------


def test_bench_without_the_package_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench", None)  # what an image built without WITH_BENCH has
    assert cli.bench_installed() is False
    code = cli.main(["bench", "c1", "--base-url", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("qwen38: bench: the benchmarks are not in this install")
    assert "--build-arg WITH_BENCH=true" in err and "make setup" in err


def test_bench_help_without_the_package_fails_too(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench", None)
    assert cli.main(["bench", "--help"]) != 0
    assert capsys.readouterr().err.startswith("qwen38: bench: ")


def test_a_parser_built_without_the_package_still_lists_bench_and_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "bench", None)
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "serving", "--x"])
    with pytest.raises(cli.BenchError, match="not in this install"):
        args.func(args)


@pytest.mark.parametrize("argv", [["--help"], ["ready", "--help"], ["settings", "--help"]])
def test_help_works_without_the_bench_package(argv):
    done = subprocess.run([sys.executable, "-c", NO_BENCH, *argv], capture_output=True, text=True, env=clean_env(),
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: qwen38")
    if argv == ["--help"]:
        assert "bench" in done.stdout and "not in this install" in done.stdout


def test_bench_without_the_package_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-c", NO_BENCH, "bench", "c1"], capture_output=True, text=True,
                          env=clean_env(), cwd=REPO, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [f"qwen38: bench: {cli.BENCH_MISSING}"]
