"""Paged KV caches in vLLM 0.28.0's Triton-backend layout, and the plain torch reference
for the split-KV verify kernel (patches/src/v1/attention/ops/qwen38_split_kv_verify.py).

Shared by tests/unit (Triton interpreter, small sizes), tests/gpu and the GPU benchmark
tests/gpu/bench_split_kv.py, so it needs only torch (and the kernel module needs
triton): no vLLM. tests/unit/test_split_kv_verify.py proves these views are the ones
vLLM's own backend builds.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
KERNEL_FILE = REPO / "patches" / "src" / "v1" / "attention" / "ops" / "qwen38_split_kv_verify.py"
# Where the module lands inside the vllm package once patch 0045 is applied.
KERNEL_MODULE_IN_VLLM = "vllm.v1.attention.ops.qwen38_split_kv_verify"

# vLLM's per-token-head layout: one float32 scale after each head's int8 data.
SCALE_PAD_INT8 = 4


def load_triton_file(path: Path, name: str, *, interpret: bool):
    """Import a module of Triton kernels from its file, once per process (as ``name``, or
    ``name_interpreted``). With `interpret`, its kernels are built for the Triton interpreter
    (TRITON_INTERPRET is read when `@triton.jit` runs, so it is set only for the import and
    not leaked to the rest of the process)."""
    name = f"{name}_interpreted" if interpret else name
    if name in sys.modules:
        return sys.modules[name]
    with _env("TRITON_INTERPRET", "1" if interpret else None):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def load_kernel_module(*, interpret: bool = False):
    """The split-KV verify kernel's module (see `load_triton_file`)."""
    return load_triton_file(KERNEL_FILE, "qwen38_split_kv_verify", interpret=interpret)


@contextmanager
def _env(key: str, value: str | None):
    old = os.environ.get(key)
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@dataclass
class PagedBatch:
    """One verify batch over a paged cache, laid out as vLLM's Triton backend sees it."""

    q: torch.Tensor  # (num_tokens, num_q_heads, head_dim)
    kv_cache: torch.Tensor  # logical (num_blocks, num_kv_heads, block_size, 2 * padded_head)
    key_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, padded_head) view
    value_cache: torch.Tensor
    k_scale_cache: torch.Tensor | None  # (num_blocks, block_size, num_kv_heads) float32 view
    v_scale_cache: torch.Tensor | None
    block_table: torch.Tensor  # (num_seqs, max_blocks) int32
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32
    seqused_k: torch.Tensor  # (num_seqs,) int32
    query_lens: list[int]
    seq_lens: list[int]
    head_dim: int
    softmax_scale: float

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens)

    @property
    def kernel_args(self) -> dict:
        return dict(
            cu_seqlens_q=self.cu_seqlens_q,
            seqused_k=self.seqused_k,
            block_table=self.block_table,
            max_seqlen_q=self.max_seqlen_q,
            softmax_scale=self.softmax_scale,
            k_scale_cache=self.k_scale_cache,
            v_scale_cache=self.v_scale_cache,
        )


