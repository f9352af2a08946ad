"""`qwen38 validate cache-isolation`: prefix caching reuses within an identity, never across.

With a fresh, long, unique prefix (a random nonce first, so a second run never meets the
first run's blocks), four requests in order:

    base first      -> 0 prefix-cache hits      base repeat     -> > 0 hits
    adapter first   -> 0 hits (base blocks exist, but not for this identity)
    adapter repeat  -> > 0 hits

Where the server serves one id (no adapter), the first two requests are the whole check:
reuse within the base.

Hits are deltas of `vllm:prefix_cache_hits_total` (labelled with the base name even for
adapter requests, so the delta is taken over all labels) and, per request,
`usage.prompt_tokens_details.cached_tokens`. Run it on an otherwise idle server.
"""

from __future__ import annotations

import secrets
import time

import httpx

from entrypoint.client import StackClient
from entrypoint.validate.report import Report

HITS = "vllm:prefix_cache_hits_total"
DEFAULT_PREFIX_TOKENS = 6000  # a few KV blocks even where hybrid pages promote the block size
_WORDS = (
    "river stone lantern copper meadow harbor signal orchard ledger canvas quartz willow beacon "
    "tunnel ember glacier saddle thimble compass mosaic vessel garnet prairie cobalt falcon"
).split()


def unique_prefix(client: StackClient, model: str, tokens: int) -> str:
    """Nonce + filler words: the longest such text the server's tokenizer counts <= ``tokens``."""
    nonce = secrets.token_hex(8)

    def text(n: int) -> str:
        filler = (f"{_WORDS[i % len(_WORDS)]}{i % 97}" for i in range(n))
        return f"Session {nonce}. " + " ".join(filler)

    def count(n: int) -> int:
        return len(client.post_json("/tokenize", {"model": model, "prompt": text(n)})["tokens"])

    low, high = 0, 64
    while count(high) <= tokens:
        low, high = high, high * 2
    while high - low > 1:  # count(low) <= tokens < count(high)
        mid = (low + high) // 2
        low, high = (mid, high) if count(mid) <= tokens else (low, mid)
    return text(low)


def settled_hits(client: StackClient, previous: float | None = None) -> float:
    """Read the counter until two reads agree (metrics trail the response slightly)."""
    last = client.metrics().total(HITS)
    for _ in range(20):
        time.sleep(0.1)
        now = client.metrics().total(HITS)
        if now == last and (previous is None or now >= previous):
            return now
        last = now
    return last


def _one_request(client: StackClient, model: str, prompt: str) -> int:
    data = client.post_json("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    details = data["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def validate_cache_isolation(
    client: StackClient, base: str, adapter: str | None, prefix_tokens: int = DEFAULT_PREFIX_TOKENS
) -> Report:
    report = Report("validate cache-isolation", client.base_url)
    response = client.get("/v1/models")
    if response.status_code != 200:
        report.add("list models", "-", False, f"/v1/models answered {response.status_code} (wrong or missing key?)")
        return report
    listed = {entry["id"]: entry for entry in response.json()["data"]}
    for model in filter(None, (base, adapter)):
        if model not in listed:
            report.add("listed in /v1/models", model, False, f"/v1/models lists {sorted(listed)}")
            return report
    limit = int(listed[base].get("max_model_len") or prefix_tokens + 256)
    tokens = min(prefix_tokens, limit - 256)
    prompt = unique_prefix(client, base, tokens) + " Answer:"
    steps = [("base first", base, False), ("base repeat", base, True)]
    if adapter is not None:
        steps += [("adapter first after base", adapter, False), ("adapter repeat", adapter, True)]
    hits = settled_hits(client)
    for name, model, expect_hits in steps:
        try:
            cached = _one_request(client, model, prompt)
        except httpx.HTTPError as exc:
            report.add(name, model, False, str(exc)[:300])
            return report
        now = settled_hits(client, hits)
        delta, hits = now - hits, now
        ok = (delta > 0 and cached > 0) if expect_hits else (delta == 0 and cached == 0)
        want = "> 0" if expect_hits else "0"
        report.add(
            name, model, ok, f"hits delta {delta:.0f}, cached_tokens {cached} (want {want})",
            hits_delta=delta, cached_tokens=cached,
        )
    if not report.checks[1].outcome == "pass":
        report.checks[1].detail += "; is prefix caching on (PREFIX_CACHING)?"
    return report
