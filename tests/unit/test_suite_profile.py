"""tests/support/suite_profile.py: the vLLM import log a suite run leaves, and the CPU's idle share."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from tests.support import suite_profile


def test_a_hooked_venv_logs_each_python_that_imports_vllm_and_unhook_removes_it(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    stand_in = tmp_path / "pkgs" / "vllm"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("")
    log = tmp_path / "imports.log"
    suite_profile.hook(env_dir, log)
    python = str(env_dir / "bin" / "python")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkgs"), "PYTEST_CURRENT_TEST": "tests/x.py::t (call)"}
    for code in ("import vllm; import vllm", "import json", "import vllm"):
        subprocess.run([python, "-c", code], env=env, check=True)
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    assert len(rows) == 2 and all(row[3] == "tests/x.py::t (call)" and row[4] == "-c" for row in rows)
    assert suite_profile.imports(log).splitlines()[:4] == [
        "2 Pythons imported vLLM", "", "by kind:", "    2  python -c (a script against a view)"]
    suite_profile.unhook(env_dir)
    subprocess.run([python, "-c", "import vllm"], env=env, check=True)
    assert len(log.read_text().splitlines()) == 2


def test_idle_averages_vmstats_idle_column_between_two_times(tmp_path):
    vmstat = tmp_path / "vmstat.log"
    vmstat.write_text(
        "procs -----------memory---------- ---swap-- -----io---- -system-- ------cpu----- -----timestamp-----\n"
        " r  b   swpd   free   buff  cache   si   so    bi    bo   in   cs us sy id wa st                 UTC\n"
        " 2  0      0 100 1 1 0 0 0 0 1 1 50 10 40 0 0 2026-12-03 16:10:55\n"
        " 2  0      0 100 1 1 0 0 0 0 1 1 50 10 20 0 0 2026-12-03 16:11:00\n"
        " 2  0      0 100 1 1 0 0 0 0 1 1 50 10 60 0 0 2026-12-03 16:11:05\n"
        " 2  0      0 100 1 1 0 0 0 0 1 1 0 0 100 0 0 2026-12-03 16:12:00\n"
    )
    out = suite_profile.idle(vmstat, "16:11:00", "16:11:59").splitlines()
    assert out == ["idle 40.0 % on average over 2 samples", "  16:11   40.0 %"]


def test_the_command_line_names_a_missing_venv(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tests.support.suite_profile", "hook", str(tmp_path), "x.log"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1
    assert done.stderr.strip() == f"no site-packages under {tmp_path}: give the venv's directory (e.g. .venv)"
