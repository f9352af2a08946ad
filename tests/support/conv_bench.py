"""Times the CPU prefill's depthwise causal conv (width 4) the three ways patch 0079 weighs:
torch's bf16 ``F.conv1d`` on oneDNN (CPUs with AVX-512), the same call on an AVX2-only CPU
(torch's own bf16 kernel: oneDNN has no bf16 there), and the patch's fp32 taps rounded once.
The AVX2 figures come from a child on the AVX2 kernels (the switch `tests.support.avx2_kernels`
installs: oneDNN, MKL and torch limited to AVX2), where `_is_mkldnn_bf16_supported()` answers
as on a real AVX2 CPU. Also counts the elements where the taps differ from oneDNN's bf16 result.

    .venv/bin/python -m tests.support.conv_bench [--channels 1024 10240] [--lengths 16 2048]

Channels: 1,024 is the tiny Qwen3.5's conv, 10,240 the real model's. Needs the patched vLLM
(`make setup`): the taps timed are the patch's own function.
"""

from __future__ import annotations

import argparse
import json

from tests.support.kernel_bench import milliseconds, native_and_avx2

WIDTH = 4


def measure(channels: list[int], lengths: list[int]) -> list[dict]:
    """Times in this process, on whatever kernels it was started with."""
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d

    taps = getattr(causal_conv1d, "_depthwise_conv_fp32", None)
    if taps is None:
        raise SystemExit("this vLLM lacks patch 0079's fp32 taps: run `make setup` (it applies patches/series)")
    torch.manual_seed(0)
    rows = []
    for width in channels:
        weight = torch.randn(width, 1, WIDTH, dtype=torch.bfloat16)
        bias = torch.randn(width, dtype=torch.bfloat16)
        for length in lengths:
            x = torch.randn(1, width, length + WIDTH - 1, dtype=torch.bfloat16)
            repeats = max(5, 20000 // length * 1024 // width)
            def conv():
                return F.conv1d(x, weight, bias, groups=width)
            def fp32():
                return taps(x, weight, bias)
            rows.append({
                "channels": width, "tokens": length,
                "conv_ms": milliseconds(conv, repeats), "taps_ms": milliseconds(fp32, repeats),
                "differing": int((conv() != fp32()).sum()),
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.conv_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, nargs="+", default=[1024, 10240])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 2048], help="tokens per conv")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import torch

        print(json.dumps({"onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                          "threads": torch.get_num_threads(), "rows": measure(args.channels, args.lengths)}))
        return 0
    runs = native_and_avx2("tests.support.conv_bench",
                           ["--channels", *map(str, args.channels), "--lengths", *map(str, args.lengths)])
    native, avx2 = runs["native"], runs["avx2"]
    print(f"torch threads: {native['threads']}; oneDNN bf16 conv: native {native['onednn_bf16']}, "
          f"limited to AVX2 {avx2['onednn_bf16']}")
    print(f"{'channels':>8} {'tokens':>6}  {'conv bf16 native':>16}  {'conv bf16 AVX2':>14}  "
          f"{'taps native':>11}  {'taps AVX2':>9}  taps vs native conv")
    for here, there in zip(native["rows"], avx2["rows"]):
        print(f"{here['channels']:>8} {here['tokens']:>6}  {here['conv_ms']:>13.3f} ms  {there['conv_ms']:>11.3f} ms"
              f"  {here['taps_ms']:>8.3f} ms  {there['taps_ms']:>6.3f} ms  {here['differing']} elements differ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
