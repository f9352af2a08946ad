"""Patch 0072: lookup drafting for DFlash2 on the V2 runner, without a GPU.

The kernel (patches/src/v1/worker/gpu/spec_decode/qwen38_lookup.py) runs under Triton's
interpreter on CPU tensors and must give patch 0070's NumPy rule token for token, on random
histories (small vocabularies: many partial matches), on documents being copied and on
periodic ones, with the batch's request-state indirection, skipped rows and a window. The
positions lookup decides become point masses in DFlash2's sparse draft-logits cache. It
compiles with real Triton for the 3090 (sm_86), Hopper (sm_90) and Spark (sm_121 family,
sm_120). The patched V2 speculator, built from the real engine config of our Qwen3.8 target
with its DFlash2 drafter at `single`'s LOOKUP=true depth, fills its own buffers with it.
The engine run is tests/gpu/test_lookup_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.lookup_kernel import LOOKUP_KERNEL_FILE, REPO, expected_fill, load_lookup_module
from tests.support.triton_compile import run_compile_child
from tests.support.vllm_views import last_json_line, real_shapes_as_cuda_prelude, run_python

PATCH = REPO / "patches" / "0072-dflash2-lookup-drafting-v2-runner.patch"
K, DRAFTER = 15, 7  # `single` with LOOKUP=true: VERIFY_BLOCK 16 = 1 + 7 + 8


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    # Read at decoration and again at launch; per test, so it never leaks into servers.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def kernel():
    return load_lookup_module(interpret=True)


def _batch(histories, max_len):
    tokens = torch.full((len(histories) + 2, max_len), 7777, dtype=torch.int32)  # junk past each history
    total = torch.zeros(len(histories) + 2, dtype=torch.int32)
    for state, history in enumerate(histories):
        tokens[state, : len(history)] = torch.from_numpy(history.astype(np.int32))
        total[state] = len(history)
    return tokens, total


def _run(kernel, histories, drafts, idx_mapping, num_sampled, window=32768, logits=None, candidates=None):
    tokens, total = _batch(histories, max(map(len, histories)) + 64)
    out = torch.from_numpy(drafts.copy())
    positions = torch.full(drafts.shape, 9, dtype=torch.int8)
    kernel.fill_lookup_drafts(
        out, positions, torch.tensor(idx_mapping, dtype=torch.int32), torch.tensor(num_sampled, dtype=torch.int32),
        tokens, total, DRAFTER, logits, candidates, window=window,
    )
    return out.numpy(), positions.numpy().astype(bool)


def _histories(rng):
    chain = rng.integers(0, 50_000, 400)
    periodic = np.tile(rng.integers(0, 50_000, 5), 30)
    return [
        rng.integers(0, 4, 300),  # tiny vocabulary: matches everywhere
        rng.integers(0, 50_000, 200),  # nothing recurs
        np.concatenate([chain, chain[:20]]),  # a document being copied (8+ token verbatim match)
        periodic,  # a period shorter than the block
        rng.integers(0, 3, 2),  # too short to match
        np.zeros(0, dtype=np.int64),  # empty
        np.concatenate([chain[:100], rng.integers(0, 50_000, 1500), chain[:6]]),  # a match 1,500 back
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_gives_the_numpy_rule_for_every_request_of_a_batch(kernel, seed):
    rng = np.random.default_rng(seed)
    histories = _histories(rng)
    n = len(histories)
    drafts = rng.integers(0, 4, (n, K)).astype(np.int64)
    # The copied document's drafter agrees with the copy at position 0 in one seed: the tail rule.
    if seed == 1:
        drafts[:, 0] = histories[2][20]
    idx_mapping = rng.permutation(n)
    tokens, positions = _run(kernel, histories, drafts, idx_mapping, [1] * n)
    for row, state in enumerate(idx_mapping):
        want_tokens, want_positions = expected_fill(histories[state].astype(np.int64), drafts[row], DRAFTER, 32768)
        assert tokens[row].tolist() == want_tokens.tolist(), (seed, state)
        assert positions[row].tolist() == want_positions.tolist(), (seed, state)
    assert positions.any() and not positions.all()


def test_a_copied_document_takes_the_whole_block_and_every_position_is_a_point_mass(kernel):
    rng = np.random.default_rng(5)
    chain = rng.integers(0, 50_000, 300)
    history = np.concatenate([chain, chain[:12]])
    drafts = np.full((1, K), 3, dtype=np.int64)  # the drafter disagrees from its first token
    tokens, positions = _run(kernel, [history], drafts, [0], [1])
    assert tokens[0].tolist() == chain[12 : 12 + K].tolist()
    assert positions[0].all()


def test_skipped_rows_keep_the_drafter_tokens_and_no_lookup_positions(kernel):
    """A padded row (state -1) and a request still prefilling (nothing sampled) are untouched."""
    rng = np.random.default_rng(3)
    chain = rng.integers(0, 50_000, 100)
    history = np.concatenate([chain, chain[:10]])
    drafts = rng.integers(0, 50_000, (3, K)).astype(np.int64)
    tokens, positions = _run(kernel, [history, history], drafts, [0, -1, 1], [1, 1, 0])
    assert tokens[0].tolist() != drafts[0].tolist() and positions[0].all()
    assert tokens[1:].tolist() == drafts[1:].tolist()
    assert not positions[1:].any()


def test_matches_are_searched_only_within_the_window(kernel):
    rng = np.random.default_rng(4)
    chain = rng.integers(0, 50_000, 40)
    history = np.concatenate([chain, rng.integers(50_000, 60_000, 200), chain[:10]])
    drafts = rng.integers(60_000, 61_000, (1, K)).astype(np.int64)
    near, near_positions = _run(kernel, [history], drafts, [0], [1], window=1000)
    assert near[0].tolist() == chain[10 : 10 + K].tolist() and near_positions[0].all()
    far, far_positions = _run(kernel, [history], drafts, [0], [1], window=100)
    want, want_positions = expected_fill(history.astype(np.int64), drafts[0], DRAFTER, 100)
    assert far[0].tolist() == want.tolist() == drafts[0].tolist()
    assert far_positions[0].tolist() == want_positions.tolist() == [False] * K


def test_lookup_positions_become_point_masses_in_the_sparse_draft_logits_cache(kernel):
    """DFlash2 keeps only its top-k candidates finite in each cached row (-inf elsewhere).
    A lookup position's row must become 0 at its token and -inf everywhere else, with the
    token as the row's candidates (so the drafter's next cache write clears it); the
    drafter's own positions keep their rows."""
    rng = np.random.default_rng(6)
    vocab, top_k, states = 64, 4, 3
    chain = rng.integers(0, vocab, 40)
    history = np.concatenate([chain, chain[:3]])  # too short a match for the copy rule
    drafts = rng.integers(0, vocab, (1, K)).astype(np.int64)
    drafts[0, :DRAFTER] = chain[3 : 3 + DRAFTER]  # the drafter follows the copy: the tail rule
    candidates = torch.from_numpy(rng.integers(0, vocab, (states, K, top_k)))
    # The drafter's candidates include the token lookup will choose at one position.
    want_tokens, want_positions = expected_fill(history.astype(np.int64), drafts[0], DRAFTER, 32768)
    candidates[1, DRAFTER, 0] = int(want_tokens[DRAFTER])
    logits = torch.full((states, K, vocab), float("-inf"))
    for s in range(states):
        for k in range(K):
            logits[s, k, candidates[s, k]] = torch.randn(top_k)
    before_logits, before_candidates = logits.clone(), candidates.clone()
    histories = [np.zeros(0, dtype=np.int64), history]
    tokens, positions = _run(kernel, histories, drafts, [1], [1], logits=logits, candidates=candidates)
    assert tokens[0].tolist() == want_tokens.tolist() and positions[0].tolist() == want_positions.tolist()
    assert positions[0, DRAFTER:].all() and not positions[0, :DRAFTER].any()
    for k in range(K):
        if positions[0, k]:
            row = logits[1, k]
            assert torch.isfinite(row).sum() == 1 and row[int(tokens[0, k])] == 0
            assert torch.softmax(row / 0.7, dim=-1)[int(tokens[0, k])] == 1
            assert candidates[1, k].tolist() == [int(tokens[0, k])] * top_k
        else:
            assert torch.equal(logits[1, k], before_logits[1, k])
            assert torch.equal(candidates[1, k], before_candidates[1, k])
    # Other requests' rows are untouched.
    for s in (0, 2):
        assert torch.equal(logits[s], before_logits[s]) and torch.equal(candidates[s], before_candidates[s])


