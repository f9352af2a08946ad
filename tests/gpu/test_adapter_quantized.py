"""On a GPU: the adapter on a Spark-like quantized base (FP8 + NVFP4, real vLLM kernels).

The behavioural check the algebra cannot give (docs/adapter.md, caveats): vLLM quantizes
activations for the FP8/NVFP4 GEMMs and applies the LoRA in bf16 on the unquantized input,
so W x + B (A x) is not bit-identical to projecting the quantized output. This test builds
the adapter from a tiny model stored like RadixArk/Qwen3.8-27B-NVFP4 (ModelOpt
MIXED_PRECISION: static FP8 out_proj/o_proj, NVFP4 W4A4 down_proj), serves it with the real
kernels and checks:
- adapter requests differ from base requests (vLLM #49354: LoRA on Qwen3.5-class hybrids
  returning the base output), and base requests are unchanged by LoRA being enabled;
- the adapter on the quantized base is as close to the projected model (bf16, dequantized
  weights) as the quantized base is to the dequantized base, i.e. what remains is
  quantization noise, not a wrong transform.

On Hopper vLLM runs the NVFP4 layers through Marlin (weights 4-bit, activations bf16), so
there the activation rounding comes from the static-FP8 layers only; on the Spark (sm_121)
the FP4 activation path is exercised too.

Run on the lent GPU machine with the CUDA vLLM payload on PYTHONPATH:
    PYTHONPATH=.:$VLLM_PAYLOAD python -m pytest tests/gpu/test_adapter_quantized.py -m gpu -s
(~4 model loads in eager mode, a few minutes; prints the figures for docs/adapter.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA vLLM 0.28.0"),
]

REPO = Path(__file__).resolve().parents[2]


def _probe(model: Path, out: Path, lora: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "tests.support.lora_probe", str(model), str(out)]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def observed(tmp_path_factory, tiny_root) -> dict:
    from prepare.adapter import build_adapter
    from prepare.directions import read_directions, target_modules
    from core.checkpoint import open_checkpoint
    from tests.support.identified import seal
    from tests.support.spark_like import bf16_variant, projected, quantize_like_spark

    work = tmp_path_factory.mktemp("adapter-gpu")
    base = tiny_root / "tiny" / "target"
    modules = target_modules(open_checkpoint(base))
    quantized_dir = work / "quantized"
    dequantized = quantize_like_spark(base, quantized_dir, modules)
    seal(quantized_dir, like="spark")
    # the tiny model's own directions (unit r, c = prepare.generate.TINY_ADAPTER_STRENGTH), as the cpu profile serves
    directions_path = tiny_root / "tiny" / "directions" / "directions.safetensors"
    record = build_adapter(quantized_dir, directions_path, work / "mode-b")
    assert record["formats"] == {"fp8-tensor": 4, "nvfp4-modelopt": 4}
    directions = read_directions(directions_path)
    deq_base = bf16_variant(base, work / "dequantized", dequantized)
    deq_projected = bf16_variant(base, work / "projected", projected(dequantized, directions))

    seen = {}
    lora = _probe(quantized_dir, work / "q-lora.json", work / "mode-b")
    seen["base_q"], seen["adapter_q"] = lora["base"], lora["mode-b"]
    seen["base_q_plain"] = _probe(quantized_dir, work / "q-plain.json")["base"]
    seen["base_deq"] = _probe(deq_base, work / "deq.json")["base"]
    seen["projected_deq"] = _probe(deq_projected, work / "proj.json")["base"]
    figures = {
        "adapter_vs_base": _max_abs_diff(seen["adapter_q"]["logprobs"], seen["base_q"]["logprobs"]),
        "adapter_vs_projected": _max_abs_diff(seen["adapter_q"]["logprobs"], seen["projected_deq"]["logprobs"]),
        "quantized_vs_dequantized_base": _max_abs_diff(seen["base_q"]["logprobs"], seen["base_deq"]["logprobs"]),
        "base_lora_vs_plain": _max_abs_diff(seen["base_q"]["logprobs"], seen["base_q_plain"]["logprobs"]),
    }
    print("\nadapter GPU figures (max |d logprob| over the sequence):", json.dumps(figures, indent=1))
    (work / "observed.json").write_text(json.dumps({"figures": figures, **seen}, indent=1))
    return {"figures": figures, **seen}


def test_adapter_changes_the_quantized_model_output(observed):
    for adapter, base in zip(observed["adapter_q"]["greedy"], observed["base_q"]["greedy"], strict=True):
        assert adapter != base
    assert observed["figures"]["adapter_vs_base"] > 0.05


def test_base_requests_are_unchanged_by_lora_being_enabled(observed):
    assert observed["base_q"]["greedy"] == observed["base_q_plain"]["greedy"]
    assert observed["figures"]["base_lora_vs_plain"] < 0.02


def test_adapter_on_quantized_kernels_matches_the_projection_up_to_quantization_noise(observed):
    f = observed["figures"]
    assert f["adapter_vs_projected"] < 0.5 * f["adapter_vs_base"]
    assert f["adapter_vs_projected"] < 2 * f["quantized_vs_dequantized_base"] + 0.05
