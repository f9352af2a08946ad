"""The engine process's hold (entrypoint/engine_main.py): what it imports before its word,
and what becomes of what it printed meanwhile. The supervisor's side (prestart, abandon,
run) is in tests/unit/test_lifecycle.py; every `qwen38 serve` in the integration tests
starts its engine held."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from entrypoint.engine_main import ENGINE_MODULE, top_level_imports
from tests.conftest import REPO


def test_top_level_imports_are_the_unconditional_absolute_ones_in_order(tmp_path):
    (tmp_path / "probe_module.py").write_text(textwrap.dedent(
        """
        import json, os.path
        from collections import abc
        from . import sibling
        if json:
            import csv
        try:
            import zlib
        except ImportError:
            pass
        def later():
            import gzip
        from json import loads
        """
    ))  # fmt: skip
    sys.path.insert(0, str(tmp_path))
    try:
        assert top_level_imports("probe_module") == ["json", "os.path", "collections"]
    finally:
        sys.path.remove(str(tmp_path))


def test_the_api_servers_imports_are_vllm_not_the_server_module_itself():
    names = top_level_imports(ENGINE_MODULE)
    assert {"vllm.engine.arg_utils", "vllm.entrypoints.openai.cli_args", "vllm.config"} <= set(names)
    assert ENGINE_MODULE not in names


# A held process: imports a module that prints on both streams, then reads its word.
HOLDER = textwrap.dedent(
    """
    import os, sys
    from entrypoint.engine_main import hold
    read_end, write_end = os.pipe()
    if sys.argv[1] == "go":
        os.write(write_end, b"1")
    os.close(write_end)  # "refuse": end of file, no word
    print("go" if hold(read_end, ["noisy_import"]) else "refused", flush=True)
    """
)


def _hold(tmp_path, word: str, module_text: str) -> subprocess.CompletedProcess:
    (tmp_path / "noisy_import.py").write_text(module_text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    return subprocess.run([sys.executable, "-c", HOLDER, word], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


NOISY = "import sys\nprint('import log')\nprint('import warning', file=sys.stderr)\n"


def test_what_the_imports_printed_comes_out_after_the_word_on_its_own_stream(tmp_path):
    held = _hold(tmp_path, "go", NOISY)
    assert (held.returncode, held.stdout, held.stderr) == (0, "import log\ngo\n", "import warning\n")


def test_a_refused_start_drops_what_the_imports_printed(tmp_path):
    held = _hold(tmp_path, "refuse", NOISY)
    assert (held.returncode, held.stdout, held.stderr) == (0, "refused\n", "")


def test_an_import_that_fails_while_held_still_shows_why(tmp_path):
    held = _hold(tmp_path, "go", NOISY + "raise ImportError('no vLLM here')\n")
    assert held.returncode == 1 and held.stdout == "import log\n"
    assert "import warning" in held.stderr and "ImportError: no vLLM here" in held.stderr