def test_kernel_compiles_for_the_3090_hopper_and_blackwell():
    results = run_compile_child("tests.support.lookup_kernel")["results"]
    if all(r.startswith("skip") for r in results.values()):
        pytest.skip(f"this Triton cannot compile for CUDA here: {results}")
    assert results == {"86": "ok", "90": "ok", "120": "ok"}


def test_kernel_module_in_the_patch_is_patches_src_verbatim():
    from entrypoint.unified_diff import apply_file_diff, parse_patch

    patch = parse_patch(PATCH.read_text(encoding="utf-8"))
    (created,) = [diff for diff in patch.files if diff.creates]
    assert created.path == "v1/worker/gpu/spec_decode/qwen38_lookup.py"
    assert apply_file_diff(None, created) == LOOKUP_KERNEL_FILE.read_text(encoding="utf-8")


# The patched V2 speculator from vLLM's own objects (device cpu), planned as on a CUDA build.
SPECULATOR = rf"""
import json
from types import SimpleNamespace

import numpy as np
import torch

{real_shapes_as_cuda_prelude()}
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.lookup import fill_lookup_drafts as numpy_rule
from vllm.v1.worker.gpu.spec_decode import init_speculator


def engine_config(lookup_tokens):
    return EngineArgs(
        model=target, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=4,
        kv_cache_memory_bytes=1 << 30,
        speculative_config={{"method": "dflash", "model": drafter, "num_speculative_tokens": {K},
                             "lookup_tokens": {K - DRAFTER} if lookup_tokens else 0,
                             "draft_sample_method": "probabilistic"}},
    ).create_engine_config()


off = init_speculator(engine_config(False), torch.device("cpu"))
spec = init_speculator(engine_config(True), torch.device("cpu"))

rng = np.random.default_rng(0)
chain = rng.integers(0, 248_000, 200)
history = np.concatenate([chain, chain[:5]])  # too short a match for the copy rule
all_token_ids = torch.zeros(4, 4096, dtype=torch.int32)
all_token_ids[2, : len(history)] = torch.from_numpy(history.astype(np.int32))
total_len = torch.tensor([0, 0, len(history), 0], dtype=torch.int32)
drafts = rng.integers(0, 248_000, {K})
drafts[:{DRAFTER}] = chain[5 : 5 + {DRAFTER}]  # the drafter follows the copy: positions past it by lookup
spec.draft_tokens[0] = torch.from_numpy(drafts)
spec._cached_candidate_ids[2] = torch.from_numpy(rng.integers(0, 248_000, spec._cached_candidate_ids[2].shape))
for k in range({K}):
    spec.draft_logits[2, k, spec._cached_candidate_ids[2, k]] = 1.0
batch = spec.draft_tokens[:1]
spec.fill_lookup(batch, torch.tensor([2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                 all_token_ids, total_len)
finite = [int(torch.isfinite(spec.draft_logits[2, k]).sum()) for k in range({K})]

try:
    init_speculator(SimpleNamespace(speculative_config=SimpleNamespace(
        lookup_tokens=8, method="dflash", draft_model_config=SimpleNamespace(architectures=["DFlashDraftModel"]))),
        torch.device("cpu"))
    refusal = None
except NotImplementedError as exc:
    refusal = str(exc)

print(json.dumps({{
    "class": type(spec).__name__, "off_lookup_tokens": off.lookup_tokens,
    "lookup_tokens": spec.lookup_tokens, "num_drafter_tokens": spec.num_drafter_tokens,
    "draft_tokens_shape": list(spec.draft_tokens.shape), "logits_shape": list(spec.draft_logits.shape),
    "tokens": batch[0].tolist(), "numpy_rule": [r.tolist() for r in numpy_rule(history, drafts, {DRAFTER})],
    "positions": spec.lookup_positions[0].tolist(), "finite_per_position": finite,
    "candidates_at_lookup": spec._cached_candidate_ids[2, {DRAFTER}].tolist(),
    "refusal": refusal,
}}))
"""


@pytest.mark.slow
def test_patched_dflash2_speculator_fills_its_block_by_lookup(vllm_views):  # noqa: F811
    done = run_python(SPECULATOR, vllm_views["patched"], timeout=900, TRITON_INTERPRET="1")
    got = last_json_line(done)
    assert got["class"] == "DFlash2Speculator"
    assert got["off_lookup_tokens"] == 0  # the runner's guard: nothing launched with lookup off
    assert (got["lookup_tokens"], got["num_drafter_tokens"]) == (K - DRAFTER, DRAFTER)
    assert got["draft_tokens_shape"] == [4, K] and got["logits_shape"] == [4, K, 248320]
    assert [got["tokens"], [bool(p) for p in got["positions"]]] == got["numpy_rule"]
    assert got["positions"] == [0] * DRAFTER + [1] * (K - DRAFTER)
    assert got["finite_per_position"][DRAFTER:] == [1] * (K - DRAFTER)
    assert got["candidates_at_lookup"] == [got["tokens"][DRAFTER]] * len(got["candidates_at_lookup"])
    assert "DFlash2 drafters only" in got["refusal"]
