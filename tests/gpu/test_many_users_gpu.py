"""Many users on the GPU at tiny size (issue 55): `single` and `long` served with the target's
own MTP head, and `batch` with 64 requests in flight.

Every engine setting of the real profiles is kept (tests/gpu/tiny_profiles.py). `single` and
`long` are started with ``SPECULATION=mtp`` in `qwen38 serve`'s environment, as an owner sets
it: no drafter directory is read, the tiny target's MTP head drafts MTP_DEPTH's default 4 tokens
a step, greedy output must be `single`'s with speculation off (the lossless reference, served
beside them), and the pool `qwen38 serve` planned must be the engine's. `batch` (64 slots, fp8
KV, prefix caching, W4A8 in its environment, CUDA graphs to 64) passes the gate and `validate
apis`, then takes `qwen38 bench users` with 64 requests in flight: every one answered, none
preempted, at the context it plans.

The tiny target is bf16, so `batch`'s ``VLLM_MARLIN_INPUT_DTYPE=int8`` finds no Marlin layer
here; the W4A8 kernels are proven on a W4A16 tiny target in `test_w4a8_marlin_answers_as_w4a16`.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import spec_decode_delta
from tests.gpu.conftest import record
from tests.gpu.test_profiles_gpu import PROMPTS, _cli, _greedy
from tests.gpu.tiny_profiles import TINY, TinyServers, check_plan_is_engine_pool, derive

pytestmark = pytest.mark.gpu

# Four tiny engines side by side: a tenth of an H100 each (the pool is pinned in bytes).
SHARE = {"gpu_memory_utilization": 0.1}
MTP = {"SPECULATION": "mtp"}
# key -> (profile file, the real profile it copies, its slots, qwen38 serve's settings)
SERVED = {
    "single-nospec": ("single-nospec-tiny", "single", TINY, {"SPECULATION": "false"}),
    "single-mtp": ("single-tiny", "single", TINY, MTP),
    "long-mtp": ("long-tiny", "long", TINY, MTP),
    "batch": ("batch-tiny", "batch", {"target": TINY["target"]}, {}),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_root, api_key_file):
    """The lossless reference first, alone (it fills the shared JIT caches), then the rest side by side."""
    profiles = {name: derive(real, slots, extra_engine=SHARE) for name, real, slots, _ in SERVED.values()}
    s = TinyServers(tmp_path_factory, tiny_root, api_key_file, profiles,
                    {key: (name, settings) for key, (name, _, _, settings) in SERVED.items()}, label="many-users.")
    with s.started("single-nospec", "single-mtp", "long-mtp", "batch"):
        yield s


@pytest.mark.parametrize("key", ["single-mtp", "long-mtp"])
def test_mtp_drafts_with_the_targets_head_and_reads_no_drafter(servers, key):
    server = servers.gated(key)
    log = server.log.read_text(errors="replace")
    assert "Qwen3_5MTP" in log, log[-3000:]  # vLLM resolved the speculator to the target's own head
    moved = spec_decode_delta(server, {"model": "qwen3.8-27b", "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0})
    record(f"many-users.{key}.spec", moved)
    assert moved["drafts"] > 0 and moved["draft_tokens"] == 4 * moved["drafts"]  # MTP_DEPTH's default


def test_mtp_is_lossless_on_the_gpu(servers):
    """`single` with MTP gives the speculation-off engine's greedy tokens exactly; `long`
    (int8 per-token-head KV) may break a late near-tie differently, so its first 16 must agree."""
    plain = _greedy(servers.gated("single-nospec"))
    assert _greedy(servers.gated("single-mtp")) == plain
    got = _greedy(servers.gated("long-mtp"))
    same = sum(a == b for g, p in zip(got, plain) for a, b in zip(g, p))
    record("many-users.long-mtp.greedy_tokens_equal_to_bf16_nospec", f"{same}/{sum(map(len, plain))}")
    assert [g[:16] for g in got] == [p[:16] for p in plain]


@pytest.mark.parametrize("key", list(SERVED))
def test_plan_equals_the_pool_the_cuda_engine_logs(servers, key):
    check_plan_is_engine_pool(servers.gated(key).log.read_text(errors="replace"), f"many-users.{key}")


@pytest.mark.parametrize("key", ["single-mtp", "long-mtp", "batch"])
def test_validate_apis(servers, key):
    _cli(servers.gated(key), "validate", "apis")


def test_batch_answers_64_users_at_once_and_preempts_none(servers, tmp_path):
    """64 requests in flight, each the shared system prompt and a message of its own, filling
    all 64 slots: every one answered in full, and vLLM preempted none for want of KV pages."""
    server = servers.gated("batch")
    out = tmp_path / "users.json"
    _cli(server, "bench", "users", "--model", "qwen3.8-27b", "--concurrency", "64", "--rounds", "1",
         "--system-tokens", "1500", "--prompt-tokens", "400", "--output-tokens", "128", "--out", str(out))
    doc = json.loads(out.read_text())
    point = doc["points"][0]
    record("many-users.batch.c64", {k: point.get(k) for k in ("output_tok_s", "decode_tok_s", "ttft_s", "preemptions")})
    summary = point["summary"]
    assert point["concurrency"] == 64 and summary["requests"] == 64, json.dumps(summary)[:2000]
    assert summary["completion_tokens"] == 64 * 128  # every request ran to its length (EOS ignored)
    assert point["preemptions"] == 0
    assert doc["consistent"] is True
