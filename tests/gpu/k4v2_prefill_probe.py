"""The k4v2 prefill path's error against float32 attention over the dequantized cache, at the
contexts of tests/gpu/test_kv_k4v2_gpu.py, with torch and Triton alone (no vLLM, no pytest: one
call on a bare lent GPU, `python3 -m tests.gpu.k4v2_prefill_probe --out FILE`).

A request of CONTEXT tokens written by the write kernel; its last ROWS positions as one prefill
chunk through `prefill_attention` (one split per virtual request: the longest loop a program
runs) and through `prefill_attention_reference` (torch, float32). Prints and writes each
context's relative error and both timings. The tier test asserts the bound; this prints it.
Under TRITON_INTERPRET=1 it runs on the CPU (small contexts only: `--contexts 2048 --rows 32`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tests.split_kv_support import load_triton_file
from tests.support.kv_k4v2 import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, SCALE, load_k4v2, timed_prefill


def probe(k4v2, seq_len: int, rows: int, device: str) -> dict[str, float]:
    gen = torch.Generator(device=device).manual_seed(seq_len)
    shape = (seq_len, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(shape, generator=gen, device=device).bfloat16()
    value = torch.randn(shape, generator=gen, device=device).bfloat16()
    pages = -(-seq_len // k4v2.BLOCK_SIZE)
    order = torch.randperm(pages + 1, generator=gen, device=device)
    table = torch.zeros(1, pages + 1, dtype=torch.int32, device=device)
    table[0, :pages] = order[:pages].int()
    pos = torch.arange(seq_len, device=device)
    slots = table[0, pos // k4v2.BLOCK_SIZE].long() * k4v2.BLOCK_SIZE + pos % k4v2.BLOCK_SIZE
    cache = k4v2.allocate_cache(pages + 1, NUM_KV_HEADS, device=device)
    k4v2.kvk4v2_write(key, value, cache, slots)
    q = torch.randn((rows, NUM_Q_HEADS, HEAD_DIM), generator=gen, device=device).bfloat16()
    args = dict(num_kv_heads=NUM_KV_HEADS, cu_seqlens_q=torch.tensor([0, rows], dtype=torch.int32, device=device),
                seqused_k=torch.tensor([seq_len], dtype=torch.int32, device=device), block_table=table,
                softmax_scale=SCALE)
    workspace = k4v2.KVK4V2Workspace(1, k4v2.MAX_VERIFY_TOKENS, NUM_Q_HEADS, device=device)
    timed = timed_prefill(k4v2, q, cache, args, workspace)
    (got, kernel_ms), (loop, loop_ms) = timed["kernel"], timed["torch_loop"]
    got, loop = got.float(), loop.float()
    return {"context": seq_len, "rows": rows, "rel_error": float((got - loop).norm() / loop.norm()),
            "max_abs": float((got - loop).abs().max()), "kernel_ms": kernel_ms, "torch_loop_ms": loop_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="25000,128000", help="comma list of context lengths")
    parser.add_argument("--rows", type=int, default=2048, help="prefill chunk rows (huge's max_num_batched_tokens)")
    parser.add_argument("--out", default=None, help="write the figures here (JSON)")
    parser.add_argument("--kernel", default=None, help="another copy of the kernel file (default: patches/src's)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    interpret = device == "cpu"
    k4v2 = load_triton_file(Path(args.kernel), "k4v2_probe", interpret=interpret) if args.kernel else load_k4v2(
        interpret=interpret)
    results = []
    for seq_len in map(int, args.contexts.split(",")):
        row = probe(k4v2, seq_len, args.rows, device)
        print(f"prefill ctx {row['context']}, {row['rows']} rows: rel error {row['rel_error']:.2e} "
              f"(max abs {row['max_abs']:.2e}); kernel {row['kernel_ms']:.1f} ms, torch loop "
              f"{row['torch_loop_ms']:.1f} ms", flush=True)
        results.append(row)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter)"
    doc = {"kernel": args.kernel or "patches/src", "device": name, "results": results}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(doc, handle, indent=1)


if __name__ == "__main__":
    main()
