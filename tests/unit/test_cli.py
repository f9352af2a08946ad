"""The CLI imports only the module of the command it runs, and that table is complete."""

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
