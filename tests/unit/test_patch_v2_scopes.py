"""Patch 0092: the V2 model runner's step in vLLM's profiler scopes, without a GPU.

`qwen38 bench steps` splits a CUDA trace's step by the record_function scope each kernel was
launched in (bench/step_profile.py): the drafter's, the sampler's, compute_logits' (the
lm_head) and, for the device's idle time, the host work that ended each gap. The V1 runner has
those scopes; the patched V2 runner (every DFlash2 profile, and the `-v2` copies of issue 57)
must put each of its calls in the scope of the same name, or its table would count the
drafter's GEMMs as the target's. Read from the installed (patched) file's syntax tree: which
`with record_function_or_nullcontext(...)` block encloses each call. The trace a V2 copy records
on the lent GPU is the end-to-end check (docs/step-profile.md).
"""

from __future__ import annotations

import ast

import pytest

from bench.step_profile import DRAFT_SCOPE, LOGITS_SCOPE, RUNNER_SCOPE, SAMPLE_SCOPE
from entrypoint.patches import check_series, find_vllm_dir

PATCH = "0092-v2-runner-profiler-scopes.patch"
V2_RUNNER = "v1/worker/gpu/model_runner.py"
PREPROCESS, FORWARD, BOOKKEEP = (RUNNER_SCOPE + part for part in ("preprocess", "forward", "bookkeep"))

# (method, the call's dotted callee, the scope it must run in)
EXPECTED = [
    ("execute_model", "self.update_requests", PREPROCESS),
    ("execute_model", "self.prepare_inputs", PREPROCESS),
    ("execute_model", "self.prepare_attn", PREPROCESS),
    ("execute_model", "self.model_state.prepare_attn", PREPROCESS),
    ("execute_model", "self.model_state.prepare_inputs", PREPROCESS),
    ("execute_model", "self.cudagraph_manager.run_fullgraph", FORWARD),
    ("execute_model", "self.cudagraph_manager.run_pw_graph", FORWARD),
    ("execute_model", "self.model", FORWARD),
    ("sample", "self.model.compute_logits", LOGITS_SCOPE),
    ("sample", "self.sampler", SAMPLE_SCOPE),
    ("sample", "self.rejection_sampler", SAMPLE_SCOPE),
    ("sample_tokens", "self.postprocess_sampled", BOOKKEEP),
    ("sample_tokens", "self.speculator.propose", DRAFT_SCOPE),
    ("sample_tokens", "self.speculator.fill_lookup", DRAFT_SCOPE),
]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _scope_of(item: ast.withitem) -> str | None:
    call = item.context_expr
    if (isinstance(call, ast.Call) and _dotted(call.func) == "record_function_or_nullcontext"
            and call.args and isinstance(call.args[0], ast.Constant)):
        return call.args[0].value
    return None


def _calls_with_scopes(method: ast.FunctionDef) -> list[tuple[str, tuple[str, ...]]]:
    """Every call in ``method`` with the profiler scopes around it, outermost first."""
    found: list[tuple[str, tuple[str, ...]]] = []

    def visit(node: ast.AST, scopes: tuple[str, ...]) -> None:
        if isinstance(node, ast.With):
            names = tuple(s for s in map(_scope_of, node.items) if s)
            for item in node.items:
                visit(item.context_expr, scopes)
            for child in node.body:
                visit(child, scopes + names)
            return
        if isinstance(node, ast.Call):
            found.append((_dotted(node.func), scopes))
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    for statement in method.body:
        visit(statement, ())
    return found


@pytest.fixture(scope="module")
def runner_methods() -> dict[str, ast.FunctionDef]:
    states = {s.name: s.state for s in check_series(find_vllm_dir())}
    if states.get(PATCH) != "present":
        pytest.skip(f"the installed vLLM does not carry {PATCH} ({states.get(PATCH)})")
    tree = ast.parse((find_vllm_dir() / V2_RUNNER).read_text())
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    return {n.name: n for n in runner.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize(("method", "callee", "scope"), EXPECTED, ids=lambda v: str(v))
def test_each_part_of_the_v2_step_runs_in_the_scope_the_step_table_reads(runner_methods, method, callee, scope):
    calls = [scopes for name, scopes in _calls_with_scopes(runner_methods[method]) if name == callee]
    assert calls, f"{method} no longer calls {callee}: rebase patch 0092"
    for scopes in calls:
        # Innermost scope decides the part (bench/step_profile.py): it must be this one.
        assert scopes and scopes[-1] == scope, f"{callee} in {method} runs in {scopes or 'no scope'}, not {scope!r}"


def test_no_scope_is_entered_twice_and_every_scope_is_a_runner_scope(runner_methods):
    for method in ("execute_model", "sample", "sample_tokens"):
        for callee, scopes in _calls_with_scopes(runner_methods[method]):
            assert len(set(scopes)) == len(scopes), f"{callee} in {method}: nested {scopes}"
            assert all(s.startswith(RUNNER_SCOPE) for s in scopes), scopes
