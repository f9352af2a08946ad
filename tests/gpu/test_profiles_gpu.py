"""The GPU profiles served for real through the entrypoint, at tiny-model scale.

`single`, `long` and `spark-lora` keep every engine setting (DFlash2 K=7 with probabilistic
drafting, bf16 / int8_per_token_head / fp8 KV, prefix caching, CUDA graphs, LoRA, FlashInfer
autotune off) with their model slots pointed at `qwen38 tiny`'s models (tests/gpu/
tiny_profiles.py). Each is started with `qwen38 serve` (verify, plan, launch, readiness
gate), then checked with `qwen38 validate apis`, `qwen38 validate cache-isolation` and a
short `qwen38 bench c1`; greedy outputs must be the same with speculation off. The pool
`qwen38 serve` planned must be the pool each engine logs, for these servers and, started
eagerly until the engine has logged its pool, for the other combinations of prefix caching
and speculation.

The servers start side by side (one H100/H200 holds them all; cold starts are CPU-bound
compiles), so the tier costs one cold start instead of four. Run by `make gpu-test`.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from entrypoint.client import StackClient
from tests.conftest import launch_server, run_cli, spec_decode_delta, stop_server, wait_ready
from tests.gpu.tiny_profiles import derive, write_profiles
from tests.support.chain_copy import greedy_ids
from tests.support.kv_pool import pools, serve_until_pool_logged

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and the CUDA build of vLLM 0.28.0"),
]

PROFILES = ("single", "long", "spark-lora")
TINY = {"target": "tiny/target", "drafter": "tiny/drafter2"}
# Four engines share one GPU: each asks for a slice at start-up (the KV pool is pinned by bytes).
SHARE = {"gpu_memory_utilization": 0.15}
PROMPTS = ["x", "The cache server keeps", "def verify(path):", "Tell me about the draft model and the queue."]
REPORT = os.environ.get("QWEN38_GPU_REPORT")


def _engine_extra(name: str) -> dict:
    """On Hopper (sm_90) vLLM 0.28.0 picks FlashInfer for fp8 KV and then refuses the DFlash2
    drafter's sliding-window layers (measured on the H100, docs/gpu.md): pin Triton attention
    there. The Spark (sm_121) and the 3090 (sm_86) keep the profile's own choice."""
    if name == "spark-lora" and torch.cuda.get_device_capability(0)[0] == 9:
        return {"attention_backend": "TRITON_ATTN"}
    return {}


def _record(key: str, value) -> None:
    """Adds one result to the tier's JSON report (docs/gpu.md is written from it)."""
    if not REPORT:
        return
    path = Path(REPORT)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


@pytest.fixture(scope="session")
def gpu_servers(tmp_path_factory, tiny_root, api_key_file):
    """name -> a gated server: the three tiny GPU profiles and `single` with speculation off."""
    profiles_dir = tmp_path_factory.mktemp("profiles")
    data = {}
    for name in PROFILES:
        slots = dict(TINY, adapter="tiny/adapter") if name == "spark-lora" else TINY
        data[f"{name}-tiny"] = derive(name, slots, extra_engine={**SHARE, **_engine_extra(name)})
    write_profiles(profiles_dir, data)
    launches = {
        name: (f"{name}-tiny", {}) for name in PROFILES
    } | {"single-nospec": ("single-tiny", {"SPECULATION": "false"})}
    servers = {}
    try:
        for key, (profile, settings) in launches.items():
            servers[key] = launch_server(
                tmp_path_factory.mktemp(key), tiny_root, api_key_file, profile, PROFILES_DIR=str(profiles_dir),
                READY_TIMEOUT="900", **settings,
            )
        for key, server in servers.items():
            wait_ready(server, timeout=900)
            _record(f"{key}.seconds_to_ready", round(server.seconds_to_ready, 1))
            print(f"{key}: ready in {server.seconds_to_ready:.0f} s")
        yield servers
    finally:
        for server in servers.values():
            stop_server(server)


def _cli(server, *args: str, timeout: float = 600):
    done = run_cli(*args, "--base-url", server.base_url, "--api-key", server.api_key, env=server.env, timeout=timeout)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _served(server) -> list[str]:
    with StackClient(server.base_url, server.api_key) as client:
        return sorted(client.model_ids())


