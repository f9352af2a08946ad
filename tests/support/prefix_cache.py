"""Prefix-cache probes against a served `qwen3.8-27b`: token-id prompts (the tiny models'
1,000-token vocabulary), each sending's `cached_tokens`, and the hybrid block size the
engine logged. Shared by the CPU profile's tests and the GPU tier, and a command that prints
what they measure (patch 0077's figures in docs/patches.md):

    .venv/bin/python -m tests.support.prefix_cache --base-url http://127.0.0.1:18020 \
        --api-key-file secrets/api_key --lengths 1410 1500 1919 1920 2050 --resume
"""

from __future__ import annotations

import argparse
import random
import re
import uuid
from pathlib import Path

from core.settings import client_api_key
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


def alone_and_resumed(client: StackClient, tag: str) -> tuple[dict, dict]:
    """Greedy answers (16 tokens, logprobs) to a 2,700-token prompt, first with nothing cached,
    then after a 4,200-token prompt sharing its first 2,600 tokens has been served."""
    shared = token_prompt(7, 4200)
    other = shared[:2600] + token_prompt(8, 100)
    greedy = {"max_tokens": 16, "temperature": 0, "logprobs": 1}
    alone = complete(client, other, f"{tag}-alone", **greedy)
    complete(client, shared, f"{tag}-shared")
    resumed = complete(client, other, f"{tag}-shared", **greedy)
    return alone, resumed


def kv_block_tokens(log_text: str) -> int:
    """The hybrid's KV block size (attention raised to the mamba page), from the engine's log."""
    found = BLOCK_SIZE_LOG.search(log_text)
    assert found, "the engine did not log its hybrid block size"
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.prefix_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key-file", type=Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="*", default=[], help="prompt lengths to send repeatedly")
    parser.add_argument("--times", type=int, default=3, help="sendings of each prompt (default 3)")
    parser.add_argument("--resume", action="store_true", help="also compare a resumed answer with an uncached one")
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:8]  # a cache namespace of its own: a second run starts cold too
    with StackClient(args.base_url, client_api_key(key_file=args.api_key_file)) as client:
        for length in args.lengths:
            hits = sendings(client, token_prompt(length, length), f"{run}-{length}", args.times)
            print(f"{length} tokens: cached {', '.join(map(str, hits))}")
        if args.resume:
            alone, resumed = alone_and_resumed(client, run)
            expected, got = (a["choices"][0]["logprobs"]["token_logprobs"] for a in (alone, resumed))
            worst = max(abs(x - y) for x, y in zip(expected, got))
            print(f"resumed: cached {cached_tokens(resumed)}; largest logprob difference from uncached {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
