"""The CLI imports only the module of the command it runs (a module of `entrypoint.cli`, or
the bench package's `bench.commands`), and that table is complete."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from entrypoint.cli import COMMAND_MODULES, COMMANDS
from tests.conftest import REPO, clean_env


def test_every_command_is_registered_by_the_module_the_cli_imports_for_it():
    for module in COMMAND_MODULES:
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(subparsers)
        assert set(subparsers.choices) == {c for c, m in COMMANDS.items() if m == module}, module


def test_a_command_does_not_import_the_others():
    code = (
        "import sys; from entrypoint.cli import build_parser; build_parser('plan'); "
        "print(sorted(m for m in ('bench', 'entrypoint.validate', 'prepare.generate', 'httpx') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), cwd=REPO,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_the_container_healthcheck_imports_only_what_it_reads(tmp_path):
    """`qwen38 ready --quick` runs every few seconds in each container: the status file and
    /health, never the launch, the planner, verify, the preparation steps or an engine."""
    heavy = ("bench", "entrypoint.launch", "entrypoint.plan", "entrypoint.verify", "entrypoint.serve", "prepare",
             "torch", "vllm", "yaml", "entrypoint.cli.serve")
    code = (
        "import sys; from entrypoint.cli import main; code = main(['ready', '--quick', '--profile', 'cpu']); "
        f"print(code, sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_env(CACHE_DIR=str(tmp_path)), cwd=REPO, timeout=60, check=True)
    assert done.stdout.strip() == "2 []"  # no status file yet: refused, and nothing heavy imported
    assert "no readiness status yet" in done.stderr
