"""No import circles in entrypoint/: each step of the flow depends only on the steps and
the data it builds on (serve -> verify, plan, launch, ready; launch -> resolve; never back).
The graph spans entrypoint/ and prepare/, so a circle through prepare/ counts too."""

from __future__ import annotations

from tests.conftest import REPO
from tests.support.import_graph import circles, import_graph

GRAPH = import_graph(REPO, ("entrypoint", "prepare"))


def test_no_module_of_entrypoint_is_in_an_import_circle():
    in_entrypoint = [c for c in circles(GRAPH) if any(m.split(".")[0] == "entrypoint" for m in c)]
    assert in_entrypoint == []


def test_the_finder_sees_deferred_imports_and_circles():
    """The check itself: an import inside a function is an edge, and a circle is found."""
    assert "entrypoint.verify" in GRAPH["entrypoint.serve"]  # imported inside run_preflight
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_serve_flow_sits_above_the_steps_it_runs():
    for step in ("entrypoint.launch", "entrypoint.plan", "entrypoint.resolve", "entrypoint.ready"):
        assert "entrypoint.serve" not in GRAPH[step], step
    assert "entrypoint.plan" not in GRAPH["entrypoint.launch"]  # the renderer does not plan
