"""Prefix-cache probes against a served `qwen3.8-27b`: token-id prompts (the tiny models'
1,000-token vocabulary), each sending's `cached_tokens`, and the hybrid block size the
engine logged. Shared by the CPU profile's tests and the GPU tier."""

from __future__ import annotations

import random
import re

from entrypoint.client import StackClient

BLOCK_SIZE_LOG = re.compile(r"Setting attention block size to (\d+) tokens")


def token_prompt(seed: int, length: int) -> list[int]:
    """A prompt of token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(10, 990) for _ in range(length)]


def complete(client: StackClient, prompt: list[int], salt: str, **extra) -> dict:
    """One completion of `prompt` in the cache namespace `salt` (nothing else shares it)."""
    body = {"model": "qwen3.8-27b", "prompt": prompt, "max_tokens": 1, "cache_salt": salt, **extra}
    return client.post_json("/v1/completions", body)


def cached_tokens(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def sendings(client: StackClient, prompt: list[int], salt: str, times: int) -> list[int]:
    """`cached_tokens` of each of `times` sendings of the same prompt, one after another."""
    return [cached_tokens(complete(client, prompt, salt)) for _ in range(times)]


def kv_block_tokens(log_text: str) -> int:
    """The hybrid's KV block size (attention raised to the mamba page), from the engine's log."""
    found = BLOCK_SIZE_LOG.search(log_text)
    assert found, "the engine did not log its hybrid block size"
    return int(found.group(1))
