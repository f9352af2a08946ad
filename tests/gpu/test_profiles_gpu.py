"""The GPU profiles served for real through the entrypoint, at tiny-model scale.

`single`, `long` and `spark-lora` keep every engine setting (DFlash2 K=7 with probabilistic
drafting, bf16 / int8_per_token_head / fp8 KV, prefix caching, CUDA graphs, LoRA, FlashInfer
autotune off, the drafter's attention backend) with their model slots pointed at `qwen38
tiny`'s models (tests/gpu/tiny_profiles.py). Each is started with `qwen38 serve` (verify, plan,
launch, readiness gate), then checked with `qwen38 validate apis`, `qwen38 validate
cache-isolation`, a repeated prompt's hits and a short `qwen38 bench c1`; drafts are counted
in /metrics and greedy outputs must be the same with speculation off. The pool `qwen38 serve`
planned must be the pool each engine logs, for these servers and, started eagerly until the
engine has logged its pool, for the other combinations of prefix caching and speculation.
Last, each is stopped and started again on the same CACHE_DIR: the warm start.

Start order: `single` first, alone, so the JIT caches every profile shares (FlashInfer's,
under CACHE_DIR) are filled once; then the other three side by side while `single` is checked.
All of them share one CACHE_DIR (``QWEN38_GPU_CACHE_DIR``, default a temporary directory), so
a later run on the same machine, or one given the cache carried in, starts warm. Ready
seconds, counters and figures go into the tier report (tests/gpu/conftest.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from entrypoint.client import StackClient
from tests.conftest import run_cli, spec_decode_delta, stop_server
from tests.gpu.conftest import record
from tests.gpu.tiny_profiles import SHARE, TINY, TinyServers, check_plan_is_engine_pool, derive, write_profiles
from tests.support.chain_copy import greedy_ids
from tests.support.kv_pool import serve_until_pool_logged
from tests.support.prefix_cache import kv_block_tokens, sendings, token_prompt

pytestmark = pytest.mark.gpu

PROFILES = ("single", "long", "spark-lora")
PROMPTS = ["x", "The cache server keeps", "def verify(path):", "Tell me about the draft model and the queue."]
READY_TIMEOUT_S = 900
# profile file -> (the real profile it copies, its slots, engine changes)
TIER = {
    "single-tiny": ("single", TINY, {}),
    "single-nospec-tiny": ("single", TINY, {}),
    "long-tiny": ("long", TINY, {}),
    "spark-lora-tiny": ("spark-lora", dict(TINY, adapter="tiny/adapter"), {}),
}
KEYS = {"single": "single-tiny", "single-nospec": "single-nospec-tiny", "long": "long-tiny",
        "spark-lora": "spark-lora-tiny"}


def tier_profiles() -> dict[str, dict]:
    data = {}
    for name, (real, slots, engine) in TIER.items():
        data[name] = derive(real, slots, extra_engine={**SHARE, **engine})
    # `single` with speculation off: the lossless reference, its own profile (own status file).
    data["single-nospec-tiny"]["speculative"]["enabled"] = False
    return data


# The tier made in this session, if any: the eager pool checks stop its servers first, and
# run without it when selected alone (`-k test_plan_equals_the_cuda_engine_with`).
STARTED: list[TinyServers] = []


@pytest.fixture(scope="session")
def tier(tmp_path_factory, tiny_root, api_key_file):
    tier = TinyServers(tmp_path_factory, tiny_root, api_key_file, tier_profiles(),
                       {key: (name, {}) for key, name in KEYS.items()})
    STARTED.append(tier)
    with tier.started("single", "single-nospec", "long", "spark-lora"):
        yield tier


@pytest.fixture
def server(tier, request):
    return tier.gated(request.param)


def _cli(server, *args: str, timeout: float = 600):
    done = run_cli(*args, "--base-url", server.base_url, "--api-key", server.api_key, env=server.env, timeout=timeout)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _served(server) -> list[str]:
    with StackClient(server.base_url, server.api_key) as client:
        return sorted(client.model_ids())


def _greedy(server) -> list[list[int]]:
    with StackClient(server.base_url, server.api_key) as client:
        return [greedy_ids(client, p, 48) for p in PROMPTS]


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_profile_passes_the_gate_with_the_patched_engine_and_its_plan(server):
    status = server.status()
    assert status["ready"] is True
    assert "patches=" in status["identity"] and "vllm=0.28.0" in status["identity"]
    log = server.log.read_text(errors="replace")
    assert "(patched vLLM)" in log, log[-3000:]  # the planner ran on the CUDA build, patched
    expected = ["qwen3.8-27b", "qwen3.8-27b-mode-b"] if server.profile.startswith("spark") else ["qwen3.8-27b"]
    assert _served(server) == expected


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_validate_apis(server):
    _cli(server, "validate", "apis")


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_validate_cache_isolation(server):
    _cli(server, "validate", "cache-isolation")


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_a_repeated_prompt_hits_the_cache_on_its_second_sending(server):
    """A repeat reuses on its second sending all the cache will ever give it (on CPU this needed
    patch 0077; the CUDA platform keeps the engine's resolved block size by itself). Four blocks
    and a part: with DFlash2, an EAGLE-style drafter, the last matching block is given up."""
    block = kv_block_tokens(server.log.read_text(errors="replace"))
    length = 4 * block + 130
    with StackClient(server.base_url, server.api_key) as client:
        hits = sendings(client, token_prompt(length, length), f"repeat-{server.profile}", 3)
    record(f"{server.profile.removesuffix('-tiny')}.repeat_hits", {"length": length, "block": block, "cached": hits})
    assert hits[0] == 0 and hits[1] == hits[2] > 0 and hits[1] % block == 0, hits


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_bench_c1(server, tmp_path):
    out = tmp_path / "c1.json"
    _cli(
        server, "bench", "c1", "--model", "qwen3.8-27b", "--input-tokens", "256", "--output-tokens", "256",
        "--requests", "3", "--out", str(out),
    )
    result = json.loads(out.read_text())
    record(f"{server.profile.removesuffix('-tiny')}.bench_c1", result.get("summary", result))


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_drafts_are_proposed_and_verified(server):
    moved = spec_decode_delta(
        server, {"model": "qwen3.8-27b", "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}
    )
    record(f"{server.profile.removesuffix('-tiny')}.spec", moved)
    assert moved["drafts"] > 0 and moved["draft_tokens"] == 7 * moved["drafts"]  # K=7 in every GPU profile


def test_speculation_is_lossless_on_the_gpu(tier):
    """The DFlash2 drafter (K=7) verified on CUDA gives the target's own greedy tokens, and
    so does every profile's engine (KV dtype, CUDA graphs) for the tiny base's wide margins."""
    for key in KEYS:
        tier.gated(key)
    plain = _greedy(tier.servers["single-nospec"])
    assert _greedy(tier.servers["single"]) == plain  # the same engine but for the drafter: exact
    for name in ("long", "spark-lora"):
        # Another KV dtype (int8 per token-head, fp8) may break a late near-tie differently.
        got = _greedy(tier.servers[name])
        same = sum(a == b for g, p in zip(got, plain) for a, b in zip(g, p))
        record(f"{name}.greedy_tokens_equal_to_bf16_nospec", f"{same}/{sum(map(len, plain))}")
        assert [g[:16] for g in got] == [p[:16] for p in plain], name


@pytest.mark.parametrize("key", [*PROFILES, "single-nospec"])
def test_plan_equals_the_pool_the_cuda_engine_logs(tier, key):
    """What `qwen38 serve` planned before it started vLLM is the pool the engine then built."""
    check_plan_is_engine_pool(tier.gated(key).log.read_text(errors="replace"), key)


@pytest.mark.parametrize("key", PROFILES)
def test_a_warm_start_reuses_the_plan_and_the_compiled_graphs(tier, key):
    """Stopped and started again on the same CACHE_DIR: the plan is reused and vLLM loads its
    compiled graphs from the cache instead of compiling (the ready seconds go to the report)."""
    stop_server(tier.servers[key])
    server = tier.launch(key, "warm")
    tier.gate(key, "warm")
    log = server.log.read_text(errors="replace")
    assert "plan reused" in log, log[-3000:]
    assert "from the cache" in log or "Directly load" in log, log[-3000:]
    stop_server(server)


# (profile, prefix caching, speculation) the gated servers above do not run.
OTHER_COMBINATIONS = [
    (name, prefix_caching, speculation)
    for name in PROFILES
    for prefix_caching, speculation in ((False, True), (False, False), (True, False))
    if (name, prefix_caching, speculation) != ("single", True, False)  # single-nospec
]


@pytest.fixture(scope="module")
def pool_logs(tmp_path_factory, tiny_root, api_key_file):
    """(profile, prefix caching, speculation) -> the log of a `qwen38 serve --no-ready-gate` of
    that tiny profile, stopped once the engine logged its KV pool. Eager (no compile, no CUDA
    graphs) to keep eight starts cheap: the pool is pinned in bytes, so graphs do not change it
    (the gated servers, with graphs, check that part). They run after the warm starts, when
    the tier's own servers (if started) are stopped, four at a time."""
    for tier in STARTED:
        tier.stop_all()
    profiles_dir = tmp_path_factory.mktemp("profiles-eager")
    data = {}
    for name in PROFILES:
        slots = dict(TINY, adapter="tiny/adapter") if name == "spark-lora" else TINY
        data[f"{name}-eager"] = derive(name, slots, extra_engine={**SHARE, "enforce_eager": True})
    write_profiles(profiles_dir, data)

    def start(case):
        name, prefix_caching, speculation = case
        tmp = tmp_path_factory.mktemp(f"{name}-pc{int(prefix_caching)}-spec{int(speculation)}")
        return serve_until_pool_logged(
            tmp, tiny_root, api_key_file, f"{name}-eager", timeout=900, PROFILES_DIR=str(profiles_dir),
            PREFIX_CACHING=str(prefix_caching).lower(), SPECULATION=str(speculation).lower(),
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(OTHER_COMBINATIONS, pool.map(start, OTHER_COMBINATIONS), strict=True))


@pytest.mark.parametrize("case", OTHER_COMBINATIONS, ids=lambda c: f"{c[0]}-pc{int(c[1])}-spec{int(c[2])}")
def test_plan_equals_the_cuda_engine_with_prefix_caching_and_speculation_on_and_off(pool_logs, case):
    check_plan_is_engine_pool(pool_logs[case], f"{case[0]}.pc{int(case[1])}.spec{int(case[2])}")
