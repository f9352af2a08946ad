"""`qwen38 bench` against the real vLLM 0.28.0 CPU server of the `cpu` profile, at small
sizes: every workload runs end to end, and its figures agree with each other and with the
server's own counters (read here independently of the harness).

The speculative server's drafter is random, so it accepts (almost) nothing; the checks that
hold whatever the acceptance (per-position sums, drafts x K, acceptance length from the
counters) are what is proven here. Against it, prompts have several tokens and no request
forces a tool call (a vLLM CPU bug kills the engine then).
"""

from __future__ import annotations

import json

import pytest

from entrypoint.client import StackClient
from tests.conftest import clean_env, run_cli, run_cli_here

pytestmark = pytest.mark.integration


def _bench(server, tmp_path, workload: str, *args: str, name: str | None = None) -> tuple[dict, str]:
    """`qwen38 bench WORKLOAD` against ``server``, in this process (`run_cli_here`: this module
    runs 14); the refusals below and `bench compare` run as the command line, in a process of
    their own."""
    out = tmp_path / f"{name or workload}.json"
    result = run_cli_here(
        "bench",
        workload,
        "--base-url",
        server.base_url,
        "--model",
        "qwen3.8-27b",
        "--out",
        str(out),
        "--cache-dir",
        str(server.cache_dir),
        *args,
        env=clean_env(VLLM_API_KEY=server.api_key),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def _assert_self_consistent(doc: dict, output_tokens: int) -> None:
    assert doc["consistent"] is True
    failed = [c for c in doc["checks"] if c["fatal"] and not c["ok"]]
    assert not failed, failed
    for r in doc["requests"]:
        assert r["streamed_tokens"] == r["completion_tokens"] == r["max_tokens"] == output_tokens
        assert r["prompt_tokens"] == r["expected_prompt_tokens"]
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0
    for p in doc["points"]:
        s = p["summary"]
        completion = sum(r["completion_tokens"] for r in doc["requests"] if r["point"] == doc["points"].index(p))
        assert s["completion_tokens"] == completion == s["metrics_delta"]["generation_tokens"]
        assert s["output_tok_s"] == pytest.approx(completion / s["duration_s"])
    assert doc["server"]["vllm_version"] == "0.28.0"
    assert doc["server"]["declared"]["identity"].startswith("profile=cpu;vllm=0.28.0")


def test_c8_sweep_on_the_prefix_caching_server(cpu_server, tmp_path):
    doc, stdout = _bench(
        cpu_server,
        tmp_path,
        "c8",
        "--input-tokens",
        "64",
        "--output-tokens",
        "16",
        "--requests",
        "6",
        "--concurrency",
        "1,3",
        "--plot",
        str(tmp_path / "c8.png"),
    )
    _assert_self_consistent(doc, 16)
    assert [p["concurrency"] for p in doc["points"]] == [1, 3]
    assert len(doc["requests"]) == 12
    assert doc["acceptance_length"] is None  # no speculation on this server
    assert doc["summary"]["prefix_cache"]["queries"] == doc["summary"]["prompt_tokens"]["total"]
    assert (tmp_path / "c8.png").read_bytes()[:4] == b"\x89PNG"
    assert "concurrency 3" in stdout and "checks:" in stdout


def test_agent_threads_hit_the_prefix_cache(cpu_server, tmp_path):
    # On the CPU build a hybrid target's state is cached only where a prefill chunk ends on a
    # 640-token block boundary, and chunks are 2,048 tokens: prompts past 2,048 leave one at 1,920.
    doc, stdout = _bench(
        cpu_server,
        tmp_path,
        "agent",
        "--system-tokens",
        "2100",
        "--threads",
        "2",
        "--turns",
        "3",
        "--turn-tokens",
        "80",
        "--output-tokens",
        "12",
    )
    _assert_self_consistent(doc, 12)
    assert doc["prefix_cache_hit_rate"] > 0.3
    later_turns = [r for r in doc["requests"] if r["turn"] > 0]
    assert later_turns and all(r["cached_tokens"] > 0 for r in later_turns)
    assert sum(r["cached_tokens"] for r in doc["requests"]) == doc["summary"]["prefix_cache"]["hits"]
    assert all(r["label"].endswith(("(code)", "(prose)", "(tool)")) for r in doc["requests"])
    assert "with one" in stdout  # TTFT with and without a cached prefix


def test_users_points_count_preemptions_from_the_servers_counter(cpu_server, tmp_path):
    """The many-users workload at tiny size (2 and 4 users in flight: the profile's 4 slots):
    every point's figures, and its preemptions read from the counter the real server exposes."""
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        before = client.metrics()
        assert "vllm:num_preemptions_total" in before.samples  # the name vLLM 0.28.0 exposes
        doc, stdout = _bench(
            cpu_server,
            tmp_path,
            "users",
            *("--system-tokens", "200", "--prompt-tokens", "40", "--output-tokens", "8"),
            *("--concurrency", "2,4", "--rounds", "1"),
        )
        moved = client.metrics().total("vllm:num_preemptions_total") - before.total("vllm:num_preemptions_total")
    _assert_self_consistent(doc, 8)
    assert [(p["concurrency"], p["summary"]["requests"]) for p in doc["points"]] == [(2, 2), (4, 4)]
    assert doc["preemptions"] == sum(p["preemptions"] for p in doc["points"]) == moved == 0  # a 462k-token pool
    assert all(p["summary"]["ttft_s"]["p99"] >= p["summary"]["ttft_s"]["p50"] > 0 for p in doc["points"])
    assert "PREEMPT" in stdout and "concurrency 4" in stdout


def test_a_repeated_run_starts_from_a_cold_cache(cpu_server, tmp_path):
    """The per-run cache_salt: a repeat never meets the previous runs' cached prefixes.

    vLLM 0.28.0 keeps a hybrid's state for a prefix it has seen before (here the same prompt
    first hits on its third run), and only at chunk ends on a block boundary: 2,500 tokens
    leave one at 1,920.
    """
    args = ("--input-tokens", "2500", "--output-tokens", "4", "--requests", "1", "--concurrency", "1")
    salted = [_bench(cpu_server, tmp_path, "c8", *args, name=f"salted{i}")[0] for i in range(3)]
    unsalted = [_bench(cpu_server, tmp_path, "c8", *args, "--no-cache-salt", name=f"plain{i}")[0] for i in range(3)]
    assert [d["requests"][0]["cached_tokens"] for d in salted] == [0, 0, 0]
    assert unsalted[2]["requests"][0]["cached_tokens"] > 0
    assert unsalted[2]["prefix_cache_hit_rate"] > 0 and salted[2]["prefix_cache_hit_rate"] == 0


def test_depth_points_measure_decode_after_growing_contexts(cpu_server, tmp_path):
    doc, _ = _bench(
        cpu_server,
        tmp_path,
        "depth",
        "--depths",
        "0,512,1536",
        "--output-tokens",
        "16",
        "--plot",
        str(tmp_path / "depth.png"),
    )
    _assert_self_consistent(doc, 16)
    xs = [p["x"] for p in doc["points"]]
    assert xs == sorted(xs) and xs[0] < 64 and 1536 < xs[2] < 1600
    assert all(p["decode_tok_s"] > 0 for p in doc["points"])


def test_copy_reports_fidelity(cpu_server, tmp_path):
    doc, stdout = _bench(cpu_server, tmp_path, "copy", "--document-tokens", "200")
    _assert_self_consistent(doc, 200)
    assert 0.0 <= doc["points"][0]["copy_fidelity"] <= 1.0
    assert "copy fidelity" in stdout


def test_too_long_a_workload_is_refused_with_the_server_limit(cpu_server):
    result = run_cli(
        "bench",
        "copy",
        "--base-url",
        cpu_server.base_url,
        "--model",
        "qwen3.8-27b",
        env=clean_env(VLLM_API_KEY=cpu_server.api_key),
    )
    assert result.returncode == 2
    assert "exceed the server's max_model_len 32768" in result.stderr


def test_wrong_key_fails_in_one_line(cpu_server):
    result = run_cli(
        "bench",
        "c1",
        "--base-url",
        cpu_server.base_url,
        "--model",
        "qwen3.8-27b",
        env=clean_env(VLLM_API_KEY="wrong-key-" + "x" * 20),
    )
    assert result.returncode == 2 and "/v1/models answered 401" in result.stderr
    assert "Traceback" not in result.stderr


def test_speculative_counters_agree_with_the_harness(cpu_spec_server, tmp_path):
    with StackClient(cpu_spec_server.base_url, cpu_spec_server.api_key) as client:
        before = client.metrics()
        doc, stdout = _bench(
            cpu_spec_server,
            tmp_path,
            "c8",
            "--input-tokens",
            "48",
            "--output-tokens",
            "24",
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--warmup",
            "0",
        )
        after = client.metrics()
    _assert_self_consistent(doc, 24)
    spec = doc["summary"]["speculation"]
    own = {
        k: after.total(f"vllm:spec_decode_num_{k}_total") - before.total(f"vllm:spec_decode_num_{k}_total")
        for k in ("drafts", "draft_tokens", "accepted_tokens")
    }
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (
        own["drafts"],
        own["draft_tokens"],
        own["accepted_tokens"],
    )
    assert spec["drafts"] > 0 and spec["num_speculative_tokens"] == 4  # K = 4 in the cpu profile
    assert spec["draft_tokens"] == 4 * spec["drafts"]
    assert spec["accepted_tokens"] <= spec["draft_tokens"]
    per_pos = doc["summary"]["metrics_delta"]["accepted_per_position"]
    assert len(per_pos) == 4 and sum(per_pos) == spec["accepted_tokens"]
    assert doc["acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])
    assert doc["summary"]["metrics_delta"]["generation_tokens"] == 4 * 24
    assert "per-position acceptance" in stdout


def test_c1_with_and_without_speculation_runs_the_same_prompts_and_compares(cpu_spec_server, cpu_server, tmp_path):
    args = ("--input-tokens", "64", "--output-tokens", "32", "--requests", "2")
    spec_doc, _ = _bench(cpu_spec_server, tmp_path, "c1", *args, name="spec")
    plain_doc, _ = _bench(cpu_server, tmp_path, "c1", *args, name="plain")
    _assert_self_consistent(spec_doc, 32)
    assert spec_doc["acceptance_length"] is not None and plain_doc["acceptance_length"] is None
    # The same seed, the same prompts on both servers.
    assert [r["prompt_tokens"] for r in spec_doc["requests"]] == [r["prompt_tokens"] for r in plain_doc["requests"]]
    result = run_cli("bench", "compare", str(tmp_path / "plain.json"), str(tmp_path / "spec.json"))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.split()[:3] == ["overall", "output", "tok/s"])
    ratio = spec_doc["output_tok_s"] / plain_doc["output_tok_s"]
    assert float(row.split()[-1]) == pytest.approx(ratio, abs=0.001)


# `qwen38 bench startup` (a cold serve to a passed gate): tests/integration/test_plan_matches_engine.py,
# where the same start also proves the plan of the engine without prefix caching or speculation.
