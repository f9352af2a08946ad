"""Times the two bf16 prefill computations patches 0081 and 0083 move to fp32 where oneDNN takes
no bf16 (AVX2-only CPUs), on the machine's own kernels and limited to AVX2:

- the chunked gated delta rule of the GDN layers: vLLM-CPU's C++ kernel
  (``ops.chunk_gated_delta_rule_cpu``, whose matmuls are torch's bf16 GEMM) against patch 0081's
  fp32 rule, with the largest difference between their outputs (bf16);
- a linear layer: torch's bf16 ``F.linear`` against what vLLM's CPU dispatch picks for the layer
  (oneDNN's bf16 matmul where it builds one; patch 0083's fp32 linear where it does not), with the
  largest difference between their outputs.

    .venv/bin/python -m tests.support.prefill_bench [--tokens 16 2048] [--gdn-heads 2x4 16x48] \\
        [--linear 1536x128 5120x5120]

GDN heads are key x value heads of dim 128 (2x4 the tiny Qwen3.5's, 16x48 the real model's);
linear shapes are out x in features (1536x128 the tiny model's GDN input projection). Needs the
patched vLLM (`make setup`): the fp32 paths timed are the patches' own functions.
"""

from __future__ import annotations

import argparse
import json

from tests.support.kernel_bench import milliseconds, native_and_avx2

DIM = 128


def _repeats(work: float) -> int:
    return max(2, min(20, int(2e8 / max(work, 1.0))))


def gdn_rows(tokens: list[int], heads: list[tuple[int, int]]) -> list[dict]:
    import torch

    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    fp32 = getattr(gdn_attention, "_chunk_gated_delta_rule_fp32", None)
    if fp32 is None:
        raise SystemExit("this vLLM lacks patch 0081's fp32 rule: run `make setup` (it applies patches/series)")
    torch.manual_seed(0)
    rows = []
    for key_heads, value_heads in heads:
        for length in tokens:
            state = torch.randn(1, value_heads, DIM, DIM) * 0.1
            args = {
                "query": torch.randn(1, length, key_heads, DIM, dtype=torch.bfloat16),
                "key": torch.randn(1, length, key_heads, DIM, dtype=torch.bfloat16),
                "value": torch.randn(1, length, value_heads, DIM, dtype=torch.bfloat16),
                "g": -torch.rand(1, length, value_heads) * 0.5,
                "beta": torch.rand(1, length, value_heads).to(torch.bfloat16),
                "output_final_state": True, "cu_seqlens": torch.tensor([0, length], dtype=torch.int32),
                "head_first": False, "use_qk_l2norm_in_kernel": True,
                "initial_state_indices": torch.zeros(1, dtype=torch.int32),
            }
            repeats = _repeats(length * value_heads * DIM * DIM * 4)
            kernel = ops.chunk_gated_delta_rule_cpu(initial_state=state.clone(), **args)[0]
            rule = fp32(initial_state=state.clone(), **args)[0]
            rows.append({
                "heads": f"{key_heads}x{value_heads}", "tokens": length,
                "kernel_ms": milliseconds(lambda: ops.chunk_gated_delta_rule_cpu(initial_state=state.clone(), **args),
                                          repeats),
                "fp32_ms": milliseconds(lambda: fp32(initial_state=state.clone(), **args), repeats),
                "max_difference": float((kernel.float() - rule.float()).abs().max()),
                "output_scale": float(kernel.float().abs().max()),
            })
    return rows


def linear_rows(tokens: list[int], shapes: list[tuple[int, int]]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.manual_seed(0)
    rows = []
    for out_features, in_features in shapes:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.05,
                                          requires_grad=False)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        for length in tokens:
            x = torch.randn(length, in_features, dtype=torch.bfloat16)
            repeats = _repeats(length * out_features * in_features)
            plain, dispatched = F.linear(x, layer.weight), layer.cpu_linear(x, layer.weight, None)
            rows.append({
                "shape": f"{out_features}x{in_features}", "tokens": length,
                "bf16_ms": milliseconds(lambda: F.linear(x, layer.weight), repeats),
                "dispatched_ms": milliseconds(lambda: layer.cpu_linear(x, layer.weight, None), repeats),
                "max_difference": float((plain.float() - dispatched.float()).abs().max()),
                "output_scale": float(plain.float().abs().max()),
            })
    return rows


def _pairs(text: str) -> tuple[int, int]:
    first, _, second = text.partition("x")
    return int(first), int(second)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.prefill_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 2048])
    parser.add_argument("--gdn-heads", nargs="+", default=["2x4", "16x48"], help="key x value heads")
    parser.add_argument("--linear", nargs="+", default=["1536x128", "5120x5120"], help="out x in features")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    heads, shapes = [_pairs(h) for h in args.gdn_heads], [_pairs(s) for s in args.linear]
    if args.child:
        import torch

        print(json.dumps({"onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                          "threads": torch.get_num_threads(),
                          "gdn": gdn_rows(args.tokens, heads), "linear": linear_rows(args.tokens, shapes)}))
        return 0
    runs = native_and_avx2("tests.support.prefill_bench", ["--tokens", *map(str, args.tokens), "--gdn-heads",
                           *args.gdn_heads, "--linear", *args.linear])
    native, avx2 = runs["native"], runs["avx2"]
    print(f"torch threads: {native['threads']}; oneDNN bf16: native {native['onednn_bf16']}, "
          f"limited to AVX2 {avx2['onednn_bf16']}")
    print("gated delta rule (ms)  heads  tokens  kernel native  kernel AVX2  fp32 native  fp32 AVX2  "
          "fp32 vs kernel (AVX2)")
    for here, there in zip(native["gdn"], avx2["gdn"]):
        print(f"{'':22} {here['heads']:>5} {here['tokens']:>7} {here['kernel_ms']:>14.2f} "
              f"{there['kernel_ms']:>12.2f} {here['fp32_ms']:>12.2f} {there['fp32_ms']:>10.2f}  "
              f"{there['max_difference']:.3g} of {there['output_scale']:.3g}")
    print("linear (ms)            shape      tokens  bf16 native  bf16 AVX2  dispatched native  dispatched AVX2  "
          "dispatched vs bf16 (AVX2)")
    for here, there in zip(native["linear"], avx2["linear"]):
        print(f"{'':22} {here['shape']:>10} {here['tokens']:>6} {here['bf16_ms']:>12.3f} {there['bf16_ms']:>10.3f} "
              f"{here['dispatched_ms']:>18.3f} {there['dispatched_ms']:>16.3f}  "
              f"{there['max_difference']:.3g} of {there['output_scale']:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