@pytest.mark.parametrize("name", PROFILES)
def test_profile_passes_the_gate_with_the_patched_engine_and_its_plan(gpu_servers, name):
    server = gpu_servers[name]
    status = server.status()
    assert status["ready"] is True
    assert "patches=" in status["identity"] and "vllm=0.28.0" in status["identity"]
    log = server.log.read_text(errors="replace")
    assert "(patched vLLM)" in log, log[-3000:]  # the planner ran on the CUDA build, patched
    expected = ["qwen3.8-27b", "qwen3.8-27b-mode-b"] if name == "spark-lora" else ["qwen3.8-27b"]
    assert _served(server) == expected


@pytest.mark.parametrize("name", PROFILES)
def test_validate_apis(gpu_servers, name):
    _cli(gpu_servers[name], "validate", "apis")


@pytest.mark.parametrize("name", PROFILES)
def test_validate_cache_isolation(gpu_servers, name):
    _cli(gpu_servers[name], "validate", "cache-isolation")


@pytest.mark.parametrize("name", PROFILES)
def test_bench_c1(gpu_servers, name, tmp_path):
    out = tmp_path / "c1.json"
    _cli(
        gpu_servers[name], "bench", "c1", "--model", "qwen3.8-27b", "--input-tokens", "256", "--output-tokens", "256",
        "--requests", "3", "--out", str(out),
    )
    result = json.loads(out.read_text())
    _record(f"{name}.bench_c1", result.get("summary", result))


@pytest.mark.parametrize("name", PROFILES)
def test_drafts_are_proposed_and_verified(gpu_servers, name):
    moved = spec_decode_delta(
        gpu_servers[name], {"model": "qwen3.8-27b", "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}
    )
    _record(f"{name}.spec", moved)
    assert moved["drafts"] > 0 and moved["draft_tokens"] == 7 * moved["drafts"]  # K=7 in every GPU profile


def _greedy(server) -> list[list[int]]:
    with StackClient(server.base_url, server.api_key) as client:
        return [greedy_ids(client, p, 48) for p in PROMPTS]


def test_speculation_is_lossless_on_the_gpu(gpu_servers):
    """The DFlash2 drafter (K=7) verified on CUDA gives the target's own greedy tokens, and
    so does every profile's engine (KV dtype, CUDA graphs) for the tiny base's wide margins."""
    plain = _greedy(gpu_servers["single-nospec"])
    assert _greedy(gpu_servers["single"]) == plain  # the same engine but for the drafter: exact
    for name in ("long", "spark-lora"):
        # Another KV dtype (int8 per token-head, fp8) may break a late near-tie differently.
        got = _greedy(gpu_servers[name])
        same = sum(a == b for g, p in zip(got, plain) for a, b in zip(g, p))
        _record(f"{name}.greedy_tokens_equal_to_bf16_nospec", f"{same}/{sum(map(len, plain))}")
        assert [g[:16] for g in got] == [p[:16] for p in plain], name


@pytest.mark.parametrize("name", [*PROFILES, "single-nospec"])
def test_plan_equals_the_pool_the_cuda_engine_logs(gpu_servers, name):
    """What `qwen38 serve` planned before it started vLLM is the pool the engine then built."""
    found = pools(gpu_servers[name].log.read_text(errors="replace"))
    _record(f"{name}.pool_tokens", {"planned": found.planned_tokens, "engine": found.engine_tokens})
    assert (found.planned_tokens, found.planned_concurrency) == (found.engine_tokens, found.engine_concurrency)


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
    (the gated servers, with graphs, check that part)."""
    profiles_dir = tmp_path_factory.mktemp("profiles-eager")
    data = {}
    for name in PROFILES:
        slots = dict(TINY, adapter="tiny/adapter") if name == "spark-lora" else TINY
        data[f"{name}-eager"] = derive(name, slots, extra_engine={**SHARE, **_engine_extra(name), "enforce_eager": True})
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
    found = pools(pool_logs[case])
    _record(f"{case[0]}.pc{int(case[1])}.spec{int(case[2])}.pool_tokens",
            {"planned": found.planned_tokens, "engine": found.engine_tokens})
    assert (found.planned_tokens, found.planned_concurrency) == (found.engine_tokens, found.engine_concurrency)
