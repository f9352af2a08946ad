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
import os
from pathlib import Path

import pytest

from entrypoint.client import StackClient
from tests.conftest import launch_server, run_cli, spec_decode_delta, stop_server, wait_ready
from tests.gpu.conftest import record
from tests.gpu.tiny_profiles import TINY, derive, write_profiles
from tests.support.chain_copy import greedy_ids
from tests.support.kv_pool import pools

pytestmark = pytest.mark.gpu

READY_TIMEOUT_S = 900
# Four tiny engines side by side: a tenth of an H100 each (the pool is pinned in bytes).
SHARE = {"gpu_memory_utilization": 0.1}
PROMPTS = ["x", "The cache server keeps", "def verify(path):", "Tell me about the draft model and the queue."]
MTP = {"SPECULATION": "mtp"}
# key -> (profile file, the real profile it copies, its slots, qwen38 serve's settings)
SERVED = {
    "single-nospec": ("single-nospec-tiny", "single", TINY, {"SPECULATION": "false"}),
    "single-mtp": ("single-tiny", "single", TINY, MTP),
    "long-mtp": ("long-tiny", "long", TINY, MTP),
    "batch": ("batch-tiny", "batch", {"target": TINY["target"]}, {}),
}


class Servers:
    def __init__(self, factory, models, key_file):
        self.factory, self.models, self.key_file = factory, models, key_file
        data = {}
        for name, real, slots, _ in SERVED.values():
            data[name] = derive(real, slots, extra_engine=SHARE)
        self.profiles_dir = write_profiles(factory.mktemp("profiles"), data)
        given = os.environ.get("QWEN38_GPU_CACHE_DIR")
        self.cache_dir = Path(given) if given else factory.mktemp("cache")
        self.running = {}

    def launch(self, key: str):
        name, _, _, settings = SERVED[key]
        self.running[key] = launch_server(
            self.factory.mktemp(key), self.models, self.key_file, name, cache_dir=self.cache_dir,
            PROFILES_DIR=str(self.profiles_dir), READY_TIMEOUT=str(READY_TIMEOUT_S), **settings,
        )

    def gated(self, key: str):
        server = self.running[key]
        if server.seconds_to_ready == 0.0:
            wait_ready(server, timeout=READY_TIMEOUT_S)
            record(f"many-users.{key}.ready_s", round(server.seconds_to_ready, 1))
            print(f"{key}: gated in {server.seconds_to_ready:.0f} s", flush=True)
        return server


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_root, api_key_file):
    """The lossless reference first, alone (it fills the shared JIT caches), then the rest side by side."""
    s = Servers(tmp_path_factory, tiny_root, api_key_file)
    try:
        s.launch("single-nospec")
        s.gated("single-nospec")
        for key in ("single-mtp", "long-mtp", "batch"):
            s.launch(key)
        yield s
    finally:
        stop_server(*s.running.values())


def _greedy(server) -> list[list[int]]:
    with StackClient(server.base_url, server.api_key) as client:
        return [greedy_ids(client, p, 48) for p in PROMPTS]


def _cli(server, *args: str, timeout: float = 900):
    done = run_cli(*args, "--base-url", server.base_url, "--api-key", server.api_key, env=server.env, timeout=timeout)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


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
    found = pools(servers.gated(key).log.read_text(errors="replace"))
    record(f"many-users.{key}.pool_tokens", {"planned": found.planned_tokens, "engine": found.engine_tokens})
    assert (found.planned_tokens, found.planned_concurrency) == (found.engine_tokens, found.engine_concurrency)


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