def paged_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    kv_int8: bool,
    dtype: torch.dtype,
    layout: str = "NHD",
    block_padding: int = 0,
    device: str | torch.device = "cpu",
):
    """The layer's cache tensor and the backend's views of it.

    Mirrors `TritonAttentionBackend.get_kv_cache_shape` / `get_kv_cache_stride_order`
    and `TritonAttentionImpl._pth_key_value_caches` / `_ensure_scale_caches`;
    `block_padding` extra elements per block stand for a hybrid pool whose pages are
    larger than the attention data (the views then have a wider block stride).
    """
    cache_dtype = torch.int8 if kv_int8 else dtype
    padded = head_dim + (SCALE_PAD_INT8 if kv_int8 else 0)
    logical = (num_blocks, num_kv_heads, block_size, 2 * padded)
    if layout == "NHD":
        physical = (num_blocks, block_size, num_kv_heads, 2 * padded)
        to_logical = (0, 2, 1, 3)
    elif layout == "HND":
        physical = logical
        to_logical = (0, 1, 2, 3)
    else:
        raise ValueError(f"layout must be NHD or HND, found {layout!r}")
    per_block = block_size * num_kv_heads * 2 * padded
    raw = torch.zeros(num_blocks * (per_block + block_padding), dtype=cache_dtype, device=device)
    blocks = raw.view(num_blocks, per_block + block_padding)[:, :per_block]
    kv_cache = blocks.unflatten(1, physical[1:]).permute(*to_logical)
    assert kv_cache.shape == logical
    key_cache, value_cache = kv_cache.transpose(1, 2).split(padded, dim=-1)
    if not kv_int8:
        return kv_cache, key_cache, value_cache, None, None
    # Float32 views of the 4 pad bytes after each head's data (as _ensure_scale_caches).
    f32 = torch.tensor([], dtype=torch.float32, device=device).set_(kv_cache.untyped_storage())
    strides = [s // 4 for s in kv_cache.stride()]
    base = kv_cache.storage_offset() // 4
    views = [
        torch.as_strided(
            f32,
            size=(num_blocks, block_size, num_kv_heads),
            stride=(strides[0], strides[2], strides[1]),
            storage_offset=base + offset // 4,
        )
        for offset in (head_dim, padded + head_dim)
    ]
    return kv_cache, key_cache, value_cache, views[0], views[1]


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales as vLLM's cache store writes them
    (`_reshape_cache_per_token_head`): scale = max(absmax / 127, 1e-6), round half away
    from zero, clamp to [-128, 127]. x: (..., head_dim)."""
    x = x.float()
    scale = torch.clamp(x.abs().amax(dim=-1) / 127.0, min=1e-6)
    scaled = x * (1.0 / scale)[..., None]
    scaled = torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5)
    return torch.clamp(scaled, -128.0, 127.0).trunc().to(torch.int8), scale


def fill_block_table(seq_lens: list[int], block_size: int, pages, width: int) -> torch.Tensor:
    """An int32 block table (one row per request, ``width`` columns, zeros past its pages)
    handing each request its pages in turn from ``pages`` (e.g. a shuffled page order)."""
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for row, seq_len in enumerate(seq_lens):
        count = -(-seq_len // block_size)
        table[row, :count] = torch.as_tensor(pages[used : used + count], dtype=torch.int32)
        used += count
    return table


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_int8: bool,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "NHD",
    block_padding: int = 0,
    spare_blocks: int = 3,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random queries and keys/values for requests of `context_lens[i]` cached tokens
    plus `query_lens[i]` verify tokens (their K/V already in the cache, as when the
    backend's forward runs), on shuffled pages with spare pages left unused."""
    # Every random number comes from one CPU generator, whatever the device: a case is
    # the same batch on a GPU as here, so a GPU result can be re-derived on CPU.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    kv_cache, key_cache, value_cache, k_scales, v_scales = paged_kv_cache(
        num_blocks, block_size, num_kv_heads, head_dim, kv_int8=kv_int8, dtype=dtype, layout=layout,
        block_padding=block_padding, device=device,
    )
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = fill_block_table(seq_lens, block_size, order, max(max(blocks_per_seq), 1) + 1)
    for row, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            continue
        positions = torch.arange(seq_len)
        pages = block_table[row, positions // block_size].long().to(device)
        slots = (positions % block_size).to(device)
        for cache, scales in ((key_cache, k_scales), (value_cache, v_scales)):
            values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(device)
            if kv_int8:
                data, scale = quantize_per_token_head(values)
                cache[pages, slots, :, :head_dim] = data
                scales[pages, slots] = scale
            else:
                cache[pages, slots, :, :head_dim] = values.to(dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    return PagedBatch(
        q=q,
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        k_scale_cache=k_scales,
        v_scale_cache=v_scales,
        block_table=block_table.to(device),
        cu_seqlens_q=torch.tensor(starts, dtype=torch.int32, device=device),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens=list(query_lens),
        seq_lens=seq_lens,
        head_dim=head_dim,
        softmax_scale=head_dim**-0.5,
    )


def gather_kv(batch: PagedBatch, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request `seq`'s keys and values in position order, dequantized, float32:
    (seq_len, num_kv_heads, head_dim) each."""
    seq_len = batch.seq_lens[seq]
    block_size = batch.key_cache.shape[1]
    positions = torch.arange(seq_len, device=batch.block_table.device)
    pages = batch.block_table[seq, positions // block_size].long()
    slots = positions % block_size
    keys = batch.key_cache[pages, slots, :, : batch.head_dim].float()
    values = batch.value_cache[pages, slots, :, : batch.head_dim].float()
    if batch.k_scale_cache is not None:
        keys = keys * batch.k_scale_cache[pages, slots][..., None]
        values = values * batch.v_scale_cache[pages, slots][..., None]
    return keys, values


@dataclass(frozen=True)
class Reference:
    """The float32 answer and, per output element, the size of what was summed into it:
    ``magnitude = sum_i p_i |v_i|`` (softmax weights times dequantized values), which
    bounds the error of rounding each weighted term once."""

    out: torch.Tensor
    magnitude: torch.Tensor

    def __getitem__(self, index) -> Reference:
        return Reference(self.out[index], self.magnitude[index])


def reference_attention(batch: PagedBatch) -> Reference:
    """Plain math in float32: gather the pages, dequantize, causal-masked softmax.
    Returns the (num_tokens, num_q_heads, head_dim) float32 output and its magnitude."""
    num_q_heads = batch.q.shape[1]
    out = torch.zeros(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    magnitude = torch.zeros_like(out)
    start = 0
    for seq, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        if q_len == 0 or seq_len == 0:
            start += q_len
            continue
        keys, values = gather_kv(batch, seq)  # (seq_len, num_kv_heads, head_dim)
        num_kv_heads = keys.shape[1]
        # Query head h reads KV head h // group (vLLM's GQA mapping).
        q = batch.q[start : start + q_len].float().unflatten(1, (num_kv_heads, num_q_heads // num_kv_heads))
        scores = torch.einsum("qkgd,nkd->kgqn", q, keys) * batch.softmax_scale
        query_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, None, :] > query_pos[None, None, :, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        attended = torch.einsum("kgqn,nkd->qkgd", weights, values)
        out[start : start + q_len] = attended.flatten(1, 2)
        magnitude[start : start + q_len] = torch.einsum("kgqn,nkd->qkgd", weights, values.abs()).flatten(1, 2)
        start += q_len
    return Reference(out, magnitude)


# ---- The correctness matrix: small cases for the interpreter, full sizes for a GPU ----


@dataclass(frozen=True)
class Case:
    """One verify batch: every request i has context_lens[i] cached tokens and
    query_lens[i] verify tokens."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    kv_int8: bool
    dtype: torch.dtype = torch.bfloat16
    layout: str = "NHD"
    block_padding: int = 0
    max_splits: int = 32
    min_split_tokens: int = 256
    tile_n: int = 32

    @property
    def id(self) -> str:
        return f"{self.name}-{'int8' if self.kv_int8 else str(self.dtype).removeprefix('torch.')}"

    def batch(self, device: str | torch.device = "cpu", seed: int = 0) -> PagedBatch:
        return make_batch(
            list(self.query_lens), list(self.context_lens), num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
            kv_int8=self.kv_int8, dtype=self.dtype, layout=self.layout, block_padding=self.block_padding,
            device=device, seed=seed,
        )


def small_cases() -> list[Case]:
    """Interpreter-sized (each program is interpreted, so requests, tokens and heads are
    few): contexts of 0 (the verify block alone), 1, a page minus one, exactly one page,
    a last split that only the last query tokens see (16-token splits: 25 + 8, 17 + 16),
    and many splits (181); query blocks of 1, 2, 8, 16; GQA 3, 4 and 6 with 1, 2 and 4
    KV heads; Qwen3.8's 24/4/256; both cache layouts, padded pages, a 48-token page."""
    small = dict(max_splits=8, min_split_tokens=16, tile_n=16)
    cases = []
    for kv_int8 in (False, True):
        cases += [
            Case("gqa3-d32-q1", 3, 1, 32, 16, (1,) * 5, (0, 1, 15, 16, 181), kv_int8, **small),
            Case("gqa3-d32-q2", 3, 1, 32, 16, (2,) * 3, (14, 25, 181), kv_int8, **small),
            Case("gqa3-d32-q8", 3, 1, 32, 16, (8,) * 4, (0, 8, 25, 181), kv_int8, **small),
            Case("gqa3-d32-q16", 3, 1, 32, 16, (16,) * 3, (0, 17, 181), kv_int8, **small),
            Case("qwen38-24x4x256-q8", 24, 4, 256, 16, (8,), (93,), kv_int8,
                 max_splits=4, min_split_tokens=32, tile_n=32),
            Case("qwen38-24x4x256-q16", 24, 4, 256, 32, (16,), (70,), kv_int8,
                 max_splits=4, min_split_tokens=32, tile_n=16),
            Case("mixed-query-lens-gqa3x2-block48", 6, 2, 32, 48, (1, 8, 3, 16), (200, 7, 64, 33), kv_int8,
                 **small),
            Case("hnd-padded-pages-gqa4-d64", 4, 1, 64, 32, (8, 2), (100, 300), kv_int8, layout="HND",
                 block_padding=64, max_splits=16, min_split_tokens=32, tile_n=16),
        ]
    cases.append(Case("fp16-gqa3-d32-q8", 3, 1, 32, 16, (8, 8), (5, 150), False, dtype=torch.float16, **small))
    return cases


def full_cases() -> list[Case]:
    """GPU-sized: Qwen3.8-27B's attention (24 query heads, 4 KV heads, head_dim 256),
    contexts from 0 to 128k in one batch, the default launch shape."""
    cases = []
    contexts = (0, 1000, 4097, 25000, 131072)
    for kv_int8 in (False, True):
        for q in (1, 2, 8, 16):
            cases.append(Case(f"qwen38-q{q}", 24, 4, 256, 16, (q,) * len(contexts), contexts, kv_int8))
        cases += [
            # A hybrid pool's attention pages: block size promoted to a non-power of two,
            # page padded to the shared page size.
            Case("qwen38-block528-hnd-padded", 24, 4, 256, 528, (8, 16, 1), (60000, 9, 1056), kv_int8,
                 layout="HND", block_padding=4096),
            Case("small-heads-gqa3-d64", 6, 2, 64, 16, (8, 3), (3000, 70000), kv_int8),
        ]
    return cases


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) against the float32 reference. A tensor-core attention rounds twice to
    dtype: each weighted value term before the P.V product (the probability; with int8 KV
    the probability times the key's V scale) and the output. Rounding each term once errs
    by at most u * sum|terms| = u * magnitude, the output by u * |out| (u: dtype's unit
    roundoff, 2^-8 bf16, 2^-11 fp16), so the error is within
    atol + rtol * max(|ref|, magnitude) with rtol = 2u (fp16: 4u). Never tighter than a
    bound in |ref| alone (magnitude >= |ref|), which is wrong where a few large terms
    cancel: with int8 KV even the dominant key's term is rounded (bf16's weight of exactly
    1 is not), so a small output can carry an error of its terms' size (docs/split-kv.md)."""
    if dtype == torch.float16:
        return 1e-3, 2.0**-9
    return 4e-3, 2.0**-7


def compare(out: torch.Tensor, ref: Reference, dtype: torch.dtype) -> tuple[float, bool]:
    """(max abs error, within tolerance) of out against the reference."""
    atol, rtol = tolerance(dtype)
    err = (out.float() - ref.out).abs()
    bound = atol + rtol * torch.maximum(ref.out.abs(), ref.magnitude)
    ok = bool(torch.all(err <= bound).item()) and bool(torch.isfinite(out).all().item())
    return float(err.max().item()) if err.numel() else 0.0, ok


def run_case(module, case: Case, device: str | torch.device = "cpu", *, unsplit: bool = False):
    """Run the kernel on a case's batch; returns (out, reference, batch)."""
    batch = case.batch(device)
    config = module.SplitKVConfig(tile_n=case.tile_n, min_split_tokens=case.min_split_tokens)
    out = torch.full_like(batch.q, float("nan"))
    if unsplit:
        module.unsplit_verify_attention(batch.q, batch.key_cache, batch.value_cache, out, config=config,
                                        **batch.kernel_args)
    else:
        workspace = module.SplitKVWorkspace(
            len(case.query_lens), max(case.query_lens), case.num_q_heads, case.head_dim,
            max_splits=case.max_splits, device=device,
        )
        module.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out, workspace=workspace,
                                         config=config, **batch.kernel_args)
    return out, reference_attention(batch), batch


def warm_and_capture(call):
    """``call`` run once on a side stream (Triton compiles outside the capture), as vLLM warms
    up before it captures, then captured into a CUDA graph: the graph (its warm-up output left
    in place for the caller to check)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def graph_replay_check(module, kv_int8: bool, device: str = "cuda") -> list[tuple[str, float, bool]]:
    """Capture the kernel in a CUDA graph as vLLM captures (seq_lens filled with 1: fewer
    keys than query tokens), then write real lengths into the same tensors and replay,
    twice with different contexts. Returns (label, max abs error, ok) per step; the
    capture step's error is 0 when its output is finite."""
    q_len, contexts = 8, [25000, 131072, 0, 4097]
    batch = make_batch([q_len] * 4, contexts, num_q_heads=24, num_kv_heads=4, head_dim=256, block_size=448,
                       kv_int8=kv_int8, device=device)
    real_seq_lens = batch.seqused_k.clone()
    seqused = batch.seqused_k
    workspace = module.SplitKVWorkspace(4, 16, 24, 256, device=device)
    out = torch.full_like(batch.q, float("nan"))

    def call():
        module.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out, workspace=workspace,
                                         **batch.kernel_args)

    results = []
    seqused.fill_(1)
    graph = warm_and_capture(call)
    finite = bool(torch.isfinite(out).all().item())
    results.append(("capture-time lengths (seq_len 1 < 8 query tokens): finite output", 0.0 if finite else float("nan"),
                    finite))
    for label, lengths in (
        ("replay with contexts 25000/131072/0/4097", real_seq_lens),
        ("replay with contexts 1000/16/0/300", torch.tensor([1000, 16, 0, 300], device=device) + q_len),
    ):
        seqused.copy_(lengths.to(torch.int32))
        batch.seq_lens = lengths.tolist()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err, ok = compare(out, reference_attention(batch), batch.q.dtype)
        results.append((label, err, ok))
    return results




