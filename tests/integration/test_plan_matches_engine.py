"""The planner against the engine it predicts: `qwen38 serve --profile cpu` prints the KV
pool it planned before it starts vLLM, and the real vLLM 0.28.0 CPU engine then logs its
own ("GPU KV cache size: N tokens, Maximum concurrency ... X.XXx"). They are the same for
prefix caching on and off and speculation on and off. (The CPU build cannot run
speculation with prefix caching on the hybrid target: every command refuses that alike,
tests/unit/test_resolve.py.) The session servers cover two cases; the third starts the
engine only until it has logged its pool."""

from __future__ import annotations

import json

import pytest

from entrypoint.patches import all_present, check_series, find_vllm_dir
from tests.conftest import run_cli
from tests.support.kv_pool import pools, serve_until_pool_logged

pytestmark = pytest.mark.integration


def _assert_plan_is_the_engines(log: str) -> None:
    found = pools(log)
    assert found.planned_tokens == found.engine_tokens, found
    assert found.planned_concurrency == found.engine_concurrency, found
    # The plan answers for the tree that serves: the installed one (patched by `make setup`).
    assert (found.tree == "patched") == all_present(check_series(find_vllm_dir()))


def test_plan_equals_the_engine_with_prefix_caching_and_without_speculation(cpu_server):
    _assert_plan_is_the_engines(cpu_server.log.read_text())


def test_plan_equals_the_engine_with_speculation_and_without_prefix_caching(cpu_spec_server):
    _assert_plan_is_the_engines(cpu_spec_server.log.read_text())


def test_plan_equals_the_engine_without_prefix_caching_or_speculation(tiny_root, api_key_file, tmp_path):
    log = serve_until_pool_logged(tmp_path, tiny_root, api_key_file, PREFIX_CACHING="false", SPECULATION="false")
    _assert_plan_is_the_engines(log)


def test_qwen38_plan_answers_what_serve_planned_from_the_same_cache_entry(cpu_server):
    """`qwen38 plan` and `qwen38 serve` resolve the same engine and key the same plan: with
    the server's settings the command reuses the plan serve made, without vLLM."""
    done = run_cli("plan", "--profile", "cpu", "--json", "--no-compare", env=cpu_server.env, cwd=cpu_server.log.parent)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["reused"] is True
    assert plan["pool_tokens"] == pools(cpu_server.log.read_text()).engine_tokens
