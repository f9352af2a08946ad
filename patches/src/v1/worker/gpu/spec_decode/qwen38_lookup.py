# SPDX-License-Identifier: Apache-2.0
# qwen38 patch 0072: lookup drafting for DFlash2 on the V2 model runner.
"""Lookup drafting on the GPU: one Triton program per request.

The same rule as the V1 runner's NumPy version (``vllm.v1.spec_decode.lookup``,
patch 0070), computed where the V2 runner keeps its state: each request's
tokens (``all_token_ids``, prompt and output, this step's accepted tokens and
bonus token included) and the drafter's proposals never leave the device, and
the launch has a fixed grid (one program per request) and no host sync.

- The longest recent match (2..8 tokens, within the last 32,768) of the suffix
  of ``history + the drafter's first D tokens`` is continued over positions
  ``[D, K)``; where nothing matches, the drafter's tokens stay.
- When the history alone ends in an 8-token verbatim copy whose next token
  disagrees with the drafter's first, the whole block follows the copy.

Every position whose token lookup decides is a point mass for verification:
its cached draft logits become 0 at that token and -inf elsewhere, so the
rejection sampler's ratio test is exact for it (probabilistic drafting); with
greedy drafting there are no cached logits and a draft is a point mass already.
That includes a lookup token equal to the drafter's: kept with the drafter's
probabilities it would be accepted as if it had been sampled from them.
"""

import torch

import triton
import triton.language as tl
from vllm.v1.spec_decode.lookup import (
    LOOKUP_MAX_MATCH,
    LOOKUP_MIN_MATCH,
    LOOKUP_WINDOW,
)

# Candidate match ends examined per loop iteration of a program.
LOOKUP_SCAN_BLOCK = 1024
# A match's key: length above these bits, its end below (most recent wins ties).
_END_BITS = 32


@triton.jit
def _load_sequence(history_ptr, drafts_ptr, pos, num_history, mask):
    # The virtual sequence history ++ drafts: history below num_history, then drafts.
    in_history = pos < num_history
    from_history = tl.load(
        history_ptr + pos, mask=mask & in_history & (pos >= 0), other=-1
    ).to(tl.int64)
    from_drafts = tl.load(
        drafts_ptr + (pos - num_history), mask=mask & (pos >= num_history), other=-1
    ).to(tl.int64)
    return tl.where(in_history, from_history, from_drafts)


