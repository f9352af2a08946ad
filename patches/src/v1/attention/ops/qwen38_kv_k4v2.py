# SPDX-License-Identifier: Apache-2.0
"""The `k4v2_g128` quantized KV cache (issue 56): 4-bit keys, 2-bit values, group 128.

Written from the format's definition for Qwen3.8-27B's full-attention layers (24 query
heads, 4 KV heads, head_dim 256). Delivered into vLLM by qwen38 patch 0047 (the dtype, its
page and the Triton backend's calls: the glue at the end of this file); proven on CPU under
the Triton interpreter, not yet on a GPU (docs/kv-k4v2.md says what is left). Everything here
needs only torch and triton.

Quantization (per token, per KV head, per group of 128 consecutive head dims)
-----------------------------------------------------------------------------
Asymmetric (min / scale), with ``L = 2**bits - 1`` (15 for K, 3 for V):

    m     = fp16(clamp(min(x_g), -65504, 65504))              the group's offset
    s     = fp16(clamp((max(x_g) - m) / L, 0, 65504))         the group's step
    code  = clamp(floor((x - m) / s' + 0.5), 0, L)            s' = s, or 1 where s == 0
    x_hat = code * s + m

All arithmetic is float32 with IEEE round-to-nearest division (``tl.div_rn`` in the
kernel), ``m`` and ``s`` are rounded to float16 *before* the codes are computed, so the
write kernel and `quantize_reference` produce the same bytes.

Asymmetric was kept over symmetric (``x_hat = (code - L/2) * s``, ``s = absmax / (L/2)``,
same bytes minus the offsets) because it was better on every measurement (4,096 tokens x
4 heads x 256, 24 query heads attending; relative RMSE of the dequantized K / V, and the
relative Frobenius error / minimum cosine of the attention output against float32
attention over the unquantized K/V):

    data                          K4 rel RMSE   V2 rel RMSE   out rel err   out min cos
    gaussian N(0,1)   symmetric      0.110         0.551         0.646        0.815
                      asymmetric     0.100         0.501         0.542        0.846
    outlier-heavy     symmetric      0.494         2.924         3.419       -0.150
    (student-t df 3,  asymmetric     0.229         1.149         1.470       -0.075
     6 channels x15 per head, per-channel bias)

(2 bits per value is coarse: on unstructured data the output error is large whatever the
variant; the offsets cost 8 bytes per token and head, 4 %.)

Page layout (one vLLM block = 128 tokens of one layer; a uint8 tensor
``(num_blocks, bytes_per_block)``, the block stride may be larger: hybrid padding)
-----------------------------------------------------------------------------------
The page is ``num_kv_heads`` head regions of ``HEAD_REGION_BYTES`` = 26,624 bytes, head
after head, so the attention program of one KV head reads one contiguous 26 KiB region
per block. Inside a head region, with ``t`` the slot (0..127) in the block:

    offset      size      content
    0           128 x 128 K codes: byte t*128 + b holds dim b in its low nibble and
                          dim b + 128 in its high nibble (low nibbles = group 0,
                          high nibbles = group 1)
    16,384      128 x 64  V codes: byte t*64 + b holds dims b, b+64, b+128, b+192 in
                          bits 0-1, 2-3, 4-5, 6-7 (planes 0,1 = group 0, planes 2,3 = group 1)
    24,576      128 x 8   K meta, float16: (s_g0, s_g1, m_g0, m_g1) per slot
    25,600      128 x 8   V meta, float16: (s_g0, s_g1, m_g0, m_g1) per slot

Every section starts 1,024-byte aligned; there is no padding: 208 bytes per token per
KV head = 128 (K) + 64 (V) + 8 (K meta) + 8 (V meta). `KVK4V2Layout` gives the exact
bytes per token and per block. Slots follow vLLM: ``slot = block * 128 + offset``; a
negative slot (a padding token) is skipped by the write kernel.

Kernels
-------
`kvk4v2_write`      grid (token tiles, KV heads): quantizes bf16 K/V rows into the pages.
`kvk4v2_attention`  split-KV decode / verify attention over the quantized pages, same
                    scheme as qwen38_split_kv_verify.py: phase 1 grid (request, KV head x
                    query tile, split) walks a slice of the paged context for all query
                    heads of its KV head and all query tokens of its tile (causal inside
                    the verify block: token i of q_len sits at position seq_len - q_len + i);
                    phase 2 merges the splits. Grids depend only on the number of requests,
                    max_seqlen_q and the workspace's max_splits (graph-safe); the split plan
                    is made on the device from seqused_k.
`prefill_attention` longer query blocks (chunked prefill, prefix-cache hits) through the same
                    kernel: each block cut on the device into virtual requests of at most 16
                    rows (`virtual_batch`: own rows, seqused_k up to the last row, the
                    request's block-table row), one launch for the whole step, one split each.
Dequantization happens on the scores and probabilities, not on tiles:
``q . k_hat_g = s_g (q_g . code_g) + m_g sum(q_g)`` and
``sum_n p_n v_hat_n = sum_n (p_n s_gn) code_n + sum_n p_n m_gn``; codes are exact in
bf16/fp16, q stays bf16, the P.V operand ``p * s`` is fp16 (3 more mantissa bits than bf16),
the offset sums stay fp32.

Torch references: `quantize_reference`, `write_reference` (the page bytes in torch),
`dequantize_pages`, `gather_dequantized`, `reference_attention` (float32, over any dense
K/V per request, e.g. the dequantized cache or the unquantized bf16 K/V),
`prefill_attention_reference` (the prefill path as a chunked torch loop over the pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634

KV_CACHE_DTYPE = "k4v2_g128"  # vLLM's --kv-cache-dtype name (the seed called it kvarn_k4v2_g128)
BLOCK_SIZE = 128  # tokens per page (vLLM --block-size 128)
GROUP_SIZE = 128  # head dims per scale
HEAD_DIM = 256  # the only head_dim the packing is written for (two groups)
K_BITS = 4
V_BITS = 2
K_LEVELS = (1 << K_BITS) - 1
V_LEVELS = (1 << V_BITS) - 1
FP16_MAX = 65504.0

K_CODE_BYTES = HEAD_DIM * K_BITS // 8  # 128 per token and head
V_CODE_BYTES = HEAD_DIM * V_BITS // 8  # 64
META_BYTES = 2 * (HEAD_DIM // GROUP_SIZE) * 2  # (scale, min) x groups x fp16 = 8
TOKEN_HEAD_BYTES = K_CODE_BYTES + V_CODE_BYTES + 2 * META_BYTES  # 208

K_CODES_OFFSET = 0
V_CODES_OFFSET = BLOCK_SIZE * K_CODE_BYTES  # 16,384
K_META_OFFSET = V_CODES_OFFSET + BLOCK_SIZE * V_CODE_BYTES  # 24,576
V_META_OFFSET = K_META_OFFSET + BLOCK_SIZE * META_BYTES  # 25,600
HEAD_REGION_BYTES = V_META_OFFSET + BLOCK_SIZE * META_BYTES  # 26,624

MAX_VERIFY_TOKENS = 16
DEFAULT_MAX_SPLITS = 32
# The prefill path runs a step's query rows as many virtual requests of MAX_VERIFY_TOKENS rows
# (2,048 tokens: 128 of them, x KV heads x query tiles programs): enough programs without
# splitting the context, and one split keeps its workspace at 0.4 MB per virtual request.
PREFILL_MAX_SPLITS = 1


@dataclass(frozen=True)
class KVK4V2Layout:
    """Bytes of the format for one attention layer with `num_kv_heads` KV heads."""

    num_kv_heads: int
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.head_dim != HEAD_DIM or self.block_size != BLOCK_SIZE:
            raise ValueError(
                f"k4v2_g128 is defined for head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; "
                f"found {self.head_dim}, {self.block_size}"
            )
        if self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, found {self.num_kv_heads}")

    @property
    def bytes_per_token_head(self) -> int:
        return TOKEN_HEAD_BYTES

    @property
    def bytes_per_token(self) -> int:
        """One layer: data + scales + offsets (+ no padding)."""
        return self.num_kv_heads * TOKEN_HEAD_BYTES

    @property
    def bytes_per_block(self) -> int:
        """One layer's page of `block_size` tokens (= block_size x bytes_per_token)."""
        return self.num_kv_heads * HEAD_REGION_BYTES

    def bytes_for(self, num_tokens: int, num_layers: int = 1) -> int:
        """Whole pages for `num_tokens` tokens over `num_layers` layers."""
        return num_layers * -(-num_tokens // self.block_size) * self.bytes_per_block


def bytes_per_token(num_layers: int, num_kv_heads: int) -> int:
    """Cache bytes per token of context over a model's full-attention layers
    (Qwen3.8-27B: 16 layers x 4 heads -> 13,312)."""
    return num_layers * KVK4V2Layout(num_kv_heads).bytes_per_token


def allocate_cache(num_blocks: int, num_kv_heads: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One layer's cache: uint8 (num_blocks, bytes_per_block), zeroed."""
    return torch.zeros(num_blocks, KVK4V2Layout(num_kv_heads).bytes_per_block, dtype=torch.uint8, device=device)


def _check_cache(cache: torch.Tensor, num_kv_heads: int) -> None:
    layout = KVK4V2Layout(num_kv_heads)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.stride(1) != 1:
        raise ValueError("the k4v2 cache must be a uint8 (num_blocks, bytes) tensor with unit stride on bytes")
    if cache.shape[1] < layout.bytes_per_block:
        raise ValueError(f"page of {cache.shape[1]} bytes < {layout.bytes_per_block} for {num_kv_heads} KV heads")
    if cache.stride(0) % 2 or cache.storage_offset() % 2:
        raise ValueError("the k4v2 cache's block stride and offset must be even (float16 metadata)")


def _flat_view(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's whole storage from its first byte, as `dtype` elements: the kernels
    address it as storage_offset + block * stride + ... (uint8 for codes, float16 for
    the metadata)."""
    flat = torch.tensor([], dtype=dtype, device=cache.device).set_(cache.untyped_storage())
    return torch.as_strided(flat, (flat.numel(),), (1,), 0)


# ---------------------------------------------------------------- torch reference


def quantize_reference(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., 256) -> codes uint8 (..., 256), scale fp16 (..., 2), min fp16 (..., 2),
    as the module docstring defines (bit-identical to the write kernel)."""
    levels = (1 << bits) - 1
    g = x.float().unflatten(-1, (-1, GROUP_SIZE))
    m = g.amin(-1).clamp(-FP16_MAX, FP16_MAX).half()
    s = ((g.amax(-1) - m.float()) / levels).clamp(0.0, FP16_MAX).half()
    s_safe = torch.where(s.float() > 0, s.float(), torch.ones_like(s, dtype=torch.float32))
    codes = torch.floor((g - m.float()[..., None]) / s_safe[..., None] + 0.5).clamp(0, levels)
    return codes.flatten(-2).to(torch.uint8), s, m


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """float32 x_hat = code * s + m, per group."""
    g = codes.float().unflatten(-1, (-1, GROUP_SIZE))
    return (g * scale.float()[..., None] + minimum.float()[..., None]).flatten(-2)


def pack_k_codes(codes: torch.Tensor) -> torch.Tensor:
    """(..., 256) 4-bit codes -> (..., 128) bytes: dim b low nibble, dim b + 128 high."""
    c = codes.to(torch.int32)
    return (c[..., :128] | (c[..., 128:] << 4)).to(torch.uint8)


def pack_v_codes(codes: torch.Tensor) -> torch.Tensor:
    """(..., 256) 2-bit codes -> (..., 64) bytes: dims b, b+64, b+128, b+192 in bits 0,2,4,6."""
    c = codes.to(torch.int32)
    return (c[..., 0:64] | (c[..., 64:128] << 2) | (c[..., 128:192] << 4) | (c[..., 192:256] << 6)).to(torch.uint8)


def unpack_k_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def unpack_v_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)


def _head_regions(cache: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(num_blocks, num_kv_heads, HEAD_REGION_BYTES) view of the pages."""
    return cache[:, : num_kv_heads * HEAD_REGION_BYTES].unflatten(1, (num_kv_heads, HEAD_REGION_BYTES))


def _sections(regions: torch.Tensor):
    k = regions[..., K_CODES_OFFSET:V_CODES_OFFSET].unflatten(-1, (BLOCK_SIZE, K_CODE_BYTES))
    v = regions[..., V_CODES_OFFSET:K_META_OFFSET].unflatten(-1, (BLOCK_SIZE, V_CODE_BYTES))
    km = regions[..., K_META_OFFSET:V_META_OFFSET].unflatten(-1, (BLOCK_SIZE, META_BYTES))
    vm = regions[..., V_META_OFFSET:HEAD_REGION_BYTES].unflatten(-1, (BLOCK_SIZE, META_BYTES))
    return k, v, km, vm  # (blocks, heads, slots, bytes)


def write_reference(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The write kernel in torch: key/value (tokens, heads, 256), slot_mapping (tokens,)."""
    num_kv_heads = key.shape[1]
    _check_cache(cache, num_kv_heads)
    keep = slot_mapping >= 0
    key, value, slots = key[keep], value[keep], slot_mapping[keep].long()
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    k_sec, v_sec, km_sec, vm_sec = _sections(_head_regions(cache, num_kv_heads))
    for x, bits, data_sec, meta_sec, pack in (
        (key, K_BITS, k_sec, km_sec, pack_k_codes),
        (value, V_BITS, v_sec, vm_sec, pack_v_codes),
    ):
        codes, s, m = quantize_reference(x, bits)
        meta = torch.cat([s, m], dim=-1).contiguous().view(torch.uint8)  # (tokens, heads, 8)
        data = pack(codes)
        for h in range(num_kv_heads):
            data_sec[blocks, h, offsets] = data[:, h]
            meta_sec[blocks, h, offsets] = meta[:, h]


def dequantize_pages(cache: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of every page dequantized: K, V float32 (num_blocks, 128, heads, 256)."""
    k_sec, v_sec, km_sec, vm_sec = _sections(_head_regions(cache, num_kv_heads))
    out = []
    for data_sec, meta_sec, unpack in ((k_sec, km_sec, unpack_k_codes), (v_sec, vm_sec, unpack_v_codes)):
        meta = meta_sec.contiguous().view(torch.float16)  # (blocks, heads, slots, 4)
        x = dequantize_codes(unpack(data_sec), meta[..., :2], meta[..., 2:])
        out.append(x.transpose(1, 2))
    return out[0], out[1]


def gather_dequantized(
    cache: torch.Tensor, num_kv_heads: int, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K, V in position order, dequantized: float32 (seq_len, heads, 256)."""
    keys, values = dequantize_pages(cache, num_kv_heads)
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row[pos // BLOCK_SIZE].long()
    return keys[blocks, pos % BLOCK_SIZE], values[blocks, pos % BLOCK_SIZE]


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        softmax_scale: float) -> torch.Tensor:
    """Causal attention of one request's query block in float32: q (q_len, q_heads, d),
    keys/values (seq_len, kv_heads, d) with the q_len query tokens last. Query head h
    reads KV head h // (q_heads / kv_heads). Returns (q_len, q_heads, d) float32."""
    q_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    qg = q.float().unflatten(1, (num_kv_heads, num_q_heads // num_kv_heads))
    scores = torch.einsum("qkgd,nkd->kgqn", qg, keys.float()) * softmax_scale
    q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    out = torch.einsum("kgqn,nkd->qkgd", torch.softmax(scores, dim=-1), values.float())
    return out.flatten(1, 2)


# ---------------------------------------------------------------- Triton: shared helpers


@triton.jit
def _group_params(mn, mx, LEVELS: tl.constexpr):
    # (m, s, s_safe) in fp32 holding fp16 values, per row.
    m = tl.minimum(tl.maximum(mn, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    s = tl.div_rn(mx - m, tl.full(mx.shape, LEVELS, tl.float32))
    s = tl.minimum(tl.maximum(s, 0.0), 65504.0).to(tl.float16).to(tl.float32)
    s_safe = tl.where(s > 0.0, s, 1.0)
    return m, s, s_safe


@triton.jit
def _codes(x, m, s_safe, LEVELS: tl.constexpr):
    c = tl.floor(tl.div_rn(x - m[:, None], s_safe[:, None] + tl.zeros_like(x)) + 0.5)
    return tl.minimum(tl.maximum(c, 0.0), LEVELS).to(tl.int32)


# ---------------------------------------------------------------- Triton: cache write


@triton.jit
def _kvk4v2_write_kernel(
    key_ptr,
    value_ptr,
    slot_ptr,
    cache_u8_ptr,
    cache_f16_ptr,
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_blk,
    cache_offset,
    ROWS: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    rows = tile * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + rows, mask=rows < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    blk = tl.where(ok, slot // 128, 0)
    off = tl.where(ok, slot % 128, 0)
    region = cache_offset + blk * stride_blk + head * 26624  # HEAD_REGION_BYTES
    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)

    # Keys: two groups = the two nibble planes.
    k_rows = rows.to(tl.int64) * stride_k_tok + head * stride_k_head
    k0 = tl.load(key_ptr + k_rows[:, None] + d128[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    k1 = tl.load(key_ptr + k_rows[:, None] + 128 + d128[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    km0, ks0, ks0_safe = _group_params(tl.min(k0, axis=1), tl.max(k0, axis=1), 15)
    km1, ks1, ks1_safe = _group_params(tl.min(k1, axis=1), tl.max(k1, axis=1), 15)
    kbyte = _codes(k0, km0, ks0_safe, 15) | (_codes(k1, km1, ks1_safe, 15) << 4)
    tl.store(cache_u8_ptr + region[:, None] + off[:, None] * 128 + d128[None, :], kbyte.to(tl.uint8), mask=ok[:, None])
    k_meta = (region + 24576 + off * 8) // 2  # K_META_OFFSET, in float16 elements
    tl.store(cache_f16_ptr + k_meta, ks0.to(tl.float16), mask=ok)
    tl.store(cache_f16_ptr + k_meta + 1, ks1.to(tl.float16), mask=ok)
    tl.store(cache_f16_ptr + k_meta + 2, km0.to(tl.float16), mask=ok)
    tl.store(cache_f16_ptr + k_meta + 3, km1.to(tl.float16), mask=ok)

    # Values: four 64-dim planes; planes 0,1 = group 0, planes 2,3 = group 1.
    v_rows = rows.to(tl.int64) * stride_v_tok + head * stride_v_head
    v0 = tl.load(value_ptr + v_rows[:, None] + d64[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    v1 = tl.load(value_ptr + v_rows[:, None] + 64 + d64[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    v2 = tl.load(value_ptr + v_rows[:, None] + 128 + d64[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    v3 = tl.load(value_ptr + v_rows[:, None] + 192 + d64[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    vm0, vs0, vs0_safe = _group_params(
        tl.minimum(tl.min(v0, axis=1), tl.min(v1, axis=1)), tl.maximum(tl.max(v0, axis=1), tl.max(v1, axis=1)), 3
    )
    vm1, vs1, vs1_safe = _group_params(
        tl.minimum(tl.min(v2, axis=1), tl.min(v3, axis=1)), tl.maximum(tl.max(v2, axis=1), tl.max(v3, axis=1)), 3
    )
    vbyte = (
        _codes(v0, vm0, vs0_safe, 3)
        | (_codes(v1, vm0, vs0_safe, 3) << 2)
        | (_codes(v2, vm1, vs1_safe, 3) << 4)
        | (_codes(v3, vm1, vs1_safe, 3) << 6)
    )
    tl.store(
        cache_u8_ptr + region[:, None] + 16384 + off[:, None] * 64 + d64[None, :], vbyte.to(tl.uint8), mask=ok[:, None]
    )
    v_meta = (region + 25600 + off * 8) // 2  # V_META_OFFSET
    tl.store(cache_f16_ptr + v_meta, vs0.to(tl.float16), mask=ok)
    tl.store(cache_f16_ptr + v_meta + 1, vs1.to(tl.float16), mask=ok)
    tl.store(cache_f16_ptr + v_meta + 2, vm0.to(tl.float16), mask=ok)
    tl.store(cache_f16_ptr + v_meta + 3, vm1.to(tl.float16), mask=ok)


def kvk4v2_write(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, rows: int = 16
) -> None:
    """Quantize key/value (num_tokens, num_kv_heads, 256) bf16/fp16/fp32 into `cache` at
    `slot_mapping` (num_tokens,) int32/int64; slots < 0 are skipped."""
    if key.shape != value.shape or key.dim() != 3 or key.shape[2] != HEAD_DIM:
        raise ValueError(
            f"key/value must be (tokens, heads, {HEAD_DIM}), found {tuple(key.shape)} / {tuple(value.shape)}"
        )
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value need a unit stride on the head dim")
    num_tokens, num_kv_heads, _ = key.shape
    _check_cache(cache, num_kv_heads)
    if num_tokens == 0:
        return
    _kvk4v2_write_kernel[(triton.cdiv(num_tokens, rows), num_kv_heads)](
        key,
        value,
        slot_mapping,
        _flat_view(cache, torch.uint8),
        _flat_view(cache, torch.float16),
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cache.stride(0),
        cache.storage_offset(),
        ROWS=rows,
    )


# ---------------------------------------------------------------- Triton: attention


@dataclass(frozen=True)
class KVK4V2Config:
    """Launch shape: `tile_n` keys per inner step (a power of two dividing 128, so a tile
    never crosses a page); `min_split_tokens` (a multiple of tile_n) keeps short contexts
    in few splits; `block_m_cap` bounds the query rows (tokens x heads of one KV head)."""

    tile_n: int = 64
    min_split_tokens: int = 512
    block_m_cap: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.tile_n < 16 or self.tile_n > BLOCK_SIZE or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"tile_n must be a power of two in 16..{BLOCK_SIZE}, found {self.tile_n}")
        if self.min_split_tokens < self.tile_n or self.min_split_tokens % self.tile_n:
            raise ValueError(f"min_split_tokens must be a multiple of tile_n, found {self.min_split_tokens}")


def split_plan(seq_len: int, max_splits: int, min_split_tokens: int, tile_n: int) -> tuple[int, int]:
    """Host twin of the kernels' split plan: (number of splits, tokens per split)."""
    if seq_len <= 0:
        return 0, 0
    per = max(min_split_tokens, -(-seq_len // max_splits))
    per = -(-per // tile_n) * tile_n
    return -(-seq_len // per), per


class KVK4V2Workspace:
    """Partial results of the splits (float32), allocated once:
    out (seqs, query tokens, q_heads, max_splits, 256); max, sum (..., max_splits).

    The decode workspace (the metadata builder's) also holds the prefill path's own, made on
    the first prefill step (`for_prefill`)."""

    def __init__(self, max_num_seqs: int, max_query_tokens: int, num_q_heads: int,
                 max_splits: int = DEFAULT_MAX_SPLITS, device: str | torch.device = "cuda") -> None:
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two, found {max_splits}")
        self.max_num_seqs, self.max_query_tokens, self.num_q_heads = max_num_seqs, max_query_tokens, num_q_heads
        self.max_splits = max_splits
        shape = (max_num_seqs, max_query_tokens, num_q_heads, max_splits)
        self.partial_out = torch.empty((*shape, HEAD_DIM), dtype=torch.float32, device=device)
        self.partial_max = torch.empty(shape, dtype=torch.float32, device=device)
        self.partial_sum = torch.empty(shape, dtype=torch.float32, device=device)
        self.prefill: KVK4V2Workspace | None = None

    @staticmethod
    def bytes_for(max_num_seqs: int, max_query_tokens: int, num_q_heads: int, max_splits: int) -> int:
        """Bytes of a workspace of that shape (out, max and sum, float32)."""
        return max_num_seqs * max_query_tokens * num_q_heads * max_splits * (HEAD_DIM + 2) * 4

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.max_num_seqs, self.max_query_tokens, self.num_q_heads, self.max_splits)

    def for_prefill(self, num_virtual: int) -> KVK4V2Workspace:
        """The prefill path's workspace for `num_virtual` virtual requests: `MAX_VERIFY_TOKENS`
        rows and `PREFILL_MAX_SPLITS` splits each, on this workspace's device. Made on the first
        prefill step and grown (never shrunk) when a step needs more; a step of at most
        max_num_batched_tokens tokens needs at most `prefill_capacity` of them (Qwen3.8, 2,048
        tokens, 2 slots: 130 virtual requests, 51.5 MB). Eager only: the prefill path is outside
        CUDA graphs."""
        if self.prefill is None or self.prefill.max_num_seqs < num_virtual:
            self.prefill = KVK4V2Workspace(num_virtual, MAX_VERIFY_TOKENS, self.num_q_heads,
                                           PREFILL_MAX_SPLITS, device=self.partial_out.device)
        return self.prefill


@triton.jit
def _kvk4v2_partial_kernel(
    q_ptr,
    cache_u8_ptr,
    cache_f16_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seqused_k_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_blk,
    cache_offset,
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
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    K_OP: tl.constexpr,
    V_OP: tl.constexpr,
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
    # The split plan (host twin: split_plan), inline: helper calls are slow when interpreted.
    per_split = tl.maximum(MIN_SPLIT_TOKENS, (seq_len + MAX_SPLITS - 1) // MAX_SPLITS)
    per_split = (per_split + TILE_N - 1) // TILE_N * TILE_N
    num_splits = (seq_len + per_split - 1) // per_split
    if split >= num_splits:
        return
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS_PER_PROGRAM * GROUP) & (tok < q_len)
    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)
    q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + q_head * stride_q_head
    # K_OP / V_OP: bf16 / fp16 on the GPU; fp32 (holding those values) under the
    # interpreter, whose bf16 dot is not a float dot. q is bf16 already, codes are exact.
    q0 = tl.load(q_ptr + q_rows[:, None] + d128[None, :], mask=row_ok[:, None], other=0.0).to(K_OP)
    q1 = tl.load(q_ptr + q_rows[:, None] + 128 + d128[None, :], mask=row_ok[:, None], other=0.0).to(K_OP)
    # sum(q_g) for the offsets' share of the scores (q as the dot sees it).
    qsum0 = tl.sum(q0.to(tl.float32), axis=1)
    qsum1 = tl.sum(q1.to(tl.float32), axis=1)
    q_pos = context_len + tok

    kv_lo = split * per_split
    last_tok = tl.minimum(tok0 + TOKENS_PER_PROGRAM, q_len)
    kv_hi = tl.minimum(tl.minimum(kv_lo + per_split, seq_len), context_len + last_tok)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    off0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    off1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    for start in range(kv_lo, kv_hi, TILE_N):
        # A tile lies inside one page (tile_n divides 128, tiles start at multiples of it).
        blk = tl.load(bt_row + start // 128).to(tl.int64)
        region = cache_offset + blk * stride_blk + kv_head * 26624
        pos = start + cols
        pos_ok = pos < kv_hi
        slot = start % 128 + cols

        kb = tl.load(cache_u8_ptr + region + slot[None, :] * 128 + d128[:, None], mask=pos_ok[None, :], other=0)
        k_lo = (kb & 15).to(K_OP)
        k_hi = (kb >> 4).to(K_OP)
        k_meta = (region + 24576 + slot * 8) // 2
        ks0 = tl.load(cache_f16_ptr + k_meta, mask=pos_ok, other=0.0).to(tl.float32)
        ks1 = tl.load(cache_f16_ptr + k_meta + 1, mask=pos_ok, other=0.0).to(tl.float32)
        km0 = tl.load(cache_f16_ptr + k_meta + 2, mask=pos_ok, other=0.0).to(tl.float32)
        km1 = tl.load(cache_f16_ptr + k_meta + 3, mask=pos_ok, other=0.0).to(tl.float32)
        s = (
            tl.dot(q0, k_lo) * ks0[None, :]
            + tl.dot(q1, k_hi) * ks1[None, :]
            + qsum0[:, None] * km0[None, :]
            + qsum1[:, None] * km1[None, :]
        ) * scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        vb = tl.load(cache_u8_ptr + region + 16384 + slot[:, None] * 64 + d64[None, :], mask=pos_ok[:, None], other=0)
        v_meta = (region + 25600 + slot * 8) // 2
        vs0 = tl.load(cache_f16_ptr + v_meta, mask=pos_ok, other=0.0).to(tl.float32)
        vs1 = tl.load(cache_f16_ptr + v_meta + 1, mask=pos_ok, other=0.0).to(tl.float32)
        vm0 = tl.load(cache_f16_ptr + v_meta + 2, mask=pos_ok, other=0.0).to(tl.float32)
        vm1 = tl.load(cache_f16_ptr + v_meta + 3, mask=pos_ok, other=0.0).to(tl.float32)
        pv0 = (p * vs0[None, :]).to(tl.float16).to(V_OP)
        pv1 = (p * vs1[None, :]).to(tl.float16).to(V_OP)
        # Centred codes (code - 1.5: -1.5, -0.5, 0.5, 1.5, exact in fp16), their 1.5 steps moved
        # into the offsets: the dots then sum values of both signs, so the accumulators stay near
        # the output's size. With codes 0..3 they grew with every key to ~1.5 x the value step
        # times the softmax sum, and the output was the difference of that and the offsets' sum:
        # the tensor cores' accumulation (operands aligned and truncated, not rounded) lost bits
        # a key at a time, and that difference magnified the loss with the keys one program
        # reads (on the H100: rel 1.1e-2 at 25,000 keys, 0.26 at 128,000; the interpreter's
        # float dot was exact).
        acc0 = acc0 * alpha[:, None] + tl.dot(pv0, ((vb & 3).to(tl.float32) - 1.5).to(V_OP))
        acc1 = acc1 * alpha[:, None] + tl.dot(pv0, (((vb >> 2) & 3).to(tl.float32) - 1.5).to(V_OP))
        acc2 = acc2 * alpha[:, None] + tl.dot(pv1, (((vb >> 4) & 3).to(tl.float32) - 1.5).to(V_OP))
        acc3 = acc3 * alpha[:, None] + tl.dot(pv1, ((vb >> 6).to(tl.float32) - 1.5).to(V_OP))
        off0 = off0 * alpha + tl.sum(p * (vm0 + 1.5 * vs0)[None, :], axis=1)
        off1 = off1 * alpha + tl.sum(p * (vm1 + 1.5 * vs1)[None, :], axis=1)
        m_i = m_new

    inv = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    p_rows = seq.to(tl.int64) * stride_p_seq + tok * stride_p_tok + q_head * stride_p_head + split * stride_p_split
    base = part_out_ptr + p_rows[:, None] + d64[None, :]
    ok = row_ok[:, None]
    tl.store(base, (acc0 + off0[:, None]) * inv[:, None], mask=ok)
    tl.store(base + 64, (acc1 + off0[:, None]) * inv[:, None], mask=ok)
    tl.store(base + 128, (acc2 + off1[:, None]) * inv[:, None], mask=ok)
    tl.store(base + 192, (acc3 + off1[:, None]) * inv[:, None], mask=ok)
    m_rows = seq.to(tl.int64) * stride_m_seq + tok * stride_m_tok + q_head * stride_m_head + split
    tl.store(part_max_ptr + m_rows, m_i, mask=row_ok)
    tl.store(part_sum_ptr + m_rows, l_i, mask=row_ok)


@triton.jit
def _kvk4v2_merge_kernel(
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
    per_split = tl.maximum(MIN_SPLIT_TOKENS, (seq_len + MAX_SPLITS - 1) // MAX_SPLITS)
    per_split = (per_split + TILE_N - 1) // TILE_N * TILE_N
    num_splits = (seq_len + per_split - 1) // per_split
    splits = tl.arange(0, MAX_SPLITS)
    split_ok = splits < num_splits
    m_base = seq.to(tl.int64) * stride_m_seq + tok * stride_m_tok + head * stride_m_head
    m = tl.load(part_max_ptr + m_base + splits, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + m_base + splits, mask=split_ok, other=0.0)
    m_top = tl.max(m, axis=0)
    m_top = tl.where(m_top == float("-inf"), 0.0, m_top)
    w = tl.where(split_ok & (l > 0.0), tl.exp2(m - m_top) * l, 0.0)
    total = tl.sum(w, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    dims = tl.arange(0, 256)
    p_base = seq.to(tl.int64) * stride_p_seq + tok * stride_p_tok + head * stride_p_head
    parts = tl.load(part_out_ptr + p_base + splits[:, None] * stride_p_split + dims[None, :],
                    mask=split_ok[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / total
    o_off = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    if INTERPRETED:
        # Round to nearest bf16 (ties to even) by hand: the interpreter's cast truncates.
        u = o.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        o = ((u >> 16) << 16).to(tl.float32, bitcast=True)
    tl.store(out_ptr + o_off + dims, o.to(out_ptr.dtype.element_ty))


def _interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def kvk4v2_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    *,
    num_kv_heads: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    workspace: KVK4V2Workspace,
    config: KVK4V2Config = KVK4V2Config(),
) -> torch.Tensor:
    """Causal split-KV attention of short query blocks (decode: 1 token, verify: up to 16)
    over the k4v2 pages.

    q, out        (num_tokens, num_q_heads, 256) bf16; out written in place
    cache         uint8 (num_blocks, >= bytes_per_block) pages of this layer
    cu_seqlens_q  (num_seqs + 1,) int32; seqused_k (num_seqs,) int32 = context + query
    block_table   (>= num_seqs, max_blocks) int32
    """
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or out.shape != q.shape or q.dtype != torch.bfloat16:
        raise ValueError(f"q/out must be bf16 (tokens, heads, {HEAD_DIM}), found {tuple(q.shape)} {q.dtype}")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a unit stride on the head dim")
    num_q_heads = q.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    _check_cache(cache, num_kv_heads)
    num_seqs = seqused_k.shape[0]
    if num_seqs > workspace.max_num_seqs or max_seqlen_q > workspace.max_query_tokens:
        raise ValueError("batch exceeds the workspace")
    if workspace.num_q_heads != num_q_heads:
        raise ValueError(f"workspace is for {workspace.num_q_heads} query heads, the layer has {num_q_heads}")
    group = num_q_heads // num_kv_heads
    tokens = max(1, min(max_seqlen_q, config.block_m_cap // group))
    block_m = max(16, triton.next_power_of_2(tokens * group))
    num_tiles = triton.cdiv(max_seqlen_q, tokens)
    interpreted = _interpreted(_kvk4v2_partial_kernel)
    po, pm, ps = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    _kvk4v2_partial_kernel[(num_seqs, num_kv_heads * num_tiles, workspace.max_splits)](
        q, _flat_view(cache, torch.uint8), _flat_view(cache, torch.float16), block_table, cu_seqlens_q, seqused_k,
        po, pm, ps,
        softmax_scale * _LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.storage_offset(), block_table.stride(0),
        po.stride(0), po.stride(1), po.stride(2), po.stride(3), pm.stride(0), pm.stride(1), pm.stride(2),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, TILE_N=config.tile_n, BLOCK_M=block_m,
        TOKENS_PER_PROGRAM=tokens, MAX_SPLITS=workspace.max_splits, MIN_SPLIT_TOKENS=config.min_split_tokens,
        K_OP=tl.float32 if interpreted else tl.bfloat16, V_OP=tl.float32 if interpreted else tl.float16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    _kvk4v2_merge_kernel[(num_seqs, max_seqlen_q, num_q_heads)](
        out, po, pm, ps, cu_seqlens_q, seqused_k, out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2), po.stride(3), pm.stride(0), pm.stride(1), pm.stride(2),
        TILE_N=config.tile_n, MAX_SPLITS=workspace.max_splits, MIN_SPLIT_TOKENS=config.min_split_tokens,
        INTERPRETED=interpreted, num_warps=4,
    )
    return out


# ---------------------------------------------------------------- vLLM glue (qwen38 patch 0047)


def holds_layer(head_size: int, sliding_window: int | None) -> bool:
    """Whether the format can hold an attention layer: full attention of head_dim 256. vLLM keeps
    every other layer of a model that asks for k4v2_g128 (a DFlash2 drafter's head-128
    sliding-window layers) at the model dtype."""
    return head_size == HEAD_DIM and sliding_window is None


def layer_pages(kv_cache: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """One layer's vLLM KV cache (uint8, blocks outermost, any order inside a block) as the
    kernels' pages: uint8 (num_blocks * pages_per_block, bytes_per_block). A vLLM block of
    ``n * 128`` tokens is ``n`` whole pages, so page ``slot // 128`` holds ``slot % 128`` whatever
    vLLM's block size."""
    layout = KVK4V2Layout(num_kv_heads)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() < 2:
        raise ValueError(f"a k4v2 layer cache is uint8 with blocks outermost, found {kv_cache.dtype}")
    num_blocks = kv_cache.shape[0]
    block_bytes = kv_cache[0].numel()
    if block_bytes % layout.bytes_per_block:
        raise ValueError(f"a {block_bytes}-byte block is not whole {layout.bytes_per_block}-byte pages")
    if num_blocks > 1 and kv_cache.stride(0) != block_bytes:
        raise ValueError(f"k4v2 blocks must be contiguous (stride {kv_cache.stride(0)}, {block_bytes} bytes each)")
    pages = num_blocks * (block_bytes // layout.bytes_per_block)
    return torch.as_strided(kv_cache, (pages, layout.bytes_per_block), (layout.bytes_per_block, 1))


def page_table(block_table: torch.Tensor, pages_per_block: int) -> torch.Tensor:
    """vLLM's block table (requests, blocks) -> the kernels' table of 128-token pages."""
    if pages_per_block == 1:
        return block_table
    steps = torch.arange(pages_per_block, device=block_table.device, dtype=block_table.dtype)
    return (block_table.unsqueeze(-1) * pages_per_block + steps).flatten(1)


def _pages_dequantized(pages: torch.Tensor, num_kv_heads: int, table_row: torch.Tensor, start: int, stop: int):
    """Positions ``start..stop`` of one request, K and V float32 (tokens, heads, 256)."""
    first, last = start // BLOCK_SIZE, (stop - 1) // BLOCK_SIZE
    keys, values = dequantize_pages(pages[table_row[first : last + 1].long()], num_kv_heads)
    lo = start - first * BLOCK_SIZE
    return keys.flatten(0, 1)[lo : lo + stop - start], values.flatten(0, 1)[lo : lo + stop - start]


def prefill_capacity(num_tokens: int, num_seqs: int) -> int:
    """Virtual requests `virtual_batch` makes for a step of `num_tokens` query tokens over
    `num_seqs` requests: a bound on sum(ceil(q_len / MAX_VERIFY_TOKENS)), known on the host."""
    return -(-num_tokens // MAX_VERIFY_TOKENS) + num_seqs


def virtual_batch(
    cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of query blocks of any length cut into virtual requests of at most
    `MAX_VERIFY_TOKENS` consecutive query rows, on the device, without a host sync.

    Virtual request j of a request with ``q_len`` rows and ``seq_len`` keys (its block starts
    at position ``seq_len - q_len``) holds rows ``16j .. min(16j + 16, q_len)``, sees keys up
    to its last row (``seqused_k = seq_len - q_len + min(16j + 16, q_len)``, so the kernel's
    causal rule, row i of n at ``seqused_k - n + i``, gives each row its own position) and
    reads its request's row of the block table. The count is `prefill_capacity` (host side);
    the unused tail has no rows and no keys (the kernels return at once).
    Returns cu_seqlens_q (capacity + 1,) int32, seqused_k (capacity,) int32 and the block
    table (capacity, max_blocks)."""
    num_seqs = seqused_k.shape[0]
    capacity = prefill_capacity(num_tokens, num_seqs)
    cu = cu_seqlens_q[: num_seqs + 1].long()
    q_lens = cu[1:] - cu[:-1]
    pieces = (q_lens + MAX_VERIFY_TOKENS - 1) // MAX_VERIFY_TOKENS
    ends = torch.cumsum(pieces, 0)
    virtual = torch.arange(capacity, device=cu.device)
    owner = torch.searchsorted(ends, virtual, right=True)  # requests without rows own none
    used = owner < num_seqs
    owner = owner.clamp(max=max(num_seqs - 1, 0))
    first_row = (virtual - ends[owner] + pieces[owner]) * MAX_VERIFY_TOKENS
    stop_row = torch.minimum(first_row + MAX_VERIFY_TOKENS, q_lens[owner])
    starts = torch.where(used, cu[owner] + first_row, cu[-1])
    seqused = torch.where(used, seqused_k[owner].long() - q_lens[owner] + stop_row, 0)
    return (torch.cat([starts, cu[-1:]]).to(torch.int32), seqused.to(torch.int32),
            block_table.index_select(0, owner))


def prefill_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    out: torch.Tensor,
    *,
    num_kv_heads: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    workspace: KVK4V2Workspace,
    config: KVK4V2Config = KVK4V2Config(),
) -> torch.Tensor:
    """Causal attention of query blocks of any length (chunked prefill, prefix-cache hits, and
    the decode / verify requests batched with them) over the k4v2 pages: `virtual_batch` cuts
    every block into virtual requests of at most `MAX_VERIFY_TOKENS` rows and one
    `kvk4v2_attention` launch (partial + merge) runs them all, in the workspace's prefill part
    (`KVK4V2Workspace.for_prefill`, `PREFILL_MAX_SPLITS` splits: the rows give the programs).
    About 30 small torch ops build the virtual batch on the device; its size
    (`prefill_capacity`) is known on the host, so there is no host sync and no loop over rows or
    context. Eager: the prefill path is outside CUDA graphs, and the workspace may grow on a step
    with more tokens than any before. Arguments as `kvk4v2_attention` (``block_table`` in
    128-token pages); `prefill_attention_reference` is the same in torch."""
    num_tokens = q.shape[0]
    if seqused_k.shape[0] == 0 or num_tokens == 0:
        return out
    cu_v, seqused_v, table_v = virtual_batch(cu_seqlens_q, seqused_k, block_table, num_tokens)
    prefill = workspace.for_prefill(seqused_v.shape[0])
    return kvk4v2_attention(q, pages, out, num_kv_heads=num_kv_heads, cu_seqlens_q=cu_v, seqused_k=seqused_v,
                            block_table=table_v, max_seqlen_q=min(MAX_VERIFY_TOKENS, num_tokens),
                            softmax_scale=softmax_scale, workspace=prefill, config=config)


def prefill_attention_reference(
    q: torch.Tensor,
    pages: torch.Tensor,
    out: torch.Tensor,
    *,
    num_kv_heads: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    query_rows: int = 256,
    context_tokens: int = 2048,
) -> torch.Tensor:
    """`prefill_attention` in torch, for tests: per request, per ``query_rows`` queries, the
    context dequantized ``context_tokens`` at a time with an online softmax (bounded memory at
    245k of context: about 50 MB of float32 scores for 24 heads at the defaults). Correct and
    launch-bound (thousands of small ops per layer at long contexts, a host sync); it served
    prefill before the split-KV kernel did (docs/kv-k4v2.md)."""
    starts, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    group = q.shape[1] // num_kv_heads
    for seq, seq_len in enumerate(lens):
        q0, q1 = starts[seq], starts[seq + 1]
        if q1 <= q0 or seq_len <= 0:
            continue
        first_pos = seq_len - (q1 - q0)
        for r0 in range(q0, q1, query_rows):
            r1 = min(q1, r0 + query_rows)
            qg = q[r0:r1].float().unflatten(1, (num_kv_heads, group))  # (rows, kv, g, d)
            q_pos = first_pos + (r0 - q0) + torch.arange(r1 - r0, device=q.device)
            top = torch.full((num_kv_heads, group, r1 - r0), float("-inf"), device=q.device)
            total = torch.zeros_like(top)
            acc = torch.zeros((num_kv_heads, group, r1 - r0, HEAD_DIM), device=q.device)
            end = first_pos + (r1 - q0)  # keys past the last query row are never read
            for c0 in range(0, end, context_tokens):
                c1 = min(end, c0 + context_tokens)
                keys, values = _pages_dequantized(pages, num_kv_heads, block_table[seq], c0, c1)
                scores = torch.einsum("qkgd,nkd->kgqn", qg, keys) * softmax_scale
                k_pos = c0 + torch.arange(c1 - c0, device=q.device)
                scores = scores.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
                new_top = torch.maximum(top, scores.amax(-1))
                safe = torch.where(new_top == float("-inf"), 0.0, new_top)
                weights = torch.exp(scores - safe[..., None])
                rescale = torch.exp(torch.where(top == float("-inf"), safe, top) - safe)
                total = total * rescale + weights.sum(-1)
                acc = acc * rescale[..., None] + torch.einsum("kgqn,nkd->kgqd", weights, values)
                top = new_top
            result = (acc / total.clamp_min(1e-30)[..., None]).permute(2, 0, 1, 3).flatten(1, 2)
            out[r0:r1] = result.to(out.dtype)
    return out


def forward(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    num_kv_heads: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    workspace: KVK4V2Workspace | None,
) -> torch.Tensor:
    """The attention of one layer over its k4v2 cache, as vLLM's Triton backend calls it:
    a batch whose requests have at most `MAX_VERIFY_TOKENS` query tokens each (decode, verify)
    through the split-KV kernel directly; a batch with a longer block (``max_seqlen_q`` is the
    batch's maximum, so a chunked-prefill batch with decodes in it too) through
    `prefill_attention`, the same kernel over virtual requests. Without a workspace (no
    metadata builder made one) everything takes `prefill_attention_reference`. ``kv_cache`` and
    ``block_table`` are vLLM's (its block a whole number of pages)."""
    pages = layer_pages(kv_cache, num_kv_heads)
    table = page_table(block_table, pages.shape[0] // kv_cache.shape[0])
    args = dict(num_kv_heads=num_kv_heads, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=table,
                softmax_scale=softmax_scale)
    if workspace is None:
        return prefill_attention_reference(q, pages, out, **args)
    if max_seqlen_q <= MAX_VERIFY_TOKENS:
        return kvk4v2_attention(q, pages, out, max_seqlen_q=max_seqlen_q, workspace=workspace, **args)
    return prefill_attention(q, pages, out, workspace=workspace, **args)


def write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`kvk4v2_write` into vLLM's layer cache (slots as vLLM numbers them)."""
    kvk4v2_write(key, value, layer_pages(kv_cache, key.shape[1]), slot_mapping)
