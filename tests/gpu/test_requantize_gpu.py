"""The requantized tiny target on a real GPU: vLLM 0.28.0's own 8-bit kernels (Marlin).

Run on the lent GPU machine with the CUDA vLLM payload on PYTHONPATH (CI-NOTES.md, "The
lent GPU machine"):

    PYTHONPATH=.:$PAYLOAD python -m pytest tests/gpu/test_requantize_gpu.py -m gpu -q

Same checks as tests/integration/test_requantize_vllm.py, without the CPU reference
kernel: the prepared model (W4A16 target + int8 lm_head, + int8 embed_tokens once the
embed patch is delivered, + int8 MTP) answers as the dequantized model does.
"""

from __future__ import annotations

import json

import pytest
import torch

from prepare.generate import generate_model
from prepare.requantize import requantize_checkpoint
from tests.integration.test_requantize_vllm import assert_same_answers, dequantized_copy, embed_patch_state, run_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and the CUDA build of vLLM 0.28.0"),
]

# Hopper would pick FlashInfer's GDN prefill (needs the CUTLASS DSL); sm_86 / sm_121 use Triton anyway.
GPU_FLAGS = ("--additional-config", json.dumps({"gdn_prefill_backend": "triton"}))


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    return generate_model(tmp_path_factory.mktemp("tiny") / "w4a16", "tiny-vl", "qwen3.8-27b-w4a16")


def test_marlin_serves_int8_lm_head_like_the_dequantized_model(w4a16, tmp_path):
    prepared = tmp_path / "prepared"
    requantize_checkpoint(w4a16, prepared, ["lm_head"])
    reference = dequantized_copy(prepared, w4a16, tmp_path / "reference", ["lm_head"])
    # GPU kernels round differently per layout: compare with a looser tolerance.
    assert_same_answers(run_probe(prepared, *GPU_FLAGS), run_probe(reference, *GPU_FLAGS), tol=5e-2, tie=1e-1)


def test_w4a8_marlin_answers_as_w4a16(w4a16, tmp_path):
    """`batch`'s VLLM_MARLIN_INPUT_DTYPE=int8 (issue 55): vLLM 0.28.0's Marlin takes int8
    activations (per token, quantized on the fly) for every 4-bit layer of the prepared target
    (patch 0025: not its int8 ones), and its greedy answers are W4A16's up to the first
    near-tie, logprobs within int8 rounding."""
    prepared = tmp_path / "prepared"
    requantize_checkpoint(w4a16, prepared, ["lm_head", "mtp"])
    # Hopper serves W4A16 with Machete, which takes no int8 activations (2026-12-07: the
    # switch changed nothing there); the 3090 has Marlin only, so the tier does too. The int8
    # lm_head beside the 4-bit layers is what failed the load before patch 0025.
    marlin = {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}
    w4a8 = run_probe(prepared, *GPU_FLAGS, env={**marlin, "VLLM_MARLIN_INPUT_DTYPE": "int8"})
    w4a16_answers = run_probe(prepared, *GPU_FLAGS, env=marlin)
    assert_same_answers(w4a8, w4a16_answers, tol=1e-1, tie=2e-1)
    # The int8 path ran: rounded activations move some logprob (identical ones would mean it did not).
    logprobs = [[o["logprobs"] for o in run["outputs"]] for run in (w4a8, w4a16_answers)]
    assert logprobs[0] != logprobs[1]


def test_mtp_speculation_with_int8_mtp_layers_runs_on_gpu(w4a16, tmp_path):
    prepared = tmp_path / "prepared"
    requantize_checkpoint(w4a16, prepared, ["lm_head", "mtp"])
    out = run_probe(prepared, "--mtp", "2", *GPU_FLAGS)
    assert out["spec_metrics"].get("vllm:spec_decode_num_drafts", 0) > 0


def test_int8_embed_tokens_with_the_embed_patch_on_gpu(w4a16, tmp_path):
    reason = embed_patch_state()
    if reason:
        pytest.skip(f"depends on the 'quantized embed_tokens for Qwen3.5' patch: {reason}")
    prepared = tmp_path / "prepared"
    requantize_checkpoint(w4a16, prepared, ["lm_head", "embed_tokens"])
    reference = dequantized_copy(
        prepared, w4a16, tmp_path / "reference", ["lm_head", "model.language_model.embed_tokens"]
    )
    assert_same_answers(run_probe(prepared, *GPU_FLAGS), run_probe(reference, *GPU_FLAGS), tol=5e-2, tie=1e-1)
