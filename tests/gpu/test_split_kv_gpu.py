"""The split-KV verify attention kernel compiled for a real GPU, at full sizes.

The same checks as tests/unit/test_split_kv_verify.py (which runs them under Triton's
interpreter at toy sizes), at Qwen3.8-27B's shape (24 query heads, 4 KV heads, head_dim
256) and contexts up to 128k, plus CUDA-graph replay. Needs only torch + triton (no
vLLM). On the lent GPU:

    PYTHONPATH=. python -m pytest tests/gpu/test_split_kv_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import pytest

from tests.split_kv_support import (
    compare,
    full_cases,
    graph_replay_check,
    load_kernel_module,
    run_case,
    worst_element,
)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (runs on the lent H100/H200)"),
]

FULL = full_cases()


@pytest.fixture(scope="module")
def kernel():
    return load_kernel_module()


@pytest.mark.parametrize("case", FULL, ids=[c.id for c in FULL])
def test_split_kernel_matches_float32_reference_at_full_size(kernel, case):
    out, ref, batch = run_case(kernel, case, "cuda")
    err, ok = compare(out, ref, case.dtype)
    print(f"{case.id}: max abs error {err:.3e}; worst: {worst_element(out, ref, batch)}")
    assert ok, f"{case.id}: max abs error {err:.3e} beyond tolerance; {worst_element(out, ref, batch)}"


@pytest.mark.parametrize("case", [c for c in FULL if c.name == "qwen38-q8"], ids=lambda c: c.id)
def test_unsplit_baseline_matches_float32_reference_at_full_size(kernel, case):
    out, ref, batch = run_case(kernel, case, "cuda", unsplit=True)
    err, ok = compare(out, ref, case.dtype)
    print(f"{case.id} unsplit: max abs error {err:.3e}; worst: {worst_element(out, ref, batch)}")
    assert ok, f"max abs error {err:.3e}; {worst_element(out, ref, batch)}"


@pytest.mark.parametrize("kv_int8", [False, True], ids=["bf16", "int8"])
def test_captured_graph_serves_later_context_lengths(kernel, kv_int8):
    """Captured as vLLM captures (seq_lens filled with 1, fewer keys than query tokens),
    replayed with real lengths written into the same tensors: right for every context
    (the split plan is made on the device; no allocation, no host sync inside)."""
    for label, err, ok in graph_replay_check(kernel, kv_int8):
        print(f"{'int8' if kv_int8 else 'bf16'} {label}: max abs error {err:.3e}")
        assert ok, f"{label}: max abs error {err:.3e}"