@triton.jit
def _lookup_fill_kernel(
    # [num_reqs, K] int64, rewritten in place
    draft_tokens_ptr,
    draft_tokens_stride,
    # [num_reqs, K] int8 out: 1 where lookup decided the token
    lookup_positions_ptr,
    lookup_positions_stride,
    # [num_reqs] int32 (negative: no request)
    idx_mapping_ptr,
    # [num_reqs] int32 (0: still prefilling, no draft is verified)
    num_sampled_ptr,
    # [max_num_reqs, max_model_len] int32
    all_token_ids_ptr,
    all_token_ids_stride,
    # [max_num_reqs] int32
    total_len_ptr,
    # [max_num_reqs, K, vocab] float32 pre-temperature draft logits
    draft_logits_ptr,
    draft_logits_stride_0,
    draft_logits_stride_1,
    # [max_num_reqs, K, top_k] int64: the finite columns of each draft_logits row
    candidate_ids_ptr,
    candidate_ids_stride_0,
    candidate_ids_stride_1,
    K: tl.constexpr,
    NUM_DRAFTER: tl.constexpr,
    TOP_K: tl.constexpr,
    MIN_MATCH: tl.constexpr,
    MAX_MATCH: tl.constexpr,
    WINDOW: tl.constexpr,
    END_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    HAS_DRAFT_LOGITS: tl.constexpr,
):
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    k_mask = k < K
    drafts_row = draft_tokens_ptr + row * draft_tokens_stride
    positions_row = lookup_positions_ptr + row * lookup_positions_stride
    tl.store(positions_row + k, tl.zeros([BLOCK_K], tl.int8), mask=k_mask)

    state = tl.load(idx_mapping_ptr + row)
    active = (state >= 0) & (tl.load(num_sampled_ptr + row) > 0)
    if active:
        req_state = state.to(tl.int64)
        history = all_token_ids_ptr + req_state * all_token_ids_stride
        n = tl.load(total_len_ptr + req_state).to(tl.int64)
        big_n = n + NUM_DRAFTER
        start_history = tl.maximum(n - WINDOW, 0)
        start_context = tl.maximum(big_n - WINDOW, 0)

        # Every candidate end e is scored by how many of the tokens ending at e
        # equal the suffix (up to MAX_MATCH): for the history's suffix and for
        # the suffix of history + the drafter's tokens, in one pass.
        best_history = tl.full([BLOCK], -1, tl.int64)
        best_context = tl.full([BLOCK], -1, tl.int64)
        for base in range(start_history, big_n - 1, BLOCK):
            e = base + tl.arange(0, BLOCK).to(tl.int64)
            alive_history = e < n - 1
            alive_context = (e < big_n - 1) & (e >= start_context)
            len_history = tl.zeros([BLOCK], tl.int64)
            len_context = tl.zeros([BLOCK], tl.int64)
            for j in tl.static_range(MAX_MATCH):
                pos = e - j
                token = _load_sequence(
                    history,
                    drafts_row,
                    pos,
                    n,
                    (alive_history | alive_context) & (pos >= start_history),
                )
                suffix_history = tl.load(
                    history + (n - 1 - j), mask=n - 1 - j >= 0, other=-1
                ).to(tl.int64)
                suffix_context = _load_sequence(
                    history, drafts_row, big_n - 1 - j, n, big_n - 1 - j >= 0
                )
                alive_history &= (pos >= start_history) & (token == suffix_history)
                alive_context &= (pos >= start_context) & (token == suffix_context)
                len_history += alive_history.to(tl.int64)
                len_context += alive_context.to(tl.int64)
            key_history = tl.where(
                len_history >= MIN_MATCH, (len_history << END_BITS) + e, -1
            )
            key_context = tl.where(
                len_context >= MIN_MATCH, (len_context << END_BITS) + e, -1
            )
            best_history = tl.maximum(best_history, key_history)
            best_context = tl.maximum(best_context, key_context)
        match_history = tl.max(best_history, axis=0)
        match_context = tl.max(best_context, axis=0)
        end_mask = (1 << END_BITS) - 1

        drafts = tl.load(drafts_row + k, mask=k_mask, other=0)
        first_draft = tl.load(drafts_row)
        out = drafts

        # A verbatim copy in the history: it decides position 0 either way.
        has_copy = (match_history >= 0) & ((match_history >> END_BITS) >= MAX_MATCH)
        copy_end = match_history & end_mask
        copy_period = tl.maximum(n - 1 - copy_end, 1)
        copy = tl.load(
            history + copy_end + 1 + (k % copy_period),
            mask=k_mask & has_copy,
            other=-1,
        ).to(tl.int64)
        copy_first = tl.load(history + copy_end + 1, mask=has_copy, other=-1)
        decides_first = has_copy & (copy_first >= 0)
        take_copy = decides_first & (copy_first != first_draft)
        in_copy = take_copy & k_mask & (copy >= 0)
        out = tl.where(in_copy, copy, out)
        point = in_copy | (decides_first & (k == 0))

        # Otherwise positions [NUM_DRAFTER, K) continue the drafter's path.
        has_tail = (not take_copy) & (match_context >= 0) & (NUM_DRAFTER < K)
        tail_end = match_context & end_mask
        tail_period = tl.maximum(big_n - 1 - tail_end, 1)
        tail_mask = k_mask & (k >= NUM_DRAFTER) & has_tail
        tail = _load_sequence(
            history,
            drafts_row,
            tail_end + 1 + (tl.maximum(k - NUM_DRAFTER, 0) % tail_period),
            n,
            tail_mask,
        )
        in_tail = tail_mask & (tail >= 0)
        out = tl.where(in_tail, tail, out)
        point = point | in_tail

        tl.store(drafts_row + k, out, mask=k_mask)
        tl.store(positions_row + k, point.to(tl.int8), mask=k_mask)

        if HAS_DRAFT_LOGITS:
            # Point masses in the sparse draft-logits cache: clear the columns
            # the drafter left finite (all but the token), 0 at the token, and
            # make the token the row's candidates so the next cache write
            # clears it in turn.
            t = tl.arange(0, BLOCK_TOP_K)
            both = point[:, None] & (t[None, :] < TOP_K)
            candidates_at = (
                candidate_ids_ptr
                + req_state * candidate_ids_stride_0
                + k[:, None] * candidate_ids_stride_1
                + t[None, :]
            )
            old = tl.load(candidates_at, mask=both, other=0)
            logits_row = (
                draft_logits_ptr
                + req_state * draft_logits_stride_0
                + k * draft_logits_stride_1
            )
            tl.store(
                logits_row[:, None] + old,
                tl.full([BLOCK_K, BLOCK_TOP_K], float("-inf"), tl.float32),
                mask=both & (old != out[:, None]),
            )
            tl.store(
                logits_row + out, tl.zeros([BLOCK_K], tl.float32), mask=point
            )
            tl.store(
                candidates_at,
                tl.broadcast_to(out[:, None], (BLOCK_K, BLOCK_TOP_K)),
                mask=both,
            )


