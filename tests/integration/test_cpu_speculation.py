"""The `cpu` profile with the DFlash drafter: drafts are verified by the target, the output
is what the target alone produces (speculation is lossless), and SIGTERM ends everything."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from entrypoint.client import StackClient
from tests.conftest import clean_env, run_cli, spec_decode_delta

pytestmark = pytest.mark.integration

# "x" is one token: its first decode is a non-speculative sequence in a speculative batch,
# which killed the stock CPU engine (patch 0055).
PROMPTS = ["x", "The cache server keeps", "def verify(path):", "Tell me about the draft model and the queue."]


def _greedy(server, model: str) -> list[str]:
    with StackClient(server.base_url, server.api_key) as client:
        return [
            client.post_json("/v1/completions", {"model": model, "prompt": p, "max_tokens": 32, "temperature": 0})[
                "choices"][0]["text"]
            for p in PROMPTS
        ]


def test_drafts_are_proposed_and_verified(cpu_spec_server):
    moved = spec_decode_delta(
        cpu_spec_server, {"model": "qwen3.8-27b", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    )
    assert moved["drafts"] > 0 and moved["draft_tokens"] == 4 * moved["drafts"]  # K=4 in the cpu profile


def test_speculation_is_lossless(cpu_server, cpu_spec_server):
    """Greedy output with drafts verified by the target equals the target's alone.

    The tiny base gives every greedy choice a wide margin, so the whole output must match.
    The adapter's rank-1 projection (c = 100) leaves narrow margins, where the verify pass
    and a plain decode step (different bf16 kernels) may break a near-tie differently later
    in the output: its first tokens must match.
    """
    assert _greedy(cpu_spec_server, "qwen3.8-27b") == _greedy(cpu_server, "qwen3.8-27b")
    head = 8
    with StackClient(cpu_server.base_url, cpu_server.api_key) as plain, \
            StackClient(cpu_spec_server.base_url, cpu_spec_server.api_key) as spec:
        for prompt in PROMPTS:
            body = {"model": "qwen3.8-27b-mode-b", "prompt": prompt, "max_tokens": head, "temperature": 0,
                    "return_token_ids": True}
            ids = [c.post_json("/v1/completions", body)["choices"][0]["token_ids"] for c in (plain, spec)]
            assert ids[0] == ids[1], prompt


def test_validate_apis_passes_with_speculation(cpu_spec_server):
    result = run_cli("validate", "apis", "--base-url", cpu_spec_server.base_url,
                     env=clean_env(VLLM_API_KEY=cpu_spec_server.api_key))
    assert result.returncode == 0, result.stdout[-3000:]


def test_sigterm_stops_the_engine_and_leaves_nothing_running(cpu_spec_server):
    """`serve` exec'ed vLLM: the pid we started is the engine; SIGTERM ends its whole tree."""
    process = cpu_spec_server.process
    pgid = os.getpgid(process.pid)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=90)  # no SIGKILL needed: the engine drains and exits
    deadline = time.monotonic() + 30
    while _running_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    # No engine core, worker or watcher is left (an exited orphan may linger as a zombie
    # until init reaps it: it runs nothing).
    assert _running_in_group(pgid) == []


def _running_in_group(pgid: int) -> list[str]:
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            running.append(stat.parent.name)
    return running