def worst_element(out: torch.Tensor, ref: Reference, batch: PagedBatch) -> str:
    """Where out is furthest from the reference (past its bound, if anywhere): request,
    context, query token, head, dim, and the values; device-independent batches make the
    same element re-derivable on CPU from a GPU run's line."""
    atol, rtol = tolerance(batch.q.dtype)
    err = (out.float() - ref.out).abs()
    excess = err - (atol + rtol * torch.maximum(ref.out.abs(), ref.magnitude))
    flat = int(excess.argmax())
    token, rest = divmod(flat, out.shape[1] * out.shape[2])
    head, dim = divmod(rest, out.shape[2])
    seq = sum(int(c) <= token for c in batch.cu_seqlens_q[1:].tolist())
    first = int(batch.cu_seqlens_q[seq])
    return (
        f"request {seq} (context {batch.seq_lens[seq] - batch.query_lens[seq]}), query token {token - first}, "
        f"head {head}, dim {dim}: out {float(out[token, head, dim]):.5f}, ref {float(ref.out[token, head, dim]):.5f}, "
        f"magnitude {float(ref.magnitude[token, head, dim]):.5f}, error {float(err[token, head, dim]):.3e}"
    )


# ---- int8 numerics: what the kernel's arithmetic is, written out in torch ----


