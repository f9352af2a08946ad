"""Reproduction mode on the GPU: lookup drafting for DFlash2 on vLLM's V2 runner (patch 0072).

Two copies of the tiny `single` profile (tests/gpu/tiny_profiles.py: DFlash2 K=7 with
probabilistic drafting, prefix caching, CUDA graphs), served through `qwen38 serve` side by
side: lookup off (verify block 8) and LOOKUP=true (verify block 16 = 1 + 7 drafter + 8
lookup). Greedy outputs must be identical (lookup drafts are point masses: lossless), the
lookup server must verify 15 drafts per step, and on a document the tiny model copies
(tests/support/chain_copy.py: its lm_head maps each token to a fixed successor) it must
accept more tokens per verify step, greedy and sampled (SAMPLED_TEMPERATURE: the point masses
in the draft-logits cache). Tokens per step and tok/s go into the tier report
(tests/gpu/conftest.py) under `lookup.*`.

    source <(tests/gpu/lent_machine.sh env)
    python3 -m pytest -m gpu -rA -s tests/gpu/test_lookup_gpu.py
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.stats import metric_delta
from entrypoint.client import StackClient
from tests.conftest import launch_server, spec_decode_delta, stop_server, wait_ready
from tests.gpu.conftest import record
from tests.gpu.tiny_profiles import SHARE, TINY, derive, write_profiles
from tests.support.chain_copy import MODEL, chain_document, greedy_ids

pytestmark = pytest.mark.gpu

READY_TIMEOUT_S = 900
# Names of their own: the tier's `single-tiny` may be serving on the same CACHE_DIR (one
# supervisor per profile name there).
PROFILES = {"off": "single-lookup-off-tiny", "on": "single-lookup-on-tiny"}
PROMPTS = [
    "x",
    "The cache server keeps",
    "the cache the cache the cache the cache the",
    "def verify(path):\n    return path\ndef verify(path):\n    return",
    "one two three four five one two three four five one two",
]
# The copied document: 1,200 tokens of the model's own chain, then its first 8 again.
DOCUMENT, REPEAT, FOLLOW = 1200, 8, 400
# Sampled, not greedy (vLLM samples above 1e-5), yet sharp enough that the tiny model's sample
# is its chain token.
SAMPLED_TEMPERATURE = 0.01


def _profiles(directory: Path) -> Path:
    off = derive("single", TINY, extra_engine=SHARE)
    on = derive("single", TINY, extra_engine=SHARE)
    on["speculative"]["lookup"] = True  # VERIFY_BLOCK: the profile's 16
    return write_profiles(directory, {PROFILES["off"]: off, PROFILES["on"]: on})


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_root, api_key_file):
    """{"off": server, "on": server}, started side by side on one CACHE_DIR."""
    profiles_dir = _profiles(tmp_path_factory.mktemp("lookup-profiles"))
    given = os.environ.get("QWEN38_GPU_CACHE_DIR")
    cache_dir = Path(given) if given else tmp_path_factory.mktemp("lookup-cache")
    started = {
        mode: launch_server(
            tmp_path_factory.mktemp(f"lookup-{mode}"), tiny_root, api_key_file, profile, cache_dir=cache_dir,
            PROFILES_DIR=str(profiles_dir), READY_TIMEOUT=str(READY_TIMEOUT_S),
        )
        for mode, profile in PROFILES.items()
    }  # fmt: skip
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            ready = dict(zip(started, pool.map(lambda s: wait_ready(s, timeout=READY_TIMEOUT_S), started.values())))
        for mode, server in ready.items():
            record(f"lookup.{mode}.ready_s", round(server.seconds_to_ready, 1))
        yield ready
    finally:
        stop_server(*started.values())


def _copy_prompt(server) -> tuple[list[int], list[int]]:
    with StackClient(server.base_url, server.api_key) as client:
        return chain_document(client, DOCUMENT, REPEAT, FOLLOW)


def _copy_run(server, prompt: list[int], temperature: float) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": FOLLOW, "temperature": temperature,
            "ignore_eos": True, "return_token_ids": True}
    if temperature:
        body["seed"] = 1234
    with StackClient(server.base_url, server.api_key) as client:
        before = client.metrics()
        began = time.monotonic()
        out = client.post_json("/v1/completions", body)["choices"][0]["token_ids"]
        seconds = time.monotonic() - began
        moved = metric_delta(before, client.metrics()).counters
    drafts = moved["drafts"]
    assert drafts > 0
    return {
        "tokens": out, "verify_steps": drafts, "drafts_per_step": moved["draft_tokens"] / drafts,
        "accepted_per_step": round(moved["accepted_tokens"] / drafts, 3),
        "tokens_per_step": round(1 + moved["accepted_tokens"] / drafts, 3),
        "tok_s": round(len(out) / seconds, 1),
    }


def test_the_lookup_server_verifies_the_16_token_block(servers):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}
    off = spec_decode_delta(servers["off"], body)
    on = spec_decode_delta(servers["on"], body)
    record("lookup.spec", {"off": off, "on": on})
    assert off["drafts"] > 0 and off["draft_tokens"] == 7 * off["drafts"]
    assert on["drafts"] > 0 and on["draft_tokens"] == 15 * on["drafts"]  # 7 drafter + 8 lookup


def test_greedy_output_is_identical_with_lookup_on_and_off(servers):
    copy_prompt, _ = _copy_prompt(servers["off"])
    with StackClient(servers["off"].base_url, servers["off"].api_key) as off, \
            StackClient(servers["on"].base_url, servers["on"].api_key) as on:
        for prompt in [*PROMPTS, copy_prompt]:
            assert greedy_ids(on, prompt, 64) == greedy_ids(off, prompt, 64), prompt


def test_lookup_accepts_more_tokens_per_verify_step_on_a_copied_document(servers):
    prompt, expected = _copy_prompt(servers["off"])
    off = _copy_run(servers["off"], prompt, 0.0)
    on = _copy_run(servers["on"], prompt, 0.0)
    record("lookup.copy_greedy", {mode: {k: v for k, v in run.items() if k != "tokens"}
                                  for mode, run in (("off", off), ("on", on))})
    print(f"copy, greedy: off {off['tokens_per_step']} tokens/step, on {on['tokens_per_step']}", flush=True)
    assert off["tokens"] == on["tokens"] == expected  # the model copies the document either way
    assert (off["drafts_per_step"], on["drafts_per_step"]) == (7, 15)
    # The tiny drafter is random (off: ~1 token per step); lookup drafts the copy.
    assert on["accepted_per_step"] >= 8 and on["accepted_per_step"] > off["accepted_per_step"] + 6, (off, on)


def test_sampled_requests_accept_lookup_point_masses_on_a_copied_document(servers):
    """Sampled requests (probabilistic drafting): lookup positions are verified against point
    masses in the draft-logits cache, on the GPU runner with CUDA graphs. At temperature 1 the
    tiny random model's distribution is nearly flat (2026-12-02, H200: 1 of 400 sampled tokens
    followed the copy, lookup on or off), so nothing can be copied; at SAMPLED_TEMPERATURE its
    sample is the chain token, and the sampled path must accept the copy like greedy does."""
    prompt, expected = _copy_prompt(servers["off"])
    off = _copy_run(servers["off"], prompt, SAMPLED_TEMPERATURE)
    on = _copy_run(servers["on"], prompt, SAMPLED_TEMPERATURE)
    same = {mode: sum(a == b for a, b in zip(run["tokens"], expected)) for mode, run in (("off", off), ("on", on))}
    record("lookup.copy_sampled", {mode: {**{k: v for k, v in run.items() if k != "tokens"},
                                          "temperature": SAMPLED_TEMPERATURE,
                                          "tokens_equal_to_the_copy": f"{same[mode]}/{FOLLOW}"}
                                   for mode, run in (("off", off), ("on", on))})
    print(f"copy, T={SAMPLED_TEMPERATURE}: off {off['tokens_per_step']} tokens/step, on {on['tokens_per_step']}",
          flush=True)
    assert len(on["tokens"]) == len(off["tokens"]) == FOLLOW
    # The premise: sampled without lookup, the model still copies (else no drafter could).
    assert same["off"] >= 0.9 * FOLLOW, f"only {same['off']}/{FOLLOW} sampled tokens follow the copy: lower the temperature"
    assert on["accepted_per_step"] >= 8 and on["accepted_per_step"] > off["accepted_per_step"] + 6, (off, on)
