"""Patch 0010 end to end on the real CPU engine: a tiny Qwen3.5 hybrid (GDN +
attention, untied, with an MTP module) with int8 pack-quantized embed_tokens loads
through the quantized embedding and answers exactly like the same model with that
embedding dequantized, with and without MTP speculation; stock vLLM 0.28.0 cannot
load it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from prepare.generate import int8_embed_pair
from tests.support.vllm_views import last_json_line, run_python, vllm_views  # noqa: F401

pytestmark = pytest.mark.integration

RUN = r"""
import json, sys
from vllm import LLM, SamplingParams


def main(path, mtp):
    extra = {}
    if mtp:
        # Hybrid + speculation + prefix caching does not run on CPU (CI-NOTES.md).
        extra = dict(enable_prefix_caching=False, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    llm = LLM(
        model=path, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
        mamba_ssm_cache_dtype="float32", max_model_len=512, enforce_eager=True,
        dtype="bfloat16", max_num_seqs=4, disable_log_stats=False, **extra,
    )
    prompts = [
        {"prompt_token_ids": [(i * 37 + j * 11) % 1000 + 3 for j in range(12 + 9 * i)]}
        for i in range(4)
    ]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False, logprobs=1))
    method = llm.apply_model(lambda model: type(model.model.embed_tokens.quant_method).__name__)
    drafts = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    print(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs],
        "embed_method": method[0],
        "drafts": drafts,
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "mtp")
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    return int8_embed_pair(tmp_path_factory.mktemp("tiny-hybrid"))


def serve_and_answer(vllm_views, view: str, model_dir, tmp_path, mtp: bool = False) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "run_tiny.py"
    script.write_text(RUN)
    argv = ["run", str(model_dir), "mtp" if mtp else "-"]
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
    # In-process engine: the lambda given to apply_model needs no pickling.
    done = run_python(
        code, vllm_views[view], timeout=1200, VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    return {"done": done, "result": last_json_line(done) if '{"tokens"' in done.stdout else None}


def both(vllm_views, tiny, tmp_path, mtp: bool = False) -> tuple[dict, dict]:
    """The int8 checkpoint and its dequantized twin on the patched engine, side by side (two
    engines of one thread each: on a 2-core machine they take the time of one)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        quantized, reference = pool.map(
            lambda kind: serve_and_answer(vllm_views, "patched", tiny[kind], tmp_path / kind, mtp=mtp),
            ("int8", "dequantized"),
        )
    return quantized, reference


def test_int8_embed_tokens_answer_like_the_dequantized_model(vllm_views, tiny, tmp_path):
    quantized, reference = both(vllm_views, tiny, tmp_path)
    assert quantized["result"] is not None, quantized["done"].stderr[-3000:]
    assert reference["result"] is not None, reference["done"].stderr[-3000:]
    ours, theirs = quantized["result"], reference["result"]
    assert ours["embed_method"] == "CompressedTensorsEmbeddingWNA16Int"
    assert theirs["embed_method"] == "UnquantizedEmbeddingMethod"
    assert ours["tokens"] == theirs["tokens"]
    for mine, other in zip(ours["logprobs"], theirs["logprobs"], strict=True):
        assert mine == pytest.approx(other, abs=1e-4)


def test_mtp_module_loads_int8_embed_tokens_and_drafts(vllm_views, tiny, tmp_path):
    """The MTP module of the same checkpoint loads the int8 embedding too (it reads
    model.embed_tokens.weight_packed/...), drafts, and greedy output is still the
    dequantized model's."""
    quantized, reference = both(vllm_views, tiny, tmp_path, mtp=True)
    assert quantized["result"] is not None, quantized["done"].stderr[-3000:]
    assert reference["result"] is not None, reference["done"].stderr[-3000:]
    assert quantized["result"]["drafts"] > 0
    assert quantized["result"]["tokens"] == reference["result"]["tokens"]


def test_stock_vllm_cannot_load_int8_embed_tokens(vllm_views, tiny, tmp_path):
    run = serve_and_answer(vllm_views, "stock", tiny["int8"], tmp_path)
    assert run["result"] is None
    assert "embed_tokens.weight_packed" in run["done"].stdout + run["done"].stderr
