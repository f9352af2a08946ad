"""qwen38 patch 0047: vLLM 0.28.0 knows the k4v2_g128 KV cache dtype (docs/kv-k4v2.md).

On CPU: the patched config takes the name and stores it as uint8, the Triton backend gives
a head-256 layer the format's page and refuses other heads, other backends do not list it,
stock vLLM knows none of it; the glue the Triton backend calls (vLLM's layer cache as
128-token pages, its block table as a page table, the decode/verify kernel and the prefill
path: the same kernel over 16-row virtual requests, also for a mixed prefill + decode batch)
writes and reads a cache shaped as vLLM shapes it, against the torch reference, under
the Triton interpreter; and the planner's own layout of the format (used where the tree lacks
the patch) gives `huge` exactly the plan vLLM's registered arithmetic gives. The engine run
needs a GPU (not done yet)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from core.profiles import load_profile
from tests.split_kv_support import REPO, load_triton_file
from tests.support.kv_k4v2 import (
    DEQ_ATOL,
    DEQ_RTOL,
    HEAD_DIM,
    KERNEL_FILE,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    SCALE,
    dequantized_failures,
)
from tests.support.plans import user_settings
from tests.support.vllm_views import child_env, json_in_views, last_json_line, view_without

PATCH = "0047-k4v2-kv-cache-dtype.patch"
VLLM_BLOCK = 256  # two 128-token pages per vLLM block, as `huge`'s 2,176-token block is 17

CONFIG = r"""
import json
from typing import get_args
import torch
from vllm.config.cache import CacheDType
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

name = "k4v2_g128"
result = {"literal": name in get_args(CacheDType), "storage": str(STR_DTYPE_TO_TORCH_DTYPE.get(name)),
          "mode": get_kv_quant_mode(name).name, "triton": name in TritonAttentionBackend.supported_kv_cache_dtypes,
          "flash_attn": name in FlashAttentionBackend.supported_kv_cache_dtypes}
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
try:
    result["cli"] = parser.parse_args(["--kv-cache-dtype", name]).kv_cache_dtype
except SystemExit:
    result["cli"] = None
if result["literal"]:
    def spec(block, heads, head):
        return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=torch.uint8,
                                 kv_quant_mode=get_kv_quant_mode(name))
    result["page_3072"] = TritonAttentionBackend.customize_spec(spec(3072, 4, 256)).page_size_bytes
    result["shape"] = list(TritonAttentionBackend.get_kv_cache_shape(5, 3072, 4, 256, name))
    try:
        TritonAttentionBackend.customize_spec(spec(16, 8, 128))
        result["head_128"] = "accepted"
    except ValueError as exc:
        result["head_128"] = str(exc)
    try:
        TritonAttentionBackend.get_kv_cache_shape(5, 64, 4, 256, name)
        result["block_64"] = "accepted"
    except ValueError as exc:
        result["block_64"] = str(exc)
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def config_in_views(vllm_views):
    return json_in_views(CONFIG, vllm_views)


def test_patched_vllm_takes_the_name_and_stores_it_in_byte_pages(config_in_views):
    patched = config_in_views["patched"]
    assert patched["literal"] and patched["cli"] == "k4v2_g128" and patched["storage"] == "torch.uint8"
    assert patched["mode"] == "K4V2_G128" and patched["triton"] and not patched["flash_attn"]
    assert patched["page_3072"] == 4 * 3072 * 208 == 24 * 106_496
    assert patched["shape"] == [5, 4, 3072, 208]
    assert "holds head_dim 256 layers, not 128" in patched["head_128"]
    assert "multiple of 128, not 64" in patched["block_64"]


def test_stock_vllm_refuses_the_name(config_in_views):
    stock = config_in_views["stock"]
    assert not stock["literal"] and stock["cli"] is None and stock["storage"] == "None"
    assert stock["mode"] == "NONE" and not stock["triton"]


# The request's path comes first in the script (REQUEST = ...), not in the environment: a
# variable of its own would start a warm Python of its own for the patched view, where the one
# `config_in_views` started serves (tests.support.warm_python: one per view and environment).
PLAN = r"""
import json
from entrypoint import kv_capacity
kv_capacity._inspect_in_this_process()
request = json.loads(open(REQUEST).read())
print(json.dumps(kv_capacity.plan_request(request)))
"""


