"""The import graph of our own packages, read from the source (nothing is imported).

Every ``import`` and ``from ... import`` counts, absolute or relative, including those
inside functions and under ``if TYPE_CHECKING:``: a deferred import still makes two modules
depend on each other, it only hides the circle from the interpreter. (A module loaded by
name through `importlib.import_module` is not an import statement and is not seen.)
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """module name -> file, for every .py file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # `from a import b` imports a, and a.b when that is a module
                base = _absolute(name, path, node.level, node.module)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _absolute(importer: str, path: Path, level: int, module: str | None) -> str:
    """The absolute name a `from` import names (``from ..a import b`` in x.y.z -> x.a)."""
    if level == 0:
        return module or ""
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def deferred_imports(root: Path, packages: tuple[str, ...]) -> list[tuple[str, int, str, bool]]:
    """Imports of ``packages``' own modules made inside a function: (file, line, statement,
    whether the import's line or the line above it carries a comment saying why)."""
    files = module_files(root, packages)
    found = []
    for name, path in files.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for function in ast.walk(ast.parse(source)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = [_absolute(name, path, node.level, node.module)]
                else:
                    continue
                if not any(t.split(".")[0] in packages for t in targets):
                    continue
                here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
                said = "#" in here or above.strip().startswith("#")
                found.append((str(path.relative_to(root)), node.lineno, here.strip(), said))
    return sorted(found)
