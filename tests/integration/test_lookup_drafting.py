"""Patch 0070 on the real CPU engine: lookup drafting past the DFlash drafter's positions.

Two servers of the `cpu` profile with the drafter on (prefix caching off): lookup off
(K = 4, the shared `cpu_spec_server`) and lookup on (verify block 16: 4 drafter + 11
lookup positions). The tiny target's lm_head maps every token to a fixed successor, so
greedy output walks a chain of tokens; a prompt holding a stretch of that chain and then
its start again is a document the model copies, token for token.
"""

from __future__ import annotations

import pytest

from entrypoint.client import StackClient

pytestmark = pytest.mark.integration

MODEL = "qwen3.8-27b"
# Text with repeats (the model's own chain need not follow them: losslessness must hold anyway).
PROMPTS = [
    "the cache the cache the cache the cache the",
    "def verify(path):\n    return path\ndef verify(path):\n    return",
    "one two three four five one two three four five one two",
]


def _complete(server, prompt, max_tokens: int) -> list[int]:
    with StackClient(server.base_url, server.api_key) as client:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        return client.post_json("/v1/completions", body)["choices"][0]["token_ids"]


def _copy_prompt(server) -> tuple[list[int], list[int]]:
    """(prompt, expected): 48 tokens of the model's own chain, then its first 8 again."""
    start = _complete(server, "x", 1)
    chain = start + _complete(server, start, 80)
    return chain[:48] + chain[:8], chain[8:48]


def _accepted_per_step(server, prompt, max_tokens: int) -> tuple[list[int], float, float]:
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
             "vllm:spec_decode_num_draft_tokens_total")
    with StackClient(server.base_url, server.api_key) as client:
        before = client.metrics()
        out = _complete(server, prompt, max_tokens)
        after = client.metrics()
    drafts, accepted, draft_tokens = (after.total(n) - before.total(n) for n in names)
    assert drafts > 0
    return out, accepted / drafts, draft_tokens / drafts


def test_greedy_output_is_identical_with_lookup_on_and_off(cpu_spec_server, cpu_lookup_server):
    copy_prompt, _ = _copy_prompt(cpu_spec_server)
    for prompt in [*PROMPTS, copy_prompt]:
        assert _complete(cpu_lookup_server, prompt, 48) == _complete(cpu_spec_server, prompt, 48), prompt


def test_lookup_accepts_more_tokens_per_verify_step_on_a_copied_document(cpu_spec_server, cpu_lookup_server):
    prompt, expected = _copy_prompt(cpu_spec_server)
    off, off_per_step, off_width = _accepted_per_step(cpu_spec_server, prompt, 40)
    on, on_per_step, on_width = _accepted_per_step(cpu_lookup_server, prompt, 40)
    assert off == on == expected  # the model copies the document, with and without lookup
    assert (off_width, on_width) == (4, 15)  # the verify block widened to 16
    # The tiny drafter is random (off: ~0 accepted); lookup drafts the copy.
    assert on_per_step >= 5 and on_per_step > off_per_step + 4, (off_per_step, on_per_step)
