"""The k4v2_g128 KV cache's test shape and error bounds, and the checks the interpreter tests
(tests/unit/test_kv_k4v2.py) and the GPU tier (tests/gpu/test_kv_k4v2_gpu.py) share: one home
for the bounds, so the CPU proof and the CUDA proof hold the kernels to the same numbers.

Needs only torch (the kernel module needs triton): no vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tests.split_kv_support import REPO, load_triton_file

KERNEL_FILE = REPO / "patches" / "src" / "v1" / "attention" / "ops" / "qwen38_kv_k4v2.py"
# Qwen3.8-27B's full-attention layers.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 24, 4, 256
SCALE = HEAD_DIM**-0.5

# Quantization error on random N(0,1) K/V and q (diffuse attention, the hard case for
# 2-bit values: the output is a mean of many quantized rows). Measured (docs/kv-k4v2.md):
# relative Frobenius error 0.50-0.52, minimum per-row cosine 0.84-0.88, max abs 0.06
# (ctx 4200) to 0.38 (ctx 130, where fewer rows are averaged).
MAX_REL_ERROR_VS_BF16 = 0.60
MIN_COSINE_VS_BF16 = 0.80
MAX_ABS_ERROR_VS_BF16 = 0.50
# Against the dequantized cache the kernel differs only by float rounding: the fp16
# P.V operand (2^-11 relative per term) and the bf16 output (2^-8 relative).
DEQ_ATOL, DEQ_RTOL = 2e-3, 2.0**-7
# The same, as a relative Frobenius error: at long contexts the output of diffuse attention
# is smaller than DEQ_ATOL (about 1/sqrt(context): 2e-3 at 245,760 tokens), so the elementwise
# bound alone would pass a kernel that wrote zeros. Rounding errs about 2^-9 relative (the bf16
# output) plus the fp16 operands' averaged share; 2^-6 leaves room and still fails a kernel
# off by a page, a head or a split (errors of order 1).
DEQ_MAX_REL_ERROR = 2.0**-6


def load_k4v2(*, interpret: bool):
    """The k4v2 kernel module from patches/src (see `load_triton_file`)."""
    return load_triton_file(KERNEL_FILE, "qwen38_kv_k4v2", interpret=interpret)


@dataclass(frozen=True)
class AttentionErrors:
    """The kernel's output against float32 attention over the dequantized cache (``deq_*``:
    kernel bugs) and over the unquantized bf16 K/V (``bf16_*``: the format's error)."""

    deq_max_abs: float
    deq_rel: float
    deq_within_elementwise: bool
    bf16_rel: float
    bf16_min_cos: float
    bf16_max_abs: float

    def line(self) -> str:
        return (f"kernel-vs-deq max {self.deq_max_abs:.2e} rel {self.deq_rel:.2e}; vs bf16 rel {self.bf16_rel:.3f} "
                f"min cos {self.bf16_min_cos:.3f} max abs {self.bf16_max_abs:.3f}")

    def failures(self, *, check_deq_rel: bool = True) -> list[str]:
        """What is out of bounds, one line each (empty: all within)."""
        found = []
        if not self.deq_within_elementwise:
            found.append(f"kernel vs dequantized: max abs {self.deq_max_abs:.3e} beyond {DEQ_ATOL} + {DEQ_RTOL} |ref|")
        if check_deq_rel and not self.deq_rel <= DEQ_MAX_REL_ERROR:
            found.append(f"kernel vs dequantized: rel error {self.deq_rel:.3e} > {DEQ_MAX_REL_ERROR:.3e}")
        if not self.bf16_rel <= MAX_REL_ERROR_VS_BF16:
            found.append(f"vs bf16 K/V: rel error {self.bf16_rel:.3f} > {MAX_REL_ERROR_VS_BF16}")
        if not self.bf16_min_cos >= MIN_COSINE_VS_BF16:
            found.append(f"vs bf16 K/V: min cosine {self.bf16_min_cos:.3f} < {MIN_COSINE_VS_BF16}")
        if not self.bf16_max_abs <= MAX_ABS_ERROR_VS_BF16:
            found.append(f"vs bf16 K/V: max abs {self.bf16_max_abs:.3f} > {MAX_ABS_ERROR_VS_BF16}")
        return found


def attention_errors(out: torch.Tensor, ref_deq: torch.Tensor, ref_bf16: torch.Tensor) -> AttentionErrors:
    """`AttentionErrors` of ``out`` (bf16, (tokens, heads, d)) against the two float32 references;
    a non-finite output fails every bound (NaN compares false)."""
    got = out.float()
    err = (got - ref_deq).abs()
    finite = bool(torch.isfinite(got).all())
    within = finite and bool((err <= DEQ_ATOL + DEQ_RTOL * ref_deq.abs()).all())
    diff = got - ref_bf16
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1), ref_bf16.flatten(0, 1), dim=-1)
    return AttentionErrors(
        deq_max_abs=float(err.max()), deq_rel=float((got - ref_deq).norm() / ref_deq.norm()),
        deq_within_elementwise=within, bf16_rel=float(diff.norm() / ref_bf16.norm()),
        bf16_min_cos=float(cos.min()), bf16_max_abs=float(diff.abs().max()),
    )


