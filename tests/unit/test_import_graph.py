"""No import circles in entrypoint/ or prepare/: each module depends only on the modules
and the data it builds on (serve -> verify, plan, launch, ready; launch -> resolve; adapter
-> directions; manifest -> identity; never back). Every import counts, the ones inside a
function too: deferring an import hides a circle from the interpreter, it does not break it."""

from __future__ import annotations

from tests.conftest import REPO
from tests.support.import_graph import circles, import_graph

GRAPH = import_graph(REPO, ("entrypoint", "prepare"))


def test_no_module_of_entrypoint_or_prepare_is_in_an_import_circle():
    assert circles(GRAPH) == []


def test_the_finder_sees_deferred_imports_and_circles():
    """The check itself: an import inside a function is an edge, and a circle is found."""
    assert "entrypoint.verify" in GRAPH["entrypoint.serve"]  # imported inside run_preflight
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_finder_sees_a_circle_closed_by_a_deferred_relative_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub.b import thing\n")
    (package / "sub" / "b.py").write_text("def thing():\n    from ..a import other\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_the_serve_flow_sits_above_the_steps_it_runs():
    for step in ("entrypoint.launch", "entrypoint.plan", "entrypoint.resolve", "entrypoint.ready"):
        assert "entrypoint.serve" not in GRAPH[step], step
    assert "entrypoint.plan" not in GRAPH["entrypoint.launch"]  # the renderer does not plan


def test_the_preparation_steps_sit_above_the_data_they_read():
    """The adapter builds on the directions file, the manifest on the identity it records."""
    assert "prepare.adapter" not in GRAPH["prepare.directions"]
    assert "core.manifest" not in GRAPH["core.identity"]