@pytest.mark.slow
def test_the_planners_layout_is_vllms_once_the_dtype_is_registered(vllm_views, tmp_path):
    """`huge` planned by the patched tree (vLLM's own page for the registered dtype) and by the
    same tree without patch 0047 (the planner lays the format out itself): the same plan."""
    from entrypoint.model_configs import read_model_configs
    from entrypoint.plan import build_request
    from entrypoint.resolve import resolve

    profile = load_profile("huge")
    resolved = resolve(profile, user_settings("huge", models_dir=tmp_path / "models"))
    request = build_request(resolved, read_model_configs(profile, resolved, tmp_path / "models"), tmp_path / "w")
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(request))
    views = {"registered": vllm_views["patched"], "laid out": view_without(PATCH, tmp_path / "without").parent}
    answers = json_in_views(f"REQUEST = {str(request_file)!r}\n" + PLAN, views)
    registered, laid_out = answers["registered"], answers["laid out"]
    assert registered["kv_layout"] == "vLLM's" and "from its definition" in laid_out["kv_layout"]
    assert registered["fits"] and registered["pool_tokens"] == 293_456 and registered["block_size"] == 2176
    same = {key: value for key, value in registered.items() if key != "kv_layout"}
    assert {key: laid_out[key] for key in same} == same


# ---- the backend's glue, on a cache shaped as vLLM shapes it (Triton interpreter) ----------


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def k4v2():
    return load_triton_file(KERNEL_FILE, "qwen38_kv_k4v2", interpret=True)


def _vllm_cache(num_blocks: int) -> torch.Tensor:
    """A layer's cache as vLLM's Triton backend gets it: logical (blocks, heads, tokens, 208)
    from get_kv_cache_shape over physical NHD memory (blocks, tokens, heads, 208)."""
    return torch.zeros(num_blocks, VLLM_BLOCK, NUM_KV_HEADS, 208, dtype=torch.uint8).permute(0, 2, 1, 3)


def _requests(k4v2, contexts: list[int], seed: int):
    """K/V of each request written through the glue at vLLM's slots; its block table."""
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // VLLM_BLOCK) for n in contexts]
    order = torch.randperm(sum(blocks_each) + 1, generator=gen)
    table = torch.zeros(len(contexts), max(blocks_each), dtype=torch.int32)
    cache = _vllm_cache(sum(blocks_each) + 1)
    kv, used = [], 0
    for seq, n in enumerate(contexts):
        table[seq, : blocks_each[seq]] = order[used : used + blocks_each[seq]].int()
        used += blocks_each[seq]
        key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        value = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        pos = torch.arange(n)
        slots = table[seq, pos // VLLM_BLOCK].long() * VLLM_BLOCK + pos % VLLM_BLOCK
        k4v2.write(key, value, cache, slots)
        kv.append((key, value, slots))
    return cache, table, kv, gen


def test_the_glue_writes_vllm_slots_into_the_pages_the_reference_writes(k4v2, interpreter):
    cache, _, kv, _ = _requests(k4v2, [300, 77], seed=3)
    pages = k4v2.layer_pages(cache, NUM_KV_HEADS)
    assert pages.shape == (cache.shape[0] * 2, 106_496) and pages.data_ptr() == cache.data_ptr()
    expected = torch.zeros_like(pages)
    for key, value, slots in kv:
        k4v2.write_reference(expected, key, value, slots)
    assert torch.equal(pages, expected)


def _glue_batch(k4v2, q_lens: list[int], contexts: list[int], seed: int):
    """`forward` over requests with `contexts` keys, the last `q_lens` of them queries: q, the
    output, each request's float32 reference over the dequantized cache, cu_seqlens_q, the
    workspace, and the pages with their page table."""
    cache, table, _, gen = _requests(k4v2, contexts, seed=seed)
    q = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen).bfloat16()
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    out = torch.zeros_like(q)
    workspace = k4v2.KVK4V2Workspace(2, k4v2.MAX_VERIFY_TOKENS, NUM_Q_HEADS, max_splits=16, device="cpu")
    k4v2.forward(q, cache, out, num_kv_heads=NUM_KV_HEADS, cu_seqlens_q=cu,
                 seqused_k=torch.tensor(contexts, dtype=torch.int32), block_table=table,
                 max_seqlen_q=max(q_lens), softmax_scale=SCALE, workspace=workspace)
    pages = k4v2.layer_pages(cache, NUM_KV_HEADS)
    page_table = k4v2.page_table(table, 2)
    refs = []
    for seq, n in enumerate(contexts):
        keys, values = k4v2.gather_dequantized(pages, NUM_KV_HEADS, page_table[seq], n)
        refs.append(k4v2.reference_attention(q[int(cu[seq]) : int(cu[seq + 1])], keys, values, SCALE))
    return q, out, refs, cu, workspace, (pages, page_table)