def dequantized_failures(out: torch.Tensor, ref_deq: torch.Tensor) -> list[str]:
    """The kernel-bug bounds alone (``DEQ_*``) of ``out`` against float32 attention over the
    dequantized cache, one line per failure. For outputs whose rows see few keys (the first rows
    of a prefill from position 0: a row that sees one key returns that key's 2-bit value), where
    the format's own error has no bound to hold."""
    got = out.float()
    err = (got - ref_deq).abs()
    found = []
    if not (bool(torch.isfinite(got).all()) and bool((err <= DEQ_ATOL + DEQ_RTOL * ref_deq.abs()).all())):
        found.append(f"kernel vs dequantized: max abs {float(err.max()):.3e} beyond {DEQ_ATOL} + {DEQ_RTOL} |ref|")
    rel = float((got - ref_deq).norm() / ref_deq.norm())
    if not rel <= DEQ_MAX_REL_ERROR:
        found.append(f"kernel vs dequantized: rel error {rel:.3e} > {DEQ_MAX_REL_ERROR:.3e}")
    return found


def timed_prefill(k4v2, q: torch.Tensor, cache: torch.Tensor, args: dict, workspace) -> dict[str, tuple]:
    """One prefill chunk ``q`` over ``cache`` through `prefill_attention` (the split kernel over
    virtual requests) and through `prefill_attention_reference` (the torch loop, float32), each
    warmed once, then timed once: name -> (output in the layer's dtype, milliseconds; CUDA
    events on a GPU, the wall clock under the interpreter). ``args``: both functions' keywords."""
    runs = {"kernel": lambda o: k4v2.prefill_attention(q, cache, o, workspace=workspace, **args),
            "torch_loop": lambda o: k4v2.prefill_attention_reference(q, cache, o, **args)}
    cuda = q.is_cuda
    timed = {}
    for name, call in runs.items():
        out = torch.full_like(q, float("nan"))  # the layer's dtype, as vLLM hands it
        call(out)  # compiles / warms
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(out)
            end.record()
            torch.cuda.synchronize()
            timed[name] = (out, start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call(out)
            timed[name] = (out, (time.perf_counter() - began) * 1000)
    return timed


# Shared memory one block may take on the 3090 (compute capability 8.6, with the opt-in Triton
# makes for it: 99 KB; CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"). A kernel tuned on the H100 (227 KB) can compile for sm_86 and still not launch.
SM86_MAX_SHARED_BYTES = 99 * 1024


def _launches(k4v2) -> dict[str, tuple[object, dict[str, str], dict[str, object], dict[str, int]]]:
    """What the engine launches, by name: (kernel, pointer types, constexprs, options) as the
    module's launchers pass them for Qwen3.8's heads (24 q / 4 kv, bf16 queries): the cache write,
    the split kernel for decode (1 token), the K=7 verify (8), the 16-token lookup verify and the
    prefill path's virtual requests (16 rows, `PREFILL_MAX_SPLITS`), and the merge. The row
    arithmetic is `kvk4v2_attention`'s (tokens per program and BLOCK_M from the query length)."""
    import triton
    import triton.language as tl

    config = k4v2.KVK4V2Config()
    group = NUM_Q_HEADS // NUM_KV_HEADS
    cache = {"cache_u8_ptr": "*u8", "cache_f16_ptr": "*fp16"}
    partial_ptrs = {"q_ptr": "*bf16", **cache, "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                    "seqused_k_ptr": "*i32", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                    "scale_log2": "fp32", "cache_offset": "i64"}
    splits = {"TILE_N": config.tile_n, "MIN_SPLIT_TOKENS": config.min_split_tokens}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    write_ptrs = {"key_ptr": "*bf16", "value_ptr": "*bf16", "slot_ptr": "*i64", **cache, "cache_offset": "i64"}
    launches = {"write": (k4v2._kvk4v2_write_kernel, write_ptrs, {"ROWS": 16}, {"num_warps": 4})}
    for name, query, max_splits in (("decode", 1, k4v2.DEFAULT_MAX_SPLITS), ("verify-k7", 8, k4v2.DEFAULT_MAX_SPLITS),
                                    ("verify-16", k4v2.MAX_VERIFY_TOKENS, k4v2.DEFAULT_MAX_SPLITS),
                                    ("prefill", k4v2.MAX_VERIFY_TOKENS, k4v2.PREFILL_MAX_SPLITS)):
        tokens = max(1, min(query, config.block_m_cap // group))
        block_m = max(16, triton.next_power_of_2(tokens * group))
        constants = {"NUM_KV_HEADS": NUM_KV_HEADS, "GROUP": group, "BLOCK_M": block_m, "TOKENS_PER_PROGRAM": tokens,
                     "MAX_SPLITS": max_splits, "K_OP": tl.bfloat16, "V_OP": tl.float16, **splits}
        launches[f"partial-{name}"] = (k4v2._kvk4v2_partial_kernel, partial_ptrs, constants, options)
    launches["merge"] = (k4v2._kvk4v2_merge_kernel,
                         {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                          "cu_seqlens_q_ptr": "*i32", "seqused_k_ptr": "*i32"},
                         {**splits, "MAX_SPLITS": k4v2.DEFAULT_MAX_SPLITS, "INTERPRETED": False}, {"num_warps": 4})
    return launches


def compile_for(arch: int) -> dict[str, object]:
    """Each launch of `_launches` compiled for sm_<arch> (`compile_for_cuda`): name -> the shared
    memory a block takes (bytes), or "skip: ..." where this Triton has no CUDA toolchain. Needs
    Triton outside its interpreter: `python -m tests.support.kv_k4v2 ARCH...` in a process of its own."""
    from tests.support.triton_compile import compile_for_cuda

    results: dict[str, object] = {}
    for name, (kernel, pointers, constants, options) in _launches(load_k4v2(interpret=False)).items():
        signature = {arg: pointers.get(arg, "i32") for arg in kernel.arg_names if arg not in constants}
        compiled = compile_for_cuda(kernel, signature, constants, arch, options)
        results[name] = compiled if isinstance(compiled, str) else compiled.metadata.shared
    return results


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps({"results": {arch: compile_for(int(arch)) for arch in sys.argv[1:]}}))
