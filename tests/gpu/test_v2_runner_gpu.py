"""`single` without a drafter on vLLM's V2 model runner, at tiny size (issue 57).

vLLM 0.28.0 serves Qwen3.5's hybrid on its V1 runner unless told otherwise (only a DFlash2
drafter forces V2); the V1 runner prepares each step's inputs on the host, and at full size the
device idles on that (docs/step-profile.md). ``VLLM_USE_V2_MODEL_RUNNER=1`` in a profile's
[env] moves them to the V2 runner, whose input preparation runs on the device. Before a profile
takes it, the V2 copies must serve as the V1 ones do: `single` with speculation off and with the
target's own MTP head, on the V2 runner (its load line, not V1's), MTP's greedy tokens exactly
V2's own speculation-off tokens (lossless), the runner itself changing none of the V1
reference's first 16 tokens, the planned pool the engine's, `validate apis` passing, drafts
counted. At this size a step is almost all fixed cost (launches, host work): `bench c1` on each
copy records what the runner changes there (a record, not a bound); `bench fullscale`'s `-v2`
copies measure the step at full size.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import spec_decode_delta
from tests.gpu.conftest import record
from tests.gpu.test_profiles_gpu import PROMPTS, _cli, _greedy
from tests.gpu.tiny_profiles import TINY, TinyServers, check_plan_is_engine_pool, derive

pytestmark = pytest.mark.gpu

SHARE = {"gpu_memory_utilization": 0.1}
V2_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
NOSPEC, MTP = {"SPECULATION": "false"}, {"SPECULATION": "mtp"}
# key -> (profile file, qwen38 serve's settings); the V1 and V2 profiles differ only in [env]. One
# file per copy: `qwen38 serve` serves a profile once per CACHE_DIR (its lock refused the second
# copy of a shared file on the 2026-12-07 H100 tier).
SERVED = {
    "v1-nospec": ("single-v1-nospec-tiny", NOSPEC),
    "v2-nospec": ("single-v2-nospec-tiny", NOSPEC),
    "v1-mtp": ("single-v1-mtp-tiny", MTP),
    "v2-mtp": ("single-v2-mtp-tiny", MTP),
}
# The runners' lines as the model loads: V2's and V1's (vLLM 0.28.0's model runners).
V2_LOAD_LINE, V1_LOAD_LINE = "Loading model from scratch", "Starting to load model"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_root, api_key_file):
    profiles = {}
    for key, (name, _) in SERVED.items():
        data = derive("single", TINY, extra_engine=SHARE)
        if key.startswith("v2"):
            data["env"] = {**data.get("env", {}), **V2_RUNNER}
        profiles[name] = data
    s = TinyServers(tmp_path_factory, tiny_root, api_key_file, profiles, SERVED, label="v2-runner.")
    with s.started("v1-nospec", "v2-nospec", "v1-mtp", "v2-mtp"):
        yield s


@pytest.mark.parametrize("key", list(SERVED))
def test_each_copy_runs_on_the_runner_its_profile_names(servers, key):
    log = servers.gated(key).log.read_text(errors="replace")
    v2 = key.startswith("v2")
    assert (V2_LOAD_LINE in log, V1_LOAD_LINE in log) == (v2, not v2), log[-3000:]


def test_mtp_on_the_v2_runner_drafts_and_is_lossless(servers):
    server = servers.gated("v2-mtp")
    request = {"model": "qwen3.8-27b", "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}
    moved = spec_decode_delta(server, request)
    record("v2-runner.v2-mtp.spec", moved)
    assert moved["drafts"] > 0 and moved["draft_tokens"] == 4 * moved["drafts"]  # MTP_DEPTH's default
    assert _greedy(server) == _greedy(servers.gated("v2-nospec"))


def test_the_runner_changes_no_early_greedy_token(servers):
    v2, v1 = _greedy(servers.gated("v2-nospec")), _greedy(servers.gated("v1-nospec"))
    same = sum(a == b for g, p in zip(v2, v1) for a, b in zip(g, p))
    record("v2-runner.greedy_tokens_equal_to_v1", f"{same}/{sum(map(len, v1))}")
    assert [g[:16] for g in v2] == [p[:16] for p in v1]


@pytest.mark.parametrize("key", list(SERVED))
def test_plan_equals_the_pool_the_cuda_engine_logs(servers, key):
    check_plan_is_engine_pool(servers.gated(key).log.read_text(errors="replace"), f"v2-runner.{key}")


@pytest.mark.parametrize("key", ["v2-nospec", "v2-mtp"])
def test_validate_apis(servers, key):
    _cli(servers.gated(key), "validate", "apis")


def test_bench_c1_on_each_runner(servers, tmp_path):
    """One stream's decode on each copy, one after another (the others idle): the tiny model's
    step is the fixed cost the V2 runner is to cut (docs/step-profile.md). Recorded only."""
    for key in SERVED:
        out = tmp_path / f"{key}.json"
        _cli(servers.gated(key), "bench", "c1", "--model", "qwen3.8-27b", "--input-tokens", "256",
             "--output-tokens", "256", "--requests", "3", "--out", str(out))
        summary = json.loads(out.read_text())
        record(f"v2-runner.{key}.bench_c1", summary.get("summary", summary))
