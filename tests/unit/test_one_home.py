"""Issue 54, one home per concept: guards that fail when a second copy of a concept appears."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("entrypoint", "prepare")


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_the_installed_vllm_directory_is_found_in_one_place():
    """`entrypoint.patches.find_vllm_dir` is the one finder of the installed vLLM package
    directory (find_spec, without importing vLLM; PatchError when absent): call it."""
    finder = re.compile(r"""submodule_search_locations|find_spec\(\s*["']vllm["']""")
    home = REPO / "entrypoint" / "patches.py"
    elsewhere = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _sources()
        if path != home
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if finder.search(line)
    ]
    assert not elsewhere, "locate vLLM with entrypoint.patches.find_vllm_dir, not again:\n" + "\n".join(elsewhere)
    assert len(re.findall(r"^def find_vllm_dir\(", home.read_text(encoding="utf-8"), re.M)) == 1
