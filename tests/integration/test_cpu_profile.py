"""The `cpu` profile end to end: the real vLLM 0.28.0 CPU build serving the tiny hybrid
target and its rank-1 LoRA, started by `qwen38 serve` and proven by the readiness gate and
both validators, exactly as a user runs them against any deployment."""

from __future__ import annotations

import json
import re

import pytest

from core.errors import ReadinessError
from entrypoint.client import StackClient
from entrypoint.engine_output import FIRST_PHASE, PHASES
from entrypoint.ready import run_gate
from tests.conftest import CACHE_PREFIX_TOKENS, clean_env, run_cli
from tests.support.prefix_cache import alone_and_resumed, cached_tokens, kv_block_tokens, sendings, token_prompt

pytestmark = pytest.mark.integration


def _cli(server, *args):
    return run_cli(*args, "--base-url", server.base_url, env=clean_env(VLLM_API_KEY=server.api_key))


def test_serve_passes_the_readiness_gate(cpu_server):
    status = cpu_server.status()
    assert status["ready"] is True
    assert status["model_ids"] == ["qwen3.8-27b", "qwen3.8-27b-mode-b"]
    assert status["checks"][-1] == "adapter: qwen3.8-27b-mode-b differs from qwen3.8-27b"
    assert status["adapter_canary"] != status["canary"]
    log = cpu_server.log.read_text()
    assert "qwen38: ready in" in log and f"API key: file {cpu_server.env['API_KEY_FILE']}" in log
    # The gate's figure (from the engine's release) and the whole start (verify and plan too).
    found = re.search(r"ready in ([\d.]+) s \(([\d.]+) s since serve began\)", log)
    assert found, log[-2000:]
    gate, whole = map(float, found.groups())
    assert 0 < gate <= whole
    assert cpu_server.api_key not in log
    # While the gate waited, the heartbeat said what vLLM's own lines (passed through) showed it doing.
    assert "Starting to load model" in log and "Application startup complete" in log
    beats = re.findall(r"^qwen38: starting: (.+) \(((?:\d+ min )?\d+ s) in, ((?:\d+ min )?\d+ s) left of "
                       r"READY_TIMEOUT\)$", log, re.MULTILINE)
    assert beats, log[-3000:]
    assert {phase for phase, _, _ in beats} <= {FIRST_PHASE} | {phase for _, phase in PHASES}, beats
    assert any(phase != FIRST_PHASE for phase, _, _ in beats), beats  # read from the engine's output


def test_validate_apis_passes_for_every_model_id(cpu_server):
    result = _cli(cpu_server, "validate", "apis", "--json")
    report = json.loads(result.stdout)
    failed = [c for c in report["checks"] if c["outcome"] != "pass"]
    assert result.returncode == 0 and not failed, failed
    per_model = {c["model"] for c in report["checks"]}
    assert {"qwen3.8-27b", "qwen3.8-27b-mode-b"} <= per_model
    names = {c["name"] for c in report["checks"]}
    assert {"chat stream", "responses stream", "messages stream", "tool call chat", "tool call responses",
            "tool call messages", "missing key -> 401", "wrong key -> 401", "unknown model -> 404",
            "invalid parameters -> 400"} <= names


def test_cache_isolation_holds_and_passes_when_run_twice(cpu_server):
    for _ in range(2):
        result = _cli(cpu_server, "validate", "cache-isolation", "--json", "--prefix-tokens", str(CACHE_PREFIX_TOKENS))
        report = json.loads(result.stdout)
        assert result.returncode == 0, report
        hits = [c["data"]["hits_delta"] for c in report["checks"]]
        assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0 and hits[3] > 0


def test_cache_isolation_of_a_single_id_checks_reuse_within_the_base(cpu_server):
    """Naming only the base (as on a profile that serves no adapter): the two base steps."""
    result = _cli(cpu_server, "validate", "cache-isolation", "--json", "--base-model", "qwen3.8-27b",
                  "--adapter-model", "")
    report = json.loads(result.stdout)
    assert result.returncode == 0, report
    assert [c["name"] for c in report["checks"]] == ["base first", "base repeat"]
    assert report["checks"][0]["data"]["hits_delta"] == 0 and report["checks"][1]["data"]["hits_delta"] > 0


def test_validators_fail_with_a_wrong_key(cpu_server):
    result = run_cli("validate", "apis", "--base-url", cpu_server.base_url,
                     env=clean_env(VLLM_API_KEY="wrong-key-" + "x" * 20))
    assert result.returncode == 1
    assert "/v1/models answered 401" in result.stdout


def test_ready_command_and_healthcheck_pass(cpu_server):
    result = run_cli("ready", "--profile", "cpu", "--base-url", cpu_server.base_url, env=cpu_server.env)
    assert result.returncode == 0, result.stderr
    assert "ok  adapter: qwen3.8-27b-mode-b differs from qwen3.8-27b" in result.stdout
    quick = run_cli("ready", "--profile", "cpu", "--quick", env=cpu_server.env)
    assert quick.returncode == 0 and quick.stdout.strip() == "ready"