@pytest.mark.parametrize("q_lens", [[1, 1], [8, 3]], ids=["decode", "verify"])
def test_the_glue_attends_like_the_reference_over_the_dequantized_cache(k4v2, interpreter, q_lens):
    _, out, refs, cu, _, _ = _glue_batch(k4v2, q_lens, [300, 77], seed=11)
    for seq, ref in enumerate(refs):
        got = out[int(cu[seq]) : int(cu[seq + 1])].float()
        assert torch.all((got - ref).abs() <= DEQ_ATOL + DEQ_RTOL * ref.abs()), f"request {seq}"


def test_a_mixed_prefill_and_decode_batch_takes_the_kernel_and_gets_both_right(k4v2, interpreter, monkeypatch):
    """As vLLM sends chunked prefill: one request's 21-row chunk from position 279 (not a
    multiple of 16) beside a decode, max_seqlen_q the batch's 21: the split-KV kernel over
    virtual requests (the torch loop is not called), each request within the kernel bound,
    and the same answer the torch loop gives."""

    def no_loop(*_args, **_kwargs):
        raise AssertionError("the torch prefill loop ran")

    monkeypatch.setattr(k4v2, "prefill_attention_reference", no_loop)
    q, out, refs, cu, workspace, (pages, page_table) = _glue_batch(k4v2, [21, 1], [300, 77], seed=13)
    monkeypatch.undo()
    assert workspace.prefill is not None and workspace.prefill.max_num_seqs == k4v2.prefill_capacity(22, 2)
    for seq, ref in enumerate(refs):
        got = out[int(cu[seq]) : int(cu[seq + 1])]
        assert not dequantized_failures(got, ref), (seq, dequantized_failures(got, ref))
    loop = k4v2.prefill_attention_reference(q, pages, torch.zeros_like(q), num_kv_heads=NUM_KV_HEADS, cu_seqlens_q=cu,
                                            seqused_k=torch.tensor([300, 77], dtype=torch.int32),
                                            block_table=page_table, softmax_scale=SCALE)
    assert not dequantized_failures(out, loop.float())


def test_prefill_reference_bounds_memory_by_chunks_and_gives_the_same_answer(k4v2, interpreter):
    """The torch prefill loop (the tests' reference) walks queries and context in chunks
    (online softmax): tiny chunks give what one chunk gives."""
    cache, table, _, gen = _requests(k4v2, [300], seed=5)
    q = torch.randn(40, NUM_Q_HEADS, HEAD_DIM, generator=gen).bfloat16()
    pages = k4v2.layer_pages(cache, NUM_KV_HEADS)
    args = dict(num_kv_heads=NUM_KV_HEADS, cu_seqlens_q=torch.tensor([0, 40], dtype=torch.int32),
                seqused_k=torch.tensor([300], dtype=torch.int32), block_table=k4v2.page_table(table, 2),
                softmax_scale=SCALE)
    whole = k4v2.prefill_attention_reference(q, pages, torch.zeros_like(q), **args, query_rows=64, context_tokens=4096)
    chunked = k4v2.prefill_attention_reference(q, pages, torch.zeros_like(q), **args, query_rows=7, context_tokens=50)
    assert torch.allclose(whole.float(), chunked.float(), atol=2e-2, rtol=2**-7)


def test_the_format_holds_only_head_256_full_attention_layers(k4v2):
    assert k4v2.holds_layer(256, None)
    assert not k4v2.holds_layer(128, 2048) and not k4v2.holds_layer(128, None) and not k4v2.holds_layer(256, 2048)


def test_the_patch_delivers_the_series_source_verbatim():
    text = (REPO / "patches" / PATCH).read_text()
    start = text.index("+++ b/v1/attention/ops/qwen38_kv_k4v2.py")
    body = text[start:].split("\n", 2)[2]  # after the +++ and @@ lines
    added = []
    for line in body.splitlines():
        if not line.startswith("+"):
            break
        added.append(line[1:])
    assert "\n".join(added) + "\n" == KERNEL_FILE.read_text()


def test_the_series_delivers_it_where_installed():
    from entrypoint.patches import check_series, find_vllm_dir

    statuses = {s.name: s.state for s in check_series(find_vllm_dir())}
    if statuses.get(PATCH) != "present":
        pytest.skip("the installed vLLM is not patched")
    # A new Python importing the module alone (~8 s of one core), not a warm Python of the
    # installed tree (torch, vLLM and its config first: ~14 s) that no other unit test uses.
    done = subprocess.run(
        [sys.executable, "-c", "import json; from vllm.v1.attention.ops import qwen38_kv_k4v2 as m; "
         "print(json.dumps({'name': m.KV_CACHE_DTYPE}))"],
        capture_output=True, text=True, env=child_env(None), cwd=REPO, timeout=300, check=False,
    )
    assert last_json_line(done) == {"name": "k4v2_g128"}