def fill_lookup_drafts(
    # [num_reqs, K] int64, rewritten in place
    draft_tokens: torch.Tensor,
    # [num_reqs, K] int8 out
    lookup_positions: torch.Tensor,
    # [num_reqs] int32
    idx_mapping: torch.Tensor,
    # [num_reqs] int32
    num_sampled: torch.Tensor,
    # [max_num_reqs, max_model_len] int32
    all_token_ids: torch.Tensor,
    # [max_num_reqs] int32
    total_len: torch.Tensor,
    num_drafter_tokens: int,
    # [max_num_reqs, K, vocab] float32, or None (greedy drafting)
    draft_logits: torch.Tensor | None = None,
    # [max_num_reqs, K, top_k] int64 (with draft_logits)
    candidate_ids: torch.Tensor | None = None,
    window: int = LOOKUP_WINDOW,
) -> None:
    """Rewrite each request's verify block with lookup drafts (see the module)."""
    num_reqs, k = draft_tokens.shape
    if num_reqs == 0:
        return
    has_logits = draft_logits is not None
    if has_logits:
        assert candidate_ids is not None and draft_logits.stride(-1) == 1
        assert candidate_ids.stride(-1) == 1
    logits = draft_logits if has_logits else draft_tokens
    candidates = candidate_ids if has_logits else draft_tokens
    top_k = candidates.shape[-1] if has_logits else 1
    _lookup_fill_kernel[(num_reqs,)](
        draft_tokens,
        draft_tokens.stride(0),
        lookup_positions,
        lookup_positions.stride(0),
        idx_mapping,
        num_sampled,
        all_token_ids,
        all_token_ids.stride(0),
        total_len,
        logits,
        logits.stride(0),
        logits.stride(1),
        candidates,
        candidates.stride(0),
        candidates.stride(1),
        K=k,
        NUM_DRAFTER=num_drafter_tokens,
        TOP_K=top_k,
        MIN_MATCH=LOOKUP_MIN_MATCH,
        MAX_MATCH=LOOKUP_MAX_MATCH,
        WINDOW=window,
        END_BITS=_END_BITS,
        BLOCK=LOOKUP_SCAN_BLOCK,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_TOP_K=triton.next_power_of_2(top_k),
        HAS_DRAFT_LOGITS=has_logits,
        num_warps=4,
    )
