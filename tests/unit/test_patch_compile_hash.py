"""Patch 0060: the compile-cache key (VllmConfig.compute_hash) changes with the
DFlash speculative depth on the patched tree, and does not on stock 0.28.0."""

from __future__ import annotations

import pytest

from tests.support.vllm_views import json_in_views, real_shapes_as_cuda_prelude

pytestmark = pytest.mark.slow  # starts vLLM in a child process

CHECK = rf"""
import json
{real_shapes_as_cuda_prelude()}
from vllm.engine.arg_utils import EngineArgs

hashes = {{}}
for depth in (7, 7, 9):
    config = EngineArgs(
        model=target, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
        kv_cache_memory_bytes=1 << 30,
        speculative_config={{"method": "dflash", "model": drafter, "num_speculative_tokens": depth}},
    ).create_engine_config()
    hashes.setdefault(str(depth), []).append(config.compute_hash())
print(json.dumps({{"7": hashes["7"], "9": hashes["9"]}}))
"""


@pytest.fixture(scope="module")
def hashes(vllm_views) -> dict[str, dict]:
    return json_in_views(CHECK, vllm_views)


def test_patched_compile_hash_differs_between_depths(hashes):
    result = hashes["patched"]
    assert result["7"][0] == result["7"][1], "the hash must be stable for one depth"
    assert result["9"][0] != result["7"][0]


def test_stock_compile_hash_ignores_the_depth(hashes):
    result = hashes["stock"]
    assert result["9"][0] == result["7"][0]
