"""The house's layers, read from the source: no import circles anywhere, and every package
imports only the floors below it.

    bench/       the benchmarks and the full-scale lab (not in the serving images)
    entrypoint/  the runtime: verify, plan, launch, serve, the gate, validators, the CLI
    prepare/     downloads and model transformations
    core/        the ground floor: errors, settings, profiles, manifests, the lock, ...

Every import counts, the ones inside a function too: deferring an import hides a circle
from the interpreter, it does not break it. An import of our own modules inside a function
says why on its line or the line above (the start-up time of a command, a child process's
entry point); the rest are made where a module starts."""

from __future__ import annotations

from tests.conftest import REPO
from tests.support.import_graph import circles, deferred_imports, import_graph

LAYERS = ("core", "prepare", "entrypoint", "bench")  # each may import those before it
GRAPH = import_graph(REPO, LAYERS)


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_no_module_is_in_an_import_circle():
    assert circles(GRAPH) == []


def test_every_package_imports_only_the_floors_below_it():
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(target) > _layer(module)
    )
    assert upward == []


def test_prepare_imports_nothing_from_the_runtime():
    assert not [t for m, ts in GRAPH.items() if m.startswith("prepare") for t in ts if t.startswith("entrypoint")]


def test_an_import_inside_a_function_says_why():
    unexplained = [f"{file}:{line}: {statement}" for file, line, statement, said in deferred_imports(REPO, LAYERS)
                   if not said]
    assert unexplained == []


def test_the_finder_sees_deferred_imports_and_circles():
    """The check itself: an import inside a function is an edge, and a circle is found."""
    assert "entrypoint.verify" in GRAPH["entrypoint.serve"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_finder_sees_a_circle_closed_by_a_deferred_relative_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub.b import thing\n")
    (package / "sub" / "b.py").write_text("def thing():\n    from ..a import other\n\n\ndef why():\n"
                                           "    # a reason\n    from pkg.a import x\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]
    found = deferred_imports(tmp_path, ("pkg",))
    assert [(line, said) for _, line, _, said in found] == [(2, False), (7, True)]


def test_the_serve_flow_sits_above_the_steps_it_runs():
    for step in ("entrypoint.launch", "entrypoint.plan", "entrypoint.resolve", "entrypoint.ready"):
        assert "entrypoint.serve" not in GRAPH[step], step
    assert "entrypoint.plan" not in GRAPH["entrypoint.launch"]  # the renderer does not plan


def test_the_preparation_steps_sit_above_the_data_they_read():
    """The adapter builds on the directions file, the manifest on the identity it records."""
    assert "prepare.adapter" not in GRAPH["prepare.directions"]
    assert "core.manifest" not in GRAPH["core.identity"]
