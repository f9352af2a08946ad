"""Lookup drafting on a document the tiny model really copies (docs/lookup.md).

The tiny target's lm_head maps each token to a fixed successor, so its greedy output is a
chain of tokens. The prompt is 1,200 tokens of that chain followed by its first 8 again:
the model continues the copy for the next 1,000 tokens. Prints one JSON line: tokens per
verify step (1 + accepted / drafts, from /metrics) and output tok/s.

    python -m tests.support.chain_copy BASE_URL KEY_FILE

`greedy_ids` and `chain_document` also serve tests/integration/test_cpu_speculation.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.stats import metric_delta
from entrypoint.client import StackClient

MODEL = "qwen3.8-27b"
DOCUMENT, REPEAT, OUTPUT = 1200, 8, 1000


def greedy_ids(client: StackClient, prompt: str | list[int], max_tokens: int) -> list[int]:
    """The token ids of a greedy completion of exactly ``max_tokens`` (EOS ignored)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return client.post_json("/v1/completions", body)["choices"][0]["token_ids"]


def chain_document(client: StackClient, document: int, repeat: int, follow: int) -> tuple[list[int], list[int]]:
    """(prompt, expected): ``document`` tokens of the model's own greedy chain, then its first
    ``repeat`` again; ``expected`` is the ``follow`` tokens the model then copies."""
    start = greedy_ids(client, "x", 1)
    chain = start + greedy_ids(client, start, document + follow)
    return chain[:document] + chain[:repeat], chain[repeat : repeat + follow]


def main(base_url: str, key_file: str) -> dict:
    with StackClient(base_url, Path(key_file).read_text().strip()) as client:
        prompt, expected = chain_document(client, DOCUMENT, REPEAT, OUTPUT)
        before = client.metrics()
        began = time.monotonic()
        out = greedy_ids(client, prompt, OUTPUT)
        seconds = time.monotonic() - began
        moved = metric_delta(before, client.metrics()).counters
    drafts, accepted = moved["drafts"], moved["accepted_tokens"]
    return {
        "prompt_tokens": len(prompt), "output_tokens": len(out), "copied": out == expected,
        "seconds": round(seconds, 3), "tok_s": round(len(out) / seconds, 1), "verify_steps": drafts,
        "tokens_per_step": round(1 + accepted / drafts, 3) if drafts else None,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
