"""Lookup drafting on a document the tiny model really copies (docs/lookup.md).

The tiny target's lm_head maps each token to a fixed successor, so its greedy output is a
chain of tokens. The prompt is 1,200 tokens of that chain followed by its first 8 again:
the model continues the copy for the next 1,000 tokens. Prints one JSON line: tokens per
verify step (1 + accepted / drafts, from /metrics) and output tok/s.

    python -m tests.support.chain_copy BASE_URL KEY_FILE
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from entrypoint.client import StackClient

MODEL = "qwen3.8-27b"
DOCUMENT, REPEAT, OUTPUT = 1200, 8, 1000


def main(base_url: str, key_file: str) -> dict:
    with StackClient(base_url, Path(key_file).read_text().strip()) as client:
        def complete(prompt, max_tokens: int) -> list[int]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            return client.post_json("/v1/completions", body)["choices"][0]["token_ids"]

        start = complete("x", 1)
        chain = start + complete(start, DOCUMENT + OUTPUT)
        prompt = chain[:DOCUMENT] + chain[:REPEAT]
        names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
        before = client.metrics()
        began = time.monotonic()
        out = complete(prompt, OUTPUT)
        seconds = time.monotonic() - began
        after = client.metrics()
    drafts, accepted = (after.total(n) - before.total(n) for n in names)
    return {
        "prompt_tokens": len(prompt), "output_tokens": len(out), "copied": out == chain[REPEAT:REPEAT + OUTPUT],
        "seconds": round(seconds, 3), "tok_s": round(len(out) / seconds, 1), "verify_steps": drafts,
        "tokens_per_step": round(1 + accepted / drafts, 3) if drafts else None,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