def emulate_int8_arithmetic(
    batch: PagedBatch, tile_n: int, *, round_scaled_probabilities: bool = True
) -> torch.Tensor:
    """The kernel's (and vLLM's unified kernel's) int8_per_token_head arithmetic in torch,
    for a one-split walk over tiles of ``tile_n`` keys: scores = (q . k_int8) x K scale,
    the online softmax (running max, p = exp2(scores - max), rescaled sums), the P.V operand
    ``p x V scale`` rounded to bf16 (the tensor-core operand; vLLM:
    ``(P * v_token_head_scales).to(V.dtype)``) times the exact int8 values, fp32 sums,
    output rounded to bf16. ``round_scaled_probabilities=False`` keeps that operand in
    fp32: only the output rounding is left."""
    log2e = 1.4426950408889634
    out = torch.zeros(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    block_size = batch.key_cache.shape[1]
    start = 0
    for seq, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        if q_len == 0 or seq_len == 0:
            start += q_len
            continue
        positions = torch.arange(seq_len, device=batch.q.device)
        pages = batch.block_table[seq, positions // block_size].long()
        slots = positions % block_size
        keys = batch.key_cache[pages, slots, :, : batch.head_dim].float()  # int8 values, exact
        values = batch.value_cache[pages, slots, :, : batch.head_dim].float()
        k_scale = batch.k_scale_cache[pages, slots].T[:, None, None, :]  # (kv_heads, 1, 1, keys)
        v_scale = batch.v_scale_cache[pages, slots].T[:, None, None, :]
        num_kv_heads = keys.shape[1]
        q = batch.q[start : start + q_len].float().unflatten(1, (num_kv_heads, -1))
        scores = torch.einsum("qkgd,nkd->kgqn", q, keys) * k_scale * (batch.softmax_scale * log2e)
        query_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        scores = scores.masked_fill(positions[None, None, None, :] > query_pos[None, None, :, None], float("-inf"))
        m = torch.full(scores.shape[:-1], float("-inf"), device=q.device)
        total = torch.zeros_like(m)
        acc = torch.zeros((*scores.shape[:-1], batch.head_dim), device=q.device)
        for lo in range(0, seq_len, tile_n):
            tile = scores[..., lo : lo + tile_n]
            m_new = torch.maximum(m, tile.amax(dim=-1))
            shift = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp2(m - shift)
            p = torch.exp2(tile - shift[..., None])
            total = total * alpha + p.sum(dim=-1)
            operand = p * v_scale[..., lo : lo + tile_n]
            if round_scaled_probabilities:
                operand = operand.to(torch.bfloat16).float()
            acc = acc * alpha[..., None] + torch.einsum("kgqn,nkd->kgqd", operand, values[lo : lo + tile_n])
            m = m_new
        out[start : start + q_len] = (acc / total[..., None]).to(torch.bfloat16).float().permute(2, 0, 1, 3).flatten(1, 2)
        start += q_len
    return out


def dequantized_attention_from_page_bytes(batch: PagedBatch) -> torch.Tensor:
    """The exact answer in float64, read from the cache's bytes without its views: each
    (token, KV head) half-row is head_dim int8 values then the float32 scale's 4 bytes
    (vLLM's int8_per_token_head page row), dequantized per token and head."""
    import numpy as np

    head_dim = batch.head_dim
    padded = head_dim + SCALE_PAD_INT8
    rows = batch.kv_cache.contiguous().numpy()  # (blocks, kv_heads, block_size, 2 * padded) int8
    halves = [rows[..., :padded], rows[..., padded:]]
    dequantized = []
    for half in halves:
        data = half[..., :head_dim].astype(np.float64)
        scale = np.ascontiguousarray(half[..., head_dim:]).view(np.float32)[..., 0].astype(np.float64)
        dequantized.append(torch.from_numpy(data * scale[..., None]))  # (blocks, kv_heads, block_size, head_dim)
    keys_all, values_all = dequantized
    block_size = batch.key_cache.shape[1]
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    start = 0
    for seq, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        if q_len == 0 or seq_len == 0:
            start += q_len
            continue
        positions = torch.arange(seq_len)
        pages = batch.block_table[seq, positions // block_size].long().cpu()
        slots = positions % block_size
        keys = keys_all[pages, :, slots]  # (seq_len, kv_heads, head_dim)
        values = values_all[pages, :, slots]
        q = batch.q[start : start + q_len].cpu().double().unflatten(1, (keys.shape[1], -1))
        scores = torch.einsum("qkgd,nkd->kgqn", q, keys) * batch.softmax_scale
        query_pos = seq_len - q_len + torch.arange(q_len)
        scores = scores.masked_fill(positions[None, None, None, :] > query_pos[None, None, :, None], float("-inf"))
        out[start : start + q_len] = torch.einsum("kgqn,nkd->qkgd", torch.softmax(scores, -1), values).flatten(1, 2)
        start += q_len
    return out