def test_gate_refuses_an_adapter_that_answers_like_the_base(cpu_server):
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        with pytest.raises(ReadinessError, match="answered exactly like the base"):
            run_gate(client, "qwen3.8-27b", "qwen3.8-27b", timeout=30)


def test_base_requests_are_untouched_by_the_adapter(cpu_server):
    """Greedy base output is the same before and after adapter traffic (clean path)."""
    body = {"prompt": "The cache server keeps", "max_tokens": 24, "temperature": 0}
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        first = client.post_json("/v1/completions", {"model": "qwen3.8-27b", **body})["choices"][0]["text"]
        adapter = client.post_json("/v1/completions", {"model": "qwen3.8-27b-mode-b", **body})["choices"][0]["text"]
        again = client.post_json("/v1/completions", {"model": "qwen3.8-27b", **body})["choices"][0]["text"]
    assert first == again and adapter != first


def test_a_one_token_prompt_does_not_depend_on_earlier_requests(cpu_server):
    """Patch 0057: a first-token prefill starts the GDN layers from zero state, whatever the
    slot held before (stock vLLM took it for a decode and read the previous request's state)."""
    body = {"model": "qwen3.8-27b", "max_tokens": 16, "temperature": 0}
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        assert len(client.post_json("/tokenize", {"model": "qwen3.8-27b", "prompt": "x"})["tokens"]) == 1
        first = client.post_json("/v1/completions", {**body, "prompt": "x"})["choices"][0]["text"]
        client.post_json("/v1/completions", {**body, "prompt": "The cache server keeps the queue busy"})
        again = client.post_json("/v1/completions", {**body, "prompt": "x"})["choices"][0]["text"]
    assert again == first


def test_a_seeded_request_with_a_chunked_prompt_is_answered_the_same_every_time(cpu_server):
    """Patch 0075: a seeded request whose prompt takes more than one prefill chunk (vLLM's CPU
    API-server default is 2,048 tokens a step) killed the stock CPU engine ("CPU Generator does
    not use offset" when the partial prefill's sample was discarded). Now it is answered, the
    same seed gives the same tokens (again with the prompt cached, so chunked differently) and
    another seed other tokens, and the server keeps serving."""
    prompt = " ".join(f"section {i} of the cache log" for i in range(600))
    body = {"model": "qwen3.8-27b", "prompt": prompt, "max_tokens": 24, "temperature": 1.0,
            "ignore_eos": True, "return_token_ids": True}
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        assert len(client.post_json("/tokenize", {"model": "qwen3.8-27b", "prompt": prompt})["tokens"]) > 2 * 2048

        def sample(seed: int) -> list[int]:
            return client.post_json("/v1/completions", {**body, "seed": seed})["choices"][0]["token_ids"]

        first, again, other = sample(1234), sample(1234), sample(4321)
        assert client.get("/health").status_code == 200
        after = client.post_json("/v1/completions", {"model": "qwen3.8-27b", "prompt": "x", "max_tokens": 4})
    assert len(first) == 24 and first == again and other != first
    assert after["choices"][0]["text"] is not None


@pytest.mark.parametrize("length", [1410, 2050])
def test_a_repeated_prompt_hits_the_cache_on_its_second_sending(cpu_server, length):
    """Patch 0077: the CPU engine core reset the hybrid's block size (640) to 128 after its
    handshake, so prefill chunks ended off the mamba blocks; the second sending of such a prompt
    hit nothing (the third did). Now the second reuses every whole block the prompt allows."""
    block = kv_block_tokens(cpu_server.log.read_text())
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        first, second = sendings(client, token_prompt(length, length), f"repeat-{length}", 2)
    assert length % block > 128  # where the stock CPU engine's chunks ended off a block
    assert (first, second) == (0, (length - 1) // block * block)


def test_a_request_resuming_from_another_prompts_cached_prefix_answers_as_without_it(cpu_server):
    """Patch 0077: with chunks ending on 128-token marks, a 4,200-token prompt's first chunk
    (2,048 tokens, the step's budget) left its state in a block that went into the cache, once
    the next chunk ran to 4,096, as the state after 2,560 tokens; a request sharing 2,600 tokens
    resumed from it (its logprobs off by 2e-4 on the tiny model). Now chunks end on the
    640-token blocks, the cached states are those of their positions, and the resumed request
    gets the very answer it gets with nothing cached (the same chunks from the same state)."""
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        alone, resumed = alone_and_resumed(client, "resume")
    block = kv_block_tokens(cpu_server.log.read_text())
    assert cached_tokens(alone) == 0 and cached_tokens(resumed) >= 2 * block
    expected, got = (answer["choices"][0]["logprobs"] for answer in (alone, resumed))
    assert got["tokens"] == expected["tokens"]
    assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-6)
