# SPDX-License-Identifier: Apache-2.0
"""Split-KV paged attention for the speculative verify step (qwen38 patch 0045).

A verify step scores a short block of query tokens per request (1 + K drafted, up to
16 with lookup drafting) against a long cached context. vLLM 0.28.0's Triton unified
attention only splits the KV dimension when every request has one query token (its
3D path); a verify batch takes the 2D path, where one program walks the whole context
for a few query tokens of one KV head (two at GQA 6), so a 128k-token context is read by
a handful of programs while the GPU idles. This module splits the context instead:

phase 1  grid (request, KV head x query tile, split): one program takes every query
         head of its KV head (GQA) and every query token of its tile, walks its slice
         of the paged context once (each KV tile is loaded once for all of them) and
         writes a partial output with its running max and sum (online softmax);
phase 2  grid (request, query token, query head): merges the partials of the splits.

Graph safety: the grids depend only on the number of requests, `max_seqlen_q` and the
workspace's fixed `max_splits`, never on sequence lengths. Each program reads its
request's length on the device and derives the split plan there (`_split_plan`), so a
captured CUDA graph stays right for any context length; programs past a request's
splits return at once. The scratch is allocated once (`SplitKVWorkspace`).

Cache layout (vLLM 0.28.0 `TritonAttentionBackend`): the per-layer tensor is logically
(num_blocks, num_kv_heads, block_size, 2 * padded_head) with NHD or HND strides; the
backend's views are `key_cache`, `value_cache` of shape
(num_blocks, block_size, num_kv_heads, padded_head) - any strides, unit stride on the
last dim. `int8_per_token_head` pads each half by 4 bytes that hold one float32 scale
(absmax / 127) per (token, head); the backend exposes them as strided float32 views
(num_blocks, block_size, num_kv_heads). Dequantization happens in registers: int8 to
the query dtype is exact, and the scales multiply the scores (K) and the probabilities
(V) - the same products as dequantizing the tiles, without a second tile-sized multiply.

Masking: request r has `q_len = cu_seqlens_q[r+1] - cu_seqlens_q[r]` query tokens and
`seq_len = seqused_k[r]` keys (the query tokens' own K/V already written to the cache);
query token i sits at position `seq_len - q_len + i` and sees keys at positions <= its
own (causal inside the verify block). Padding requests (q_len 0 or seq_len 0, as the V2
runner pads full CUDA graphs) write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Scores are kept in the log2 domain (exp2 is the native instruction).
_LOG2E = 1.4426950408889634

# Where the kernel stops being exact: the features of `unified_attention` it lacks.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "int8_per_token_head")
SUPPORTED_QUERY_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256

# Dispatch defaults. Provisional until the lent-GPU figures (docs/split-kv.md) are in:
# below MIN_CONTEXT_TOKENS the unified kernel's few programs are already enough.
MIN_CONTEXT_TOKENS = 1024
DEFAULT_MAX_SPLITS = 32
# The longest verify block: 1 + 7 drafted + 8 lookup tokens.
MAX_VERIFY_TOKENS = 16


@dataclass(frozen=True)
class SplitKVConfig:
    """Launch shape. `min_split_tokens` keeps short contexts in few splits (each split
    costs a partial store and a share of the merge); `tile_n` is the KV tile (tokens
    per inner step); `block_m_cap` bounds the query rows (tokens x heads of one KV
    head) a program holds, which bounds its registers at head_dim 256."""

    tile_n: int = 32
    num_warps: int | None = None  # None: 8 at head_dim >= 256 (the accumulator's registers), else 4
    num_stages: int = 2
    block_m_cap: int = 64
    min_split_tokens: int = 256

    def warps_for(self, head_dim: int) -> int:
        if self.num_warps is not None:
            return self.num_warps
        return 8 if head_dim >= 256 else 4

    def __post_init__(self) -> None:
        for name in ("tile_n", "block_m_cap"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"SplitKVConfig.{name} must be a power of two >= 16, found {value}")
        if self.min_split_tokens < self.tile_n or self.min_split_tokens % self.tile_n:
            raise ValueError(
                f"SplitKVConfig.min_split_tokens must be a multiple of tile_n={self.tile_n}, "
                f"found {self.min_split_tokens}"
            )


@dataclass(frozen=True)
class QueryTiling:
    """How a request's query tokens are cut into programs: `tokens_per_program`
    tokens x `group` query heads fill `block_m` rows (a power of two >= 16)."""

    tokens_per_program: int
    block_m: int
    num_tiles: int


def query_tiling(max_seqlen_q: int, group: int, block_m_cap: int = 64) -> QueryTiling:
    """The largest token count per program whose rows fit `block_m_cap` (at least one
    token, even when one token's heads alone exceed the cap)."""
    tokens = max(1, min(max_seqlen_q, block_m_cap // group))
    block_m = max(16, triton.next_power_of_2(tokens * group))
    return QueryTiling(tokens, block_m, triton.cdiv(max_seqlen_q, tokens))


def split_plan(seq_len: int, max_splits: int, min_split_tokens: int, tile_n: int) -> tuple[int, int]:
    """(number of splits, tokens per split) for one request: the host twin of
    `_split_plan`, for tests and docs. At least `min_split_tokens` per split, at most
    `max_splits` splits, split sizes a multiple of the KV tile."""
    if seq_len <= 0:
        return 0, 0
    per_split = max(min_split_tokens, -(-seq_len // max_splits))
    per_split = -(-per_split // tile_n) * tile_n
    return -(-seq_len // per_split), per_split


class SplitKVWorkspace:
    """Scratch for the partial results, allocated once per model (all attention layers
    of a KV-cache group run one after another and share it), sized from the engine's
    limits so no call allocates and captured CUDA graphs keep their pointers.

    partial_out  float32 (max_num_seqs, max_query_tokens, num_q_heads, max_splits, head_dim)
    partial_max  float32 (max_num_seqs, max_query_tokens, num_q_heads, max_splits)  log2 domain
    partial_sum  float32 (same)
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_query_tokens: int,
        num_q_heads: int,
        head_dim: int,
        max_splits: int = DEFAULT_MAX_SPLITS,
        device: torch.device | str = "cuda",
    ) -> None:
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two >= 1, found {max_splits}")
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_query_tokens", max_query_tokens),
            ("num_q_heads", num_q_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, found {value}")
        self.max_num_seqs = max_num_seqs
        self.max_query_tokens = max_query_tokens
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.max_splits = max_splits
        shape = (max_num_seqs, max_query_tokens, num_q_heads, max_splits)
        self.partial_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
        self.partial_max = torch.empty(shape, dtype=torch.float32, device=device)
        self.partial_sum = torch.empty(shape, dtype=torch.float32, device=device)

    @staticmethod
    def nbytes_for(
        max_num_seqs: int, max_query_tokens: int, num_q_heads: int, head_dim: int, max_splits: int = DEFAULT_MAX_SPLITS
    ) -> int:
        """Bytes the workspace takes (for memory planning, before allocating)."""
        return 4 * max_num_seqs * max_query_tokens * num_q_heads * max_splits * (head_dim + 2)

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(
            self.max_num_seqs, self.max_query_tokens, self.num_q_heads, self.head_dim, self.max_splits
        )


def split_kv_unsupported_reason(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    query_dtype: torch.dtype,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float = 0.0,
    has_sinks: bool = False,
    has_alibi: bool = False,
    has_output_quant: bool = False,
    has_mm_prefix: bool = False,
) -> str | None:
    """Why this kernel would not compute what `unified_attention` computes for a layer,
    or None when it is exact for it. Per layer (fixed for a model): check it once."""
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        return f"kv_cache_dtype {kv_cache_dtype!r} (supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)})"
    if query_dtype not in SUPPORTED_QUERY_DTYPES:
        return f"query dtype {query_dtype} (supported: bfloat16, float16)"
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if not 16 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} outside 16..{MAX_HEAD_DIM}"
    if not causal:
        return "non-causal attention"
    if sliding_window is not None and sliding_window > 0:
        return "sliding window"
    if logits_soft_cap:
        return "logits soft cap"
    if has_sinks:
        return "attention sinks"
    if has_alibi:
        return "ALiBi"
    if has_output_quant:
        return "fused output quantization"
    if has_mm_prefix:
        return "multimodal prefix ranges"
    return None


def use_split_kv(
    num_query_tokens: int,
    context_len: int | None,
    *,
    num_seqs: int = 1,
    workspace: SplitKVWorkspace | None = None,
    min_context: int = MIN_CONTEXT_TOKENS,
) -> bool:
    """Whether a batch should take the split-KV kernel (the layer itself having passed
    `split_kv_unsupported_reason`).

    num_query_tokens  the batch's largest query block (max_seqlen_q)
    context_len       its longest sequence (max_seqlen_k), or None when the decision must
                      hold for any context (full CUDA graphs: the captured kernel serves
                      every later context; with the split plan made on the device it is
                      exact for all of them, and at a short context it degenerates to a
                      few splits - see docs/split-kv.md for the measured cost there).

    Single-token batches stay with `unified_attention` (its 3D decode path already
    splits); prefill-sized blocks stay with it too (they fill the GPU by themselves and
    do not fit the workspace).
    """
    if num_query_tokens < 2:
        return False
    if workspace is None:
        if num_query_tokens > MAX_VERIFY_TOKENS:
            return False
    elif num_query_tokens > workspace.max_query_tokens or num_seqs > workspace.max_num_seqs:
        return False
    if context_len is None:
        return True
    return context_len >= min_context


@triton.jit
def _split_plan(seq_len, MAX_SPLITS: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr, TILE_N: tl.constexpr):
    # Same arithmetic as the host `split_plan`; phase 1 and phase 2 must agree.
    per_split = tl.maximum(MIN_SPLIT_TOKENS, (seq_len + MAX_SPLITS - 1) // MAX_SPLITS)
    per_split = (per_split + TILE_N - 1) // TILE_N * TILE_N
    num_splits = (seq_len + per_split - 1) // per_split
    return num_splits, per_split


@triton.jit
def _round_to_bf16(x):
    # fp32 -> nearest bf16 (ties to even), kept in fp32: what the GPU's cvt does.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _as_dot_operand(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x as a tensor-core operand of DTYPE. Under the Triton interpreter (which keeps
    bf16 as uint16, multiplies those integers in tl.dot and truncates fp32 -> bf16) the
    operand is the same value held in fp32, so the dot there computes what the GPU's
    bf16 x bf16 -> fp32 dot computes."""
    if INTERPRETED:
        x = x.to(tl.float32)
        if DTYPE == tl.bfloat16:
            x = _round_to_bf16(x)
        else:
            x = x.to(DTYPE).to(tl.float32)
        return x
    else:
        return x.to(DTYPE)


@triton.jit
def _to_output(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED and DTYPE == tl.bfloat16:
        x = _round_to_bf16(x)
    return x.to(DTYPE)


@triton.jit
def _split_kv_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seqused_k_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_blk,
    stride_k_slot,
    stride_k_head,
    stride_v_blk,
    stride_v_slot,
    stride_v_head,
    stride_ks_blk,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_blk,
    stride_vs_slot,
    stride_vs_head,
    stride_bt,
    stride_p_seq,
    stride_p_tok,
    stride_p_head,
    stride_p_split,
    stride_m_seq,
    stride_m_tok,
    stride_m_head,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    KV_INT8: tl.constexpr,
    INTERPRETED: tl.constexpr,
    WRITE_OUTPUT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) % NUM_KV_HEADS
    q_tile = tl.program_id(1) // NUM_KV_HEADS
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seqused_k_ptr + seq)
    tok0 = q_tile * TOKENS_PER_PROGRAM
    if tok0 >= q_len:
        return
    if seq_len <= 0:
        return
    if WRITE_OUTPUT:
        # The unsplit baseline: one program walks the whole context.
        num_splits = 1
        per_split = seq_len
    else:
        num_splits, per_split = _split_plan(seq_len, MAX_SPLITS, MIN_SPLIT_TOKENS, TILE_N)
    if split >= num_splits:
        return
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS_PER_PROGRAM * GROUP) & (tok < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + q_head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = _as_dot_operand(q, q_ptr.dtype.element_ty, INTERPRETED)
    q_pos = context_len + tok

    # This split's keys, cut at the last key any row of this program may see.
    kv_lo = split * per_split
    last_tok = tl.minimum(tok0 + TOKENS_PER_PROGRAM, q_len)
    kv_hi = tl.minimum(tl.minimum(kv_lo + per_split, seq_len), context_len + last_tok)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + cols
        pos_ok = pos < kv_hi
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE

        k_off = blk * stride_k_blk + slot * stride_k_slot + kv_head * stride_k_head
        k = tl.load(
            k_cache_ptr + k_off[None, :] + dims[:, None], mask=dim_ok[:, None] & pos_ok[None, :], other=0.0
        )
        # int8 -> bf16/fp16 is exact: the scale is applied to the scores below.
        s = tl.dot(q, _as_dot_operand(k, q_ptr.dtype.element_ty, INTERPRETED))
        if KV_INT8:
            k_scale = tl.load(
                k_scale_ptr + blk * stride_ks_blk + slot * stride_ks_slot + kv_head * stride_ks_head,
                mask=pos_ok,
                other=0.0,
            )
            s = s * (k_scale * scale_log2)[None, :]
        else:
            s = s * scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps -inf; shift by 0 so nothing turns NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_off = blk * stride_v_blk + slot * stride_v_slot + kv_head * stride_v_head
        v = tl.load(
            v_cache_ptr + v_off[:, None] + dims[None, :], mask=pos_ok[:, None] & dim_ok[None, :], other=0.0
        )
        if KV_INT8:
            v_scale = tl.load(
                v_scale_ptr + blk * stride_vs_blk + slot * stride_vs_slot + kv_head * stride_vs_head,
                mask=pos_ok,
                other=0.0,
            )
            p = p * v_scale[None, :]
        p_in = _as_dot_operand(p, q_ptr.dtype.element_ty, INTERPRETED)
        acc = acc * alpha[:, None] + tl.dot(p_in, _as_dot_operand(v, q_ptr.dtype.element_ty, INTERPRETED))
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if WRITE_OUTPUT:
        o_rows = (q_start + tok).to(tl.int64) * stride_o_tok + q_head * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + dims[None, :],
            _to_output(o, out_ptr.dtype.element_ty, INTERPRETED),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        p_rows = (
            seq.to(tl.int64) * stride_p_seq + tok * stride_p_tok + q_head * stride_p_head + split * stride_p_split
        )
        tl.store(part_out_ptr + p_rows[:, None] + dims[None, :], o, mask=row_ok[:, None] & dim_ok[None, :])
        m_rows = seq.to(tl.int64) * stride_m_seq + tok * stride_m_tok + q_head * stride_m_head + split
        tl.store(part_max_ptr + m_rows, m_i, mask=row_ok)
        tl.store(part_sum_ptr + m_rows, l_i, mask=row_ok)


@triton.jit
def _split_kv_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    cu_seqlens_q_ptr,
    seqused_k_ptr,
    stride_o_tok,
    stride_o_head,
    stride_p_seq,
    stride_p_tok,
    stride_p_head,
    stride_p_split,
    stride_m_seq,
    stride_m_tok,
    stride_m_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    seq = tl.program_id(0)
    tok = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seqused_k_ptr + seq)
    if tok >= q_len:
        return
    if seq_len <= 0:
        return
    num_splits, _ = _split_plan(seq_len, MAX_SPLITS, MIN_SPLIT_TOKENS, TILE_N)

    splits = tl.arange(0, MAX_SPLITS)
    split_ok = splits < num_splits
    m_base = seq.to(tl.int64) * stride_m_seq + tok * stride_m_tok + head * stride_m_head
    m = tl.load(part_max_ptr + m_base + splits, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + m_base + splits, mask=split_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    # A split that saw no key for this row (m = -inf, l = 0) weighs 0.
    w = tl.exp2(m - m_max) * l
    dims = tl.arange(0, HEAD_DIM_PAD)
    p_base = seq.to(tl.int64) * stride_p_seq + tok * stride_p_tok + head * stride_p_head
    parts = tl.load(
        part_out_ptr + p_base + splits[:, None] * stride_p_split + dims[None, :],
        mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    o = tl.sum(parts * w[:, None], axis=0) / total
    o_off = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_off + dims, _to_output(o, out_ptr.dtype.element_ty, INTERPRETED), mask=dims < HEAD_DIM)


def _interpreted(kernel) -> bool:
    # Under TRITON_INTERPRET=1 (CPU tests) the kernels emulate the GPU's numerics; see
    # _as_dot_operand.
    return type(kernel).__name__ == "InterpretedFunction"


def _check_inputs(q, key_cache, value_cache, out, k_scale_cache, v_scale_cache) -> tuple[int, int, int, bool]:
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(
            f"q and out must be (num_tokens, num_heads, head_dim), found {tuple(q.shape)} / {tuple(out.shape)}"
        )
    if q.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("q, out and the K/V cache views need a unit stride on the head dim")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    kv_int8 = key_cache.dtype == torch.int8
    if kv_int8 != (k_scale_cache is not None) or (k_scale_cache is None) != (v_scale_cache is None):
        raise ValueError("int8 K/V caches need k_scale_cache and v_scale_cache (and only they do)")
    if not kv_int8 and key_cache.dtype != q.dtype:
        raise ValueError(f"KV cache dtype {key_cache.dtype} differs from the query dtype {q.dtype}")
    if key_cache.shape[3] < head_dim:
        raise ValueError(f"KV cache head dim {key_cache.shape[3]} < query head dim {head_dim}")
    return num_q_heads, num_kv_heads, head_dim, kv_int8


def split_kv_verify_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    workspace: SplitKVWorkspace,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    config: SplitKVConfig = SplitKVConfig(),
) -> torch.Tensor:
    """Causal paged attention of short query blocks over long contexts, split over KV.

    Arguments are those `unified_attention` takes from `TritonAttentionImpl.forward`:
    q, out      (num_tokens, num_q_heads, head_dim); out is written in place
    key_cache, value_cache
                (num_blocks, block_size, num_kv_heads, >= head_dim) views of the layer's
                cache (bf16/fp16, or int8 with the per-token-head scale views)
    cu_seqlens_q (num_seqs + 1,) int32   attn_metadata.query_start_loc
    seqused_k   (num_seqs,) int32        attn_metadata.seq_lens (context + query tokens)
    block_table (>= num_seqs, max_blocks) int32   attn_metadata.block_table
    max_seqlen_q                         attn_metadata.max_query_len (fixed per graph)
    k_scale_cache, v_scale_cache  (num_blocks, block_size, num_kv_heads) float32
    """
    num_q_heads, num_kv_heads, head_dim, kv_int8 = _check_inputs(
        q, key_cache, value_cache, out, k_scale_cache, v_scale_cache
    )
    num_seqs = seqused_k.shape[0]
    if num_seqs > workspace.max_num_seqs or max_seqlen_q > workspace.max_query_tokens:
        raise ValueError(
            f"batch ({num_seqs} requests, {max_seqlen_q} query tokens) exceeds the workspace "
            f"({workspace.max_num_seqs}, {workspace.max_query_tokens}); check use_split_kv first"
        )
    if workspace.num_q_heads != num_q_heads or workspace.head_dim != head_dim:
        raise ValueError(
            f"workspace is for {workspace.num_q_heads} heads x {workspace.head_dim}, "
            f"the layer has {num_q_heads} x {head_dim}"
        )
    group = num_q_heads // num_kv_heads
    tiling = query_tiling(max_seqlen_q, group, config.block_m_cap)
    interpreted = _interpreted(_split_kv_partial_kernel)
    scale_args = _scale_strides(k_scale_cache, v_scale_cache, key_cache)
    part_out, part_max, part_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum

    _split_kv_partial_kernel[(num_seqs, num_kv_heads * tiling.num_tiles, workspace.max_splits)](
        q,
        key_cache,
        value_cache,
        *scale_args[:2],
        block_table,
        cu_seqlens_q,
        seqused_k,
        out,
        part_out,
        part_max,
        part_sum,
        softmax_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *scale_args[2:],
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_out.stride(3),
        part_max.stride(0),
        part_max.stride(1),
        part_max.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=config.tile_n,
        BLOCK_M=tiling.block_m,
        TOKENS_PER_PROGRAM=tiling.tokens_per_program,
        MAX_SPLITS=workspace.max_splits,
        MIN_SPLIT_TOKENS=config.min_split_tokens,
        KV_INT8=kv_int8,
        INTERPRETED=interpreted,
        WRITE_OUTPUT=False,
        num_warps=config.warps_for(head_dim),
        num_stages=config.num_stages,
    )
    _split_kv_merge_kernel[(num_seqs, max_seqlen_q, num_q_heads)](
        out,
        part_out,
        part_max,
        part_sum,
        cu_seqlens_q,
        seqused_k,
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_out.stride(3),
        part_max.stride(0),
        part_max.stride(1),
        part_max.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        TILE_N=config.tile_n,
        MAX_SPLITS=workspace.max_splits,
        MIN_SPLIT_TOKENS=config.min_split_tokens,
        INTERPRETED=interpreted,
        num_warps=4,
    )
    return out


def unsplit_verify_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    config: SplitKVConfig = SplitKVConfig(),
) -> torch.Tensor:
    """The same phase-1 program with one split per request, writing the output itself:
    one program per (request, KV head, query tile) walks the whole context. The
    baseline the split is measured against (same tiles, same GQA packing)."""
    num_q_heads, num_kv_heads, head_dim, kv_int8 = _check_inputs(
        q, key_cache, value_cache, out, k_scale_cache, v_scale_cache
    )
    num_seqs = seqused_k.shape[0]
    group = num_q_heads // num_kv_heads
    tiling = query_tiling(max_seqlen_q, group, config.block_m_cap)
    scale_args = _scale_strides(k_scale_cache, v_scale_cache, key_cache)
    _split_kv_partial_kernel[(num_seqs, num_kv_heads * tiling.num_tiles, 1)](
        q,
        key_cache,
        value_cache,
        *scale_args[:2],
        block_table,
        cu_seqlens_q,
        seqused_k,
        out,
        out,
        out,
        out,
        softmax_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *scale_args[2:],
        block_table.stride(0),
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=config.tile_n,
        BLOCK_M=tiling.block_m,
        TOKENS_PER_PROGRAM=tiling.tokens_per_program,
        MAX_SPLITS=1,
        MIN_SPLIT_TOKENS=config.min_split_tokens,
        KV_INT8=kv_int8,
        INTERPRETED=_interpreted(_split_kv_partial_kernel),
        WRITE_OUTPUT=True,
        num_warps=config.warps_for(head_dim),
        num_stages=config.num_stages,
    )
    return out


def _scale_strides(k_scale_cache, v_scale_cache, key_cache) -> tuple:
    """(k_scale_ptr, v_scale_ptr, six strides); the K cache stands in for absent scale
    caches (the KV_INT8=False branch never reads them)."""
    if k_scale_cache is None:
        return (key_cache, key_cache, 0, 0, 0, 0, 0, 0)
    return (k_scale_cache, v_scale_cache, *k_scale_cache.stride(), *v_scale_cache.stride())
