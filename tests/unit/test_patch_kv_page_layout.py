"""Patch 0030: the KV page layout of a Qwen3.8 target with a DFlash2 drafter, as vLLM
0.28.0's own functions compute it from the real layer specs (16 attention + 48 GDN
target layers, 5 sliding-window drafter layers), stock vs patched.

The figures are those of the 3090 seed (CI-NOTES.md reproduced them on CPU):
`single` 69,758 tokens (68,605 with prefix caching), `long` 138,696 (136,429).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def layout(plan, variant):
    cap = plan.variants[variant]
    return {(row.kind, row.layers, row.block_size) for row in cap.groups}, cap


def test_stock_groups_by_the_drafter_bucket_and_pads_target_attention(seed_plans):
    groups, cap = layout(seed_plans[("single", False)], "stock")
    assert cap.group_size == 5
    attention = [row for row in cap.groups if row.kind == "attention"]
    assert len(attention) == 4  # 16 attention layers spread over 4 groups of 5: 4 slots padded
    assert cap.context_bytes_per_token == 20 * 4096  # 20 layer pages per token instead of 16


def test_patched_groups_by_eight_without_padding_the_target(seed_plans):
    groups, cap = layout(seed_plans[("single", False)], "patched")
    assert cap.group_size == 8
    assert groups == {("gdn-state", 8, 65536), ("attention", 8, 448), ("sliding-window", 5, 448)}
    assert sum(row.kind == "gdn-state" for row in cap.groups) == 6
    assert cap.context_bytes_per_token == 16 * 4096  # exactly the target's 64 KiB per token


def test_int8_drafter_window_pads_16_token_blocks_on_stock(seed_plans):
    _, cap = layout(seed_plans[("long", False)], "stock")
    window = [row for row in cap.groups if row.kind == "sliding-window"]
    assert window and all(row.block_size == 16 for row in window)
    # Each 16-token window block costs a whole 1.8 MB page: the 131,072 context fits
    # only up to ~33.7k tokens (the seed: "not even 32k").
    assert not cap.fits and cap.max_model_len_that_fits < 40000


def test_int8_drafter_window_takes_the_target_block_size_when_patched(seed_plans):
    _, cap = layout(seed_plans[("long", False)], "patched")
    assert {row.block_size for row in cap.groups if row.kind != "gdn-state"} == {864}
    window = next(row for row in cap.groups if row.kind == "sliding-window")
    assert window.page_bytes == 864 * 2112  # its own page is now the largest one
    assert cap.fits


@pytest.mark.parametrize(
    ("profile", "prefix_caching", "tokens"),
    [("single", False, 69758), ("single", True, 68605), ("long", False, 138696), ("long", True, 136429)],
)
def test_patched_pool_tokens_match_the_seed(seed_plans, profile, prefix_caching, tokens):
    plan = seed_plans[(profile, prefix_caching)]
    assert plan.patched
    assert plan.fits
    assert plan.pool_tokens == tokens


@pytest.mark.parametrize("profile", ["single", "long"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_stock_vllm_refuses_single_and_long(seed_plans, profile, prefix_caching):
    stock = seed_plans[(profile, prefix_caching)].variants["stock"]
    assert not stock.fits
    assert "To serve at least one request with the model's max seq len" in stock.refusal


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_window_far_smaller_than_a_4_bit_target_page_is_padded_not_promoted(seed_plans, prefix_caching):
    """`huge`: k4v2_g128 target pages (2,176 tokens x 832 B) beside the drafter's bf16 window (4,096 B
    per token). Promoting the window to 2,176-token blocks would make an 8.9 MB page every other page
    pads to; the window takes the largest block that divides 2,176 and fits the target page (272),
    padded to it, and no other page is padded."""
    cap = seed_plans[("huge", prefix_caching)].serving
    window = [g for g in cap.groups if g.kind == "sliding-window"]
    page = cap.bytes_per_block // cap.group_size
    assert [(g.block_size, g.page_bytes) for g in window] == [(272, page)] and 272 * 4096 <= page < 544 * 4096
    assert {g.page_bytes for g in cap.groups} == {page} == {2176 * 832}
