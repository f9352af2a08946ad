"""Patch 0010 end to end on the real CPU engine: a tiny Qwen3.5 hybrid (GDN +
attention, untied, with an MTP module) with int8 pack-quantized embed_tokens loads
through the quantized embedding and answers exactly like the same model with that
embedding dequantized, with and without MTP speculation; stock vLLM 0.28.0 cannot
load it. The patched engines run one after another in one child (one import of vLLM), beside
the stock one in another."""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prepare.generate import int8_embed_pair
from tests.support.vllm_views import last_json_line, run_python

pytestmark = pytest.mark.integration

RUN = r"""
import gc, json, sys, traceback
from vllm import LLM, SamplingParams


def answer(path, mtp):
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
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False, logprobs=1),
                           use_tqdm=False)
    method = llm.apply_model(lambda model: type(model.model.embed_tokens.quant_method).__name__)
    drafts = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs],
        "embed_method": method[0],
        "drafts": drafts,
    }
    del llm
    gc.collect()
    return result


def main(runs):
    # One engine after another in this process (one import of vLLM); a run that raises is
    # recorded with its traceback and the next one still runs.
    results = {}
    for name, path, mtp in runs:
        try:
            results[name] = answer(path, mtp)
        except Exception:
            results[name] = {"error": traceback.format_exc()[-6000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    return int8_embed_pair(tmp_path_factory.mktemp("tiny-hybrid"))


def with_mtp_ignored(model: Path, out: Path) -> Path:
    """A copy of ``model`` whose quantization config ignores the MTP module's own layers, as a
    W4A16 checkpoint's does (``re:.*mtp.*``): the prepared `single` target with SPECULATION=mtp."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"] = [*config["quantization_config"].get("ignore", []), "re:.*mtp.*"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def in_view(vllm_views, view: str, runs: list[tuple[str, str, bool]], tmp_path) -> subprocess.CompletedProcess:
    """``RUN`` on ``runs`` ([name, model dir, mtp] each) in a child whose vLLM is ``view``."""
    script = tmp_path / "run_tiny.py"
    argv = ["run", json.dumps(runs)]
    # In-process engine: the lambda given to apply_model needs no pickling. Set by the script
    # (vLLM reads it when the engine starts), so the view's plain warm Python runs it.
    code = (f"import os, runpy, sys; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'; sys.argv = {argv!r}; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    return run_python(code, vllm_views[view], timeout=1200)


@pytest.fixture(scope="module")
def answers(vllm_views, tiny, tmp_path_factory) -> dict[str, dict]:
    """The patched engine on the int8 checkpoint and its dequantized twin, each with and without
    MTP, in one child; beside it the stock engine on the int8 checkpoint (two children of one
    thread each: on a 2-core machine they take about the time of one)."""
    tmp_path = tmp_path_factory.mktemp("embed-int8")
    (tmp_path / "run_tiny.py").write_text(RUN)
    # With MTP, the int8 checkpoint's config ignores the MTP's own layers as a W4A16 one does.
    int8_mtp = with_mtp_ignored(tiny["int8"], tmp_path / "int8-mtp-ignored")
    patched = [("int8", str(tiny["int8"]), False), ("dequantized", str(tiny["dequantized"]), False),
               ("int8-mtp", str(int8_mtp), True), ("dequantized-mtp", str(tiny["dequantized"]), True)]
    views = {"patched": patched, "stock": [("stock", str(tiny["int8"]), False)]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(views, pool.map(lambda view: in_view(vllm_views, view, views[view], tmp_path), views)))
    results = {}
    for view, child in done.items():
        assert child.returncode == 0, child.stderr[-3000:]
        results.update(last_json_line(child))
    return results


def answered(answers: dict, name: str) -> dict:
    assert "error" not in answers[name], f"{name}: {answers[name].get('error')}"
    return answers[name]


def test_int8_embed_tokens_answer_like_the_dequantized_model(answers):
    ours, theirs = answered(answers, "int8"), answered(answers, "dequantized")
    assert ours["embed_method"] == "CompressedTensorsEmbeddingWNA16Int"
    assert theirs["embed_method"] == "UnquantizedEmbeddingMethod"
    assert ours["tokens"] == theirs["tokens"]
    for mine, other in zip(ours["logprobs"], theirs["logprobs"], strict=True):
        assert mine == pytest.approx(other, abs=1e-4)


def test_mtp_module_loads_int8_embed_tokens_and_drafts(answers):
    """The MTP module of the same checkpoint loads the int8 embedding too (it reads
    model.embed_tokens.weight_packed/...), drafts, and greedy output is still the dequantized
    model's - with the config ignoring the MTP's own layers (re:.*mtp.*), as a W4A16
    checkpoint's does: the table is the target's, looked up under the target's name. Before
    that, the full-scale `single` with SPECULATION=mtp died at load on the lent H200
    (2026-12-07): no parameter embed_tokens.weight_packed in Qwen3_5MultiTokenPredictor."""
    quantized, reference = answered(answers, "int8-mtp"), answered(answers, "dequantized-mtp")
    assert quantized["embed_method"] == "CompressedTensorsEmbeddingWNA16Int"
    assert quantized["drafts"] > 0
    assert quantized["tokens"] == reference["tokens"]


def test_stock_vllm_cannot_load_int8_embed_tokens(answers):
    assert set(answers["stock"]) == {"error"}
    assert "embed_tokens.weight_packed" in answers["stock"]["error"]
