"""Patch 0045 through the real CUDA engine: the tiny Qwen3.5-layout hybrid target (its
attention layer on vLLM's Triton backend) verifying a DFlash drafter's blocks answers
greedily token for token the same with split-KV verify attention on (default) and off
(QWEN38_SPLIT_KV=0), and the split path is really taken when on (the patch's one-time
log lines), with full CUDA graphs and eagerly.

Run on the lent GPU box (see tests/gpu/test_patch_kernels.py for the command).
"""

from __future__ import annotations

import pytest

from tests.gpu.test_patch_engine import engine_script, run_engine

pytestmark = pytest.mark.gpu

K = 4  # the tiny drafter's depth, as in the `cpu` profile: verify blocks of 5 tokens
SPLIT_IN_USE = f"qwen38 split-KV verify attention: in use ({K + 1} query tokens per request)"
WORKSPACE = "qwen38 split-KV verify attention: workspace of"

# Prompts over the tiny vocabulary; the longest has 1,500 tokens, so that eager verify
# batches (which need >= 1,024 context tokens) take the split path too.
BODY = rf"""
import os
target, drafter = path.split(",")
llm = LLM(model=target, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=4,
          kv_cache_memory_bytes=256 << 20, enforce_eager=os.environ["SPLIT_KV_TEST_EAGER"] == "1",
          attention_config={{"backend": "TRITON_ATTN"}}, additional_config={{"gdn_prefill_backend": "triton"}},
          speculative_config={{"method": "dflash", "model": drafter, "num_speculative_tokens": {K}}})
lengths = [1500, 40, 1100, 7]
prompts = [{{"prompt_token_ids": [(i * 37 + j * 11) % 1000 + 3 for j in range(n)]}} for i, n in enumerate(lengths)]
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, detokenize=False))
print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in out]}}))
"""


@pytest.fixture(scope="session", autouse=True)
def needs_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: these tests run on the lent H100/H200")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> str:
    from prepare.generate import build_tiny_models

    paths = build_tiny_models(tmp_path_factory.mktemp("tiny"))
    return f"{paths['target']},{paths['drafter']}"


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_split_kv_on_and_off_give_identical_greedy_output(vllm_views, tiny_models, tmp_path, eager):
    script = engine_script(tmp_path, BODY)
    env = {"VLLM_LOGGING_LEVEL": "INFO", "SPLIT_KV_TEST_EAGER": "1" if eager else "0"}
    on, on_logs = run_engine(vllm_views, "patched", script, tiny_models, QWEN38_SPLIT_KV="1", **env)
    off, off_logs = run_engine(vllm_views, "patched", script, tiny_models, QWEN38_SPLIT_KV="0", **env)
    assert on and off, (on_logs[-4000:], off_logs[-4000:])
    assert WORKSPACE in on_logs, on_logs[-4000:]
    assert SPLIT_IN_USE in on_logs, on_logs[-4000:]
    assert WORKSPACE not in off_logs and "split-KV verify attention: in use" not in off_logs
    assert all(len(tokens) == 48 for tokens in on["tokens"])
    for index, (mine, theirs) in enumerate(zip(on["tokens"], off["tokens"], strict=True)):
        assert mine == theirs, f"prompt {index}: split {mine} vs unified {theirs}"
