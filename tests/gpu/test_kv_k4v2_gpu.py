"""The k4v2_g128 KV cache's Triton kernels (patches/src/v1/attention/ops/qwen38_kv_k4v2.py)
compiled for a real GPU, at Qwen3.8-27B's shape (24 query heads, 4 KV heads, head_dim 256)
and real contexts (25,000, 128,000 and 245,760 tokens, `huge`'s longest).

The checks of tests/unit/test_kv_k4v2.py (Triton's interpreter, toy sizes), with the bounds
it uses (tests/support/kv_k4v2.py): the write kernel's bytes equal the torch quantizer's, bit
for bit (shuffled pages, padding slots, a hybrid pool's wider block stride and offset); the
split-KV attention for decode (1 query token), the K=7 verify (8) and the widest verify
block (16) against float32 attention over the dequantized cache (kernel bugs: float rounding
only) and over the unquantized bf16 K/V (the format's quantization error); the kernel
captured in a CUDA graph as vLLM captures it and replayed at later context lengths; the
prefill path (a chunk of 2,048 query rows deep in the context, as 16-row virtual requests of
the same kernel) against the torch loop over the dequantized pages, both timed. The
measured errors are printed (the tier log) and recorded in the tier report. Needs only
torch + triton (no vLLM). On the lent GPU:

    PYTHONPATH=. python -m pytest tests/gpu/test_kv_k4v2_gpu.py -m gpu -q -s
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest

from tests.gpu.conftest import record
from tests.split_kv_support import warm_and_capture
from tests.support.kv_k4v2 import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    SCALE,
    attention_errors,
    dequantized_failures,
    load_k4v2,
    timed_prefill,
)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (runs on the lent H100/H200)"),
]

DEVICE = "cuda"
CONTEXTS = (25_000, 128_000, 245_760)
QUERY_LENS = (1, 8, 16)  # decode, the K=7 verify, MAX_VERIFY_TOKENS
EDGE_ROWS = 8  # edge-case tokens written on a spare page (see `_edge_rows`)
PADDING_SLOTS = 5  # tokens with slot -1 (vLLM's padding), skipped by the write kernel
SPARE_PAGES = 3
STRIDE_PAD, STORAGE_OFFSET = 512, 16  # a hybrid pool's wider pages, not at the storage's start
FILL = 0xAB


@dataclass
class Written:
    """One request of ``seq_len`` tokens written by the write kernel onto shuffled pages."""

    seq_len: int
    backing: torch.Tensor  # the whole uint8 storage (padding bytes included)
    cache: torch.Tensor  # (num_pages, bytes_per_block) view with the wider stride
    block_table: torch.Tensor  # (1, pages + 1) int32, cuda
    key: torch.Tensor  # (seq_len, 4, 256) bf16, position order
    value: torch.Tensor
    slots: torch.Tensor  # (seq_len + EDGE_ROWS + PADDING_SLOTS,) int64: the kernel's slot mapping
    extra_key: torch.Tensor  # the edge-case rows, then the padding tokens' rows
    extra_value: torch.Tensor
    deq_key: torch.Tensor | None = None  # float32 (seq_len, 4, 256), dequantized, position order
    deq_value: torch.Tensor | None = None

    def dequantized(self, k4v2) -> tuple[torch.Tensor, torch.Tensor]:
        if self.deq_key is None:
            self.deq_key, self.deq_value = k4v2.gather_dequantized(
                self.cache, NUM_KV_HEADS, self.block_table[0], self.seq_len
            )
        return self.deq_key, self.deq_value


def _edge_rows(gen) -> tuple[torch.Tensor, torch.Tensor]:
    """EDGE_ROWS tokens of the unit test's edge cases, then PADDING_SLOTS padding tokens."""
    rows = EDGE_ROWS + PADDING_SLOTS
    key = torch.randn((rows, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).bfloat16()
    value = torch.randn((rows, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).bfloat16()
    key[0, 1, :128] = 0.5  # a constant group: step 0
    value[1, 0, 128:] = -2.0
    key[2, 2] *= 300.0  # large magnitudes (fp16 steps and offsets far from 1)
    value[3, 3] *= 300.0
    value[4, 1] += 300.0  # a large offset: m rounds to fp16's 0.25 spacing
    return key, value


def _pages_view(backing: torch.Tensor, num_pages: int, bytes_per_block: int) -> torch.Tensor:
    stride = bytes_per_block + STRIDE_PAD
    return backing[STORAGE_OFFSET:].view(num_pages, stride)[:, :bytes_per_block]


def _write(k4v2, seq_len: int, seed: int) -> Written:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (seq_len, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(shape, generator=gen, device=DEVICE).bfloat16()
    value = torch.randn(shape, generator=gen, device=DEVICE).bfloat16()
    pages = -(-seq_len // k4v2.BLOCK_SIZE)
    num_pages = pages + SPARE_PAGES
    order = torch.randperm(num_pages, generator=gen, device=DEVICE)
    block_table = torch.zeros(1, pages + 1, dtype=torch.int32, device=DEVICE)
    block_table[0, :pages] = order[:pages].int()
    pos = torch.arange(seq_len, device=DEVICE)
    slots = block_table[0, pos // 128].long() * 128 + pos % 128
    # Past the request: edge cases on a page no block table names (the write test reads every
    # byte; attention never sees them), then padding tokens (slot -1, never written).
    extra_key, extra_value = _edge_rows(gen)
    edge_slots = order[pages].long() * 128 + torch.arange(EDGE_ROWS, device=DEVICE)
    padding = torch.full((PADDING_SLOTS,), -1, dtype=torch.long, device=DEVICE)
    slots = torch.cat([slots, edge_slots, padding])
    layout = k4v2.KVK4V2Layout(NUM_KV_HEADS)
    backing = torch.full((STORAGE_OFFSET + num_pages * (layout.bytes_per_block + STRIDE_PAD),), FILL,
                         dtype=torch.uint8, device=DEVICE)
    cache = _pages_view(backing, num_pages, layout.bytes_per_block)
    k4v2.kvk4v2_write(torch.cat([key, extra_key]), torch.cat([value, extra_value]), cache, slots)
    torch.cuda.synchronize()
    return Written(seq_len, backing, cache, block_table, key, value, slots, extra_key, extra_value)


@pytest.fixture(scope="module")
def k4v2():
    return load_k4v2(interpret=False)


@pytest.fixture(scope="module")
def written(k4v2):
    """seq_len -> `Written`, built when first asked for; one context is kept at a time (245,760
    tokens take about 3.5 GB with the dequantized copy), so the tests run context by context."""
    held: dict[int, Written] = {}

    def get(seq_len: int) -> Written:
        if seq_len not in held:
            held.clear()
            torch.cuda.empty_cache()
            held[seq_len] = _write(k4v2, seq_len, seed=seq_len)
        return held[seq_len]

    yield get
    held.clear()


def _first_difference(got: torch.Tensor, expected: torch.Tensor, k4v2, num_pages: int) -> str:
    differ = (got != expected).nonzero()
    where = int(differ[0]) - STORAGE_OFFSET
    stride = k4v2.KVK4V2Layout(NUM_KV_HEADS).bytes_per_block + STRIDE_PAD
    page, inside = divmod(where, stride)
    head, offset = divmod(inside, k4v2.HEAD_REGION_BYTES)
    return (f"{differ.shape[0]} bytes differ; first: page {page} of {num_pages}, head {head}, byte {offset} of its "
            f"region (K codes < 16384 <= V codes < 24576 <= K meta < 25600 <= V meta): "
            f"kernel {int(got[differ[0]])}, reference {int(expected[differ[0]])}")


@pytest.mark.parametrize("seq_len", CONTEXTS)
def test_write_kernel_bytes_equal_torch_quantizer_at_full_context(k4v2, written, seq_len):
    """Every byte of the storage, padding and untouched pages included, is the torch quantizer's
    (`write_reference`): the kernel's `tl.div_rn` and fp16 rounding are IEEE on the GPU too."""
    w = written(seq_len)
    expected = torch.full_like(w.backing, FILL)
    num_pages = w.cache.shape[0]
    view = _pages_view(expected, num_pages, w.cache.shape[1])
    k4v2.write_reference(view, torch.cat([w.key, w.extra_key]), torch.cat([w.value, w.extra_value]), w.slots)
    same = torch.equal(w.backing, expected)
    print(f"ctx {seq_len}: write kernel bytes {'equal' if same else 'DIFFER'} ({w.backing.numel():,} bytes)")
    record(f"kv_k4v2.write.ctx{seq_len}.bytes_equal", same)
    assert same, _first_difference(w.backing, expected, k4v2, num_pages)


ATTENTION_CASES = [pytest.param(c, q, id=f"ctx{c}-q{q}") for c in CONTEXTS for q in QUERY_LENS]


@pytest.mark.parametrize("seq_len,q_len", ATTENTION_CASES)
def test_attention_matches_dequantized_reference_and_bounds_quantization_error(k4v2, written, seq_len, q_len):
    """The production launch (`KVK4V2Config()`, 32 splits): at 245,760 tokens that is 32 splits
    of 7,680 tokens, each a program walking 60 pages."""
    w = written(seq_len)
    gen = torch.Generator(device=DEVICE).manual_seed(seq_len + q_len)
    q = torch.randn((q_len, NUM_Q_HEADS, HEAD_DIM), generator=gen, device=DEVICE).bfloat16()
    out = torch.full_like(q, float("nan"))
    workspace = k4v2.KVK4V2Workspace(1, k4v2.MAX_VERIFY_TOKENS, NUM_Q_HEADS, device=DEVICE)
    k4v2.kvk4v2_attention(
        q, w.cache, out, num_kv_heads=NUM_KV_HEADS,
        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
        seqused_k=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE), block_table=w.block_table,
        max_seqlen_q=q_len, softmax_scale=SCALE, workspace=workspace,
    )  # fmt: skip
    torch.cuda.synchronize()
    deq_key, deq_value = w.dequantized(k4v2)
    ref_deq = k4v2.reference_attention(q, deq_key, deq_value, SCALE)
    ref_bf16 = k4v2.reference_attention(q, w.key, w.value, SCALE)
    errors = attention_errors(out, ref_deq, ref_bf16)
    splits = k4v2.split_plan(seq_len, workspace.max_splits, k4v2.KVK4V2Config().min_split_tokens,
                             k4v2.KVK4V2Config().tile_n)
    print(f"ctx {seq_len} q {q_len} ({splits[0]} splits of {splits[1]}): {errors.line()}")
    record(f"kv_k4v2.attention.ctx{seq_len}.q{q_len}", asdict(errors))
    assert not errors.failures(), errors.failures()


GRAPH_Q_LEN = 8
GRAPH_REPLAYS = (
    ("contexts 25000/245760/128000", (25_000, 245_760, 128_000)),
    ("contexts 1000/300/130000", (1_000, 300, 130_000)),
)


def test_captured_graph_serves_later_context_lengths(k4v2, written):
    """Three requests (verify blocks of 8) over prefixes of one 245,760-token request, captured as
    vLLM captures (seq_lens filled with 1: fewer keys than query tokens), then replayed with real
    lengths written into the same tensors: right for every context (grids depend only on the
    number of requests, max_seqlen_q and the workspace; the split plan is made on the device)."""
    w = written(CONTEXTS[-1])
    num_seqs = 3
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    q = torch.randn((num_seqs * GRAPH_Q_LEN, NUM_Q_HEADS, HEAD_DIM), generator=gen, device=DEVICE).bfloat16()
    out = torch.full_like(q, float("nan"))
    cu_seqlens_q = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * GRAPH_Q_LEN
    seqused_k = torch.ones(num_seqs, dtype=torch.int32, device=DEVICE)
    block_table = w.block_table.expand(num_seqs, -1).contiguous()
    workspace = k4v2.KVK4V2Workspace(num_seqs, k4v2.MAX_VERIFY_TOKENS, NUM_Q_HEADS, device=DEVICE)

    def call():
        k4v2.kvk4v2_attention(q, w.cache, out, num_kv_heads=NUM_KV_HEADS, cu_seqlens_q=cu_seqlens_q,
                              seqused_k=seqused_k, block_table=block_table, max_seqlen_q=GRAPH_Q_LEN,
                              softmax_scale=SCALE, workspace=workspace)

    graph = warm_and_capture(call)
    finite = bool(torch.isfinite(out).all())
    print(f"graph: capture-time lengths (seq_len 1 < {GRAPH_Q_LEN} query tokens): finite output {finite}")
    assert finite
    deq_key, deq_value = w.dequantized(k4v2)
    for label, lengths in GRAPH_REPLAYS:
        seqused_k.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_deq = torch.cat([
            k4v2.reference_attention(q[i * GRAPH_Q_LEN : (i + 1) * GRAPH_Q_LEN], deq_key[:n], deq_value[:n], SCALE)
            for i, n in enumerate(lengths)
        ])
        ref_bf16 = torch.cat([
            k4v2.reference_attention(q[i * GRAPH_Q_LEN : (i + 1) * GRAPH_Q_LEN], w.key[:n], w.value[:n], SCALE)
            for i, n in enumerate(lengths)
        ])
        errors = attention_errors(out, ref_deq, ref_bf16)
        print(f"graph replay with {label}: {errors.line()}")
        record(f"kv_k4v2.graph.{label.replace(' ', '_').replace('/', '-')}", asdict(errors))
        assert not errors.failures(), f"{label}: {errors.failures()}"


PREFILL_ROWS = 2048  # a chunked-prefill step of `huge` (max_num_batched_tokens)


@pytest.mark.parametrize("seq_len", CONTEXTS[:2])
def test_prefill_chunk_deep_in_the_context_matches_the_torch_loop(k4v2, written, seq_len):
    """The last 2,048 positions of the request as one prefill chunk (its first 2,048 rows' keys
    already cached): `prefill_attention` (one launch of the split kernel over 128 virtual
    requests) against `prefill_attention_reference` (the torch loop over the dequantized pages,
    float32): the kernel-bug bounds. Both are timed (a figure, not a bound)."""
    w = written(seq_len)
    gen = torch.Generator(device=DEVICE).manual_seed(seq_len + 1)
    q = torch.randn((PREFILL_ROWS, NUM_Q_HEADS, HEAD_DIM), generator=gen, device=DEVICE).bfloat16()
    args = dict(num_kv_heads=NUM_KV_HEADS, cu_seqlens_q=torch.tensor([0, PREFILL_ROWS], dtype=torch.int32,
                device=DEVICE), seqused_k=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
                block_table=w.block_table, softmax_scale=SCALE)
    workspace = k4v2.KVK4V2Workspace(1, k4v2.MAX_VERIFY_TOKENS, NUM_Q_HEADS, device=DEVICE)
    timings = timed_prefill(k4v2, q, w.cache, args, workspace)
    (got, kernel_ms), (loop, loop_ms) = timings["kernel"], timings["torch_loop"]
    loop = loop.float()
    failures = dequantized_failures(got, loop)
    rel = float((got.float() - loop).norm() / loop.norm())
    print(f"prefill ctx {seq_len}, {PREFILL_ROWS} rows: kernel {kernel_ms:.1f} ms, torch loop {loop_ms:.1f} ms "
          f"per layer; rel error {rel:.2e}")
    record(f"kv_k4v2.prefill.ctx{seq_len}", {"kernel_ms": kernel_ms, "torch_loop_ms": loop_ms, "rel_error": rel})
    assert not failures, failures
