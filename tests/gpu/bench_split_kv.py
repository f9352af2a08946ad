"""Microbenchmark: split-KV verify attention vs the unsplit walk, FlashAttention 2 and
(when importable) vLLM's Triton unified attention, per attention layer.

Standalone (torch + triton only; the repo supplies the kernel module and the
reference). On the lent GPU:

    python tests/gpu/bench_split_kv.py --out split_kv_bench.json

Qwen3.8-27B's attention (24 query heads, 4 KV heads, head_dim 256), 8 query tokens per
request, contexts 1k-128k, bf16 KV (448-token pages, the `single` profile's) and
int8_per_token_head KV (864-token pages, `long`'s), 1 and 4 requests. Every kernel's
output is first checked against the float32 torch reference (max abs error in the
JSON). Timing: each kernel call is captured in a CUDA graph behind an L2 flush (so a
short context is not served from L2 as it never is between two layers of a real
model) and replayed; the flush alone is timed the same way and subtracted.

Rows:  split      qwen38_split_kv_verify.split_kv_verify_attention (the patch's kernel)
       unsplit    the same program, one split: one program per (request, KV head)
                  walks the whole context (the shape FA2 / unified use for this batch)
       fa2        FlashAttention 2 through torch (aten flash op, GQA, causal aligned to
                  the end) on contiguous bf16 K/V: no paging, bf16 only
       vllm       vllm.v1.attention.ops.triton_unified_attention.unified_attention on
                  the same paged cache (only if vllm imports)

`--interpret` runs the whole script on CPU under Triton's interpreter at toy sizes
(wall-clock timings, meaningless) to prove it end to end before GPU time is spent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--contexts", default="1024,4096,16384,25600,65536,131072",
                        help="cached tokens per request (comma list)")
    parser.add_argument("--query-tokens", type=int, default=8, help="verify block size (1 + drafted)")
    parser.add_argument("--batches", default="1,4", help="requests per batch (comma list)")
    parser.add_argument("--kv", default="bf16,int8", help="KV dtypes: bf16,int8")
    parser.add_argument("--heads", default="24,4,256", help="query heads, KV heads, head_dim")
    parser.add_argument("--block-size", type=int, default=0,
                        help="tokens per page (default: 448 for bf16, 864 for int8, the planner's pages)")
    parser.add_argument("--graph-calls", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=5, help="timed graph replays (median taken)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    parser.add_argument("--check-full", action="store_true",
                        help="also run tests/gpu/test_split_kv_gpu.py's checks (full-size cases vs the reference, "
                             "CUDA-graph replay) without pytest")
    parser.add_argument("--interpret", action="store_true",
                        help="CPU + Triton interpreter at toy sizes: checks the script, not the speed")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- Timing -----------------------------------------------------------------------------


class Timer:
    """Per-call time of `fn` in microseconds, L2 flushed before every call."""

    def __init__(self, torch, device, graph_calls: int, replays: int) -> None:
        self.torch = torch
        self.device = device
        self.graph_calls = graph_calls
        self.replays = replays
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
            self.flush_buffer = torch.empty(max(4 * l2, 256 * 2**20) // 4, dtype=torch.int32, device=device)
            self.flush_us = self._graph_time(lambda: None)

    def _flush(self) -> None:
        self.flush_buffer.fill_(0)

    def _graph_time(self, fn) -> float:
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (compiles) outside the capture
                self._flush()
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.graph_calls):
                self._flush()
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / self.graph_calls)
        return sorted(times)[len(times) // 2]

    def __call__(self, fn) -> float:
        if not self.cuda:
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        return max(self._graph_time(fn) - self.flush_us, 0.0)


# ---- Kernels under test -------------------------------------------------------------------


def fa2_runner(torch, batch, batch_size: int, q_len: int):
    """FlashAttention 2 on contiguous copies of the paged K/V (bf16): returns (fn, out,
    how) or None. Tried in order: aten's flash op (FA2 takes GQA natively; with
    is_causal and fewer queries than keys its mask is aligned to the end, torch's
    lower-right variant); SDPA restricted to the flash backend with the lower-right
    causal bias; the flash op on K/V heads repeated to the query heads (no native GQA:
    6x the K/V traffic, labelled so). The reference check catches a wrong mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.split_kv_support import gather_kv

    num_q_heads, head_dim = batch.q.shape[1], batch.q.shape[2]
    q = batch.q.view(batch_size, q_len, num_q_heads, head_dim).transpose(1, 2).contiguous()
    kv = [gather_kv(batch, s) for s in range(batch_size)]
    k = torch.stack([x[0] for x in kv]).transpose(1, 2).to(batch.q.dtype).contiguous()
    v = torch.stack([x[1] for x in kv]).transpose(1, 2).to(batch.q.dtype).contiguous()
    del kv
    scale = batch.softmax_scale
    group = num_q_heads // k.shape[1]

    def flash_op():
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]

    def sdpa_flash_lower_right():
        from torch.nn.attention.bias import causal_lower_right

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(q_len, k.shape[2]), scale=scale, enable_gqa=True)

    k_rep = v_rep = None

    def flash_op_repeated_heads():
        nonlocal k_rep, v_rep
        if k_rep is None:
            k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k_rep, v_rep, 0.0, True, False, scale=scale)[0]

    attempts = (
        ("aten flash op, native GQA", flash_op),
        ("sdpa flash backend, lower-right causal, GQA", sdpa_flash_lower_right),
        ("aten flash op, K/V heads repeated (no native GQA)", flash_op_repeated_heads),
    )
    last_error = None
    for how, fn in attempts:
        try:
            result = fn()
        except (RuntimeError, TypeError, NotImplementedError) as error:  # the op or backend is absent here
            last_error = error
            continue
        out = result.transpose(1, 2).reshape(batch_size * q_len, num_q_heads, head_dim)
        return fn, out, how
    print(f"  fa2 unavailable: {last_error}", file=sys.stderr)
    return None


def vllm_runner(batch, interpret: bool):
    """vLLM's unified attention with the arguments TritonAttentionImpl.forward passes,
    or (None, why) when vllm does not import."""
    if interpret:
        return None, "skipped under the interpreter"
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode
    except Exception as error:  # noqa: BLE001 - any import failure means "not staged"
        return None, f"{type(error).__name__}: {error}"
    import torch

    out = torch.empty_like(batch.q)
    int8 = batch.k_scale_cache is not None
    num_seqs = batch.seqused_k.shape[0]
    if int8:
        k_descale = v_descale = None
    else:
        one = torch.ones((), dtype=torch.float32, device=batch.q.device)
        k_descale = v_descale = one.expand(num_seqs, batch.key_cache.shape[2])

    def fn():
        unified_attention(
            q=batch.q, k=batch.key_cache, v=batch.value_cache, out=out, cu_seqlens_q=batch.cu_seqlens_q,
            max_seqlen_q=batch.max_seqlen_q, seqused_k=batch.seqused_k, max_seqlen_k=max(batch.seq_lens),
            softmax_scale=batch.softmax_scale, causal=True, window_size=(-1, -1), block_table=batch.block_table,
            softcap=0, q_descale=None, k_descale=k_descale, v_descale=v_descale,
            kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD if int8 else KVQuantMode.NONE,
            k_scale_cache=batch.k_scale_cache, v_scale_cache=batch.v_scale_cache,
        )

    return (fn, out), None


# ---- The run ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    from tests.split_kv_support import compare, load_kernel_module, make_batch, reference_attention

    kernel = load_kernel_module(interpret=args.interpret)
    if args.interpret:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run on the lent GPU, or pass --interpret to check the script on CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    num_q_heads, num_kv_heads, head_dim = ints(args.heads)
    q_len = args.query_tokens
    contexts, batches = ints(args.contexts), ints(args.batches)
    kv_kinds = [k.strip() for k in args.kv.split(",") if k.strip()]
    timer = Timer(torch, device, args.graph_calls, args.replays)
    config = kernel.SplitKVConfig()
    if args.interpret:
        config = kernel.SplitKVConfig(tile_n=16, min_split_tokens=16)
    max_splits = 8 if args.interpret else kernel.DEFAULT_MAX_SPLITS

    report: dict = {
        "script": "tests/gpu/bench_split_kv.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu (Triton interpreter) {platform.machine()}"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "heads": [num_q_heads, num_kv_heads, head_dim],
        "query_tokens": q_len,
        "split_config": config.__dict__ | {"max_splits": max_splits},
        "flush_us": getattr(timer, "flush_us", None),
        "rows": [],
        "sweep": [],
    }
    started = time.monotonic()
    vllm_note = None
    for kv in kv_kinds:
        kv_int8 = kv == "int8"
        block_size = args.block_size or (16 if args.interpret else (864 if kv_int8 else 448))
        for batch_size in batches:
            workspace = kernel.SplitKVWorkspace(batch_size, q_len, num_q_heads, head_dim, max_splits=max_splits,
                                                device=device)
            for context in contexts:
                batch = make_batch([q_len] * batch_size, [context] * batch_size, num_q_heads=num_q_heads,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                                   kv_int8=kv_int8, device=device, seed=context)
                ref = reference_attention(batch)
                runs = {}
                out_split = torch.empty_like(batch.q)
                runs["split"] = (lambda: kernel.split_kv_verify_attention(
                    batch.q, batch.key_cache, batch.value_cache, out_split, workspace=workspace, config=config,
                    **batch.kernel_args), out_split, None)
                out_unsplit = torch.empty_like(batch.q)
                runs["unsplit"] = (lambda: kernel.unsplit_verify_attention(
                    batch.q, batch.key_cache, batch.value_cache, out_unsplit, config=config, **batch.kernel_args),
                    out_unsplit, None)
                if not kv_int8:
                    fa2 = fa2_runner(torch, batch, batch_size, q_len)
                    if fa2 is not None:
                        runs["fa2"] = fa2
                vllm, note = vllm_runner(batch, args.interpret)
                if vllm is not None:
                    runs["vllm"] = (*vllm, None)
                else:
                    vllm_note = note
                splits, per_split = kernel.split_plan(context + q_len, max_splits, config.min_split_tokens,
                                                      config.tile_n)
                line = [f"{kv:>4} b{batch_size} ctx {context:>6}:"]
                for name, (fn, out, how) in runs.items():
                    try:
                        result = fn()
                    except Exception as error:  # noqa: BLE001 - a baseline that cannot run here
                        if name in ("split", "unsplit"):
                            raise
                        report.setdefault("errors", []).append(f"{name} {kv} b{batch_size} ctx {context}: {error}")
                        line.append(f"{name} failed ({type(error).__name__})")
                        continue
                    if name == "fa2":
                        out = result.transpose(1, 2).reshape(batch.q.shape)
                    err, ok = compare(out, ref, batch.q.dtype)
                    us = timer(fn)
                    report["rows"].append({
                        "kv": kv, "batch": batch_size, "context": context, "block_size": block_size,
                        "kernel": name, "us": round(us, 2), "max_abs_err": err, "within_tolerance": ok,
                        "splits": splits if name == "split" else 1, "tokens_per_split": per_split,
                        **({"how": how} if how else {}),
                    })
                    line.append(f"{name} {us:9.1f} us (err {err:.1e}{'' if ok else ' FAIL'})")
                print("  ".join(line), flush=True)
                batch = ref = runs = None  # free the GPU memory before the next context
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    report["vllm"] = "imported" if vllm_note is None else f"not importable ({vllm_note})"
    if args.check_full and device.type == "cuda":
        full_checks(report, kernel)
    if not args.no_sweep:
        sweep(report, kernel, torch, device, timer, args, num_q_heads, num_kv_heads, head_dim, q_len)
    report["seconds"] = round(time.monotonic() - started, 1)
    print_table(report)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    checked = report["rows"] + report["sweep"] + report.get("full_checks", [])
    failures = [r for r in checked if not r["within_tolerance"]]
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def sweep(report, kernel, torch, device, timer, args, num_q_heads, num_kv_heads, head_dim, q_len) -> None:
    """A few launch shapes of the split kernel at 25k and 128k, one request: which
    default to keep (docs/split-kv.md)."""
    from tests.split_kv_support import compare, make_batch, reference_attention

    if args.interpret:
        shapes = [dict(tile_n=16, num_warps=4, num_stages=1, max_splits=4, min_split_tokens=16)]
        contexts = [ints(args.contexts)[-1]]
    else:
        # Offline ptxas (sm_90, head_dim 256): 8 warps hold the 64 x 256 accumulator
        # with no spills at tile 16, ~40 B at tile 32, ~300-660 B at tile 64; 4 warps spill.
        shapes = [
            dict(tile_n=16, num_warps=8, num_stages=2, max_splits=32),
            dict(tile_n=16, num_warps=8, num_stages=3, max_splits=32),
            dict(tile_n=32, num_warps=8, num_stages=2, max_splits=32),
            dict(tile_n=32, num_warps=8, num_stages=3, max_splits=32),
            dict(tile_n=64, num_warps=8, num_stages=2, max_splits=32),
            dict(tile_n=32, num_warps=8, num_stages=2, max_splits=64),
        ]
        contexts = [25600, 131072]
    for kv in [k.strip() for k in args.kv.split(",") if k.strip()]:
        kv_int8 = kv == "int8"
        block_size = args.block_size or (16 if args.interpret else (864 if kv_int8 else 448))
        for context in contexts:
            batch = make_batch([q_len], [context], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, block_size=block_size, kv_int8=kv_int8, device=device, seed=1)
            ref = reference_attention(batch)
            for shape in shapes:
                shape = dict(shape)
                max_splits = shape.pop("max_splits")
                config = kernel.SplitKVConfig(**shape)
                workspace = kernel.SplitKVWorkspace(1, q_len, num_q_heads, head_dim, max_splits=max_splits,
                                                    device=device)
                out = torch.empty_like(batch.q)

                def fn():
                    kernel.split_kv_verify_attention(batch.q, batch.key_cache, batch.value_cache, out,
                                                     workspace=workspace, config=config, **batch.kernel_args)

                try:
                    fn()
                except Exception as error:  # noqa: BLE001 - e.g. out of shared memory for this shape
                    report["sweep"].append({"kv": kv, "context": context, **shape, "max_splits": max_splits,
                                            "error": f"{type(error).__name__}: {str(error)[:200]}",
                                            "within_tolerance": True})
                    continue
                err, ok = compare(out, ref, batch.q.dtype)
                us = timer(fn)
                report["sweep"].append({"kv": kv, "context": context, **shape, "max_splits": max_splits,
                                        "us": round(us, 2), "max_abs_err": err, "within_tolerance": ok})
                print(f"  sweep {kv} ctx {context} {shape} splits<={max_splits}: {us:.1f} us", flush=True)
            batch = ref = None


def full_checks(report, kernel) -> None:
    """The GPU test file's checks, for a machine without pytest."""
    import torch

    from tests.split_kv_support import compare, full_cases, graph_replay_check, run_case

    checks = report.setdefault("full_checks", [])
    for case in full_cases():
        variants = [False, True] if case.name == "qwen38-q8" else [False]
        for unsplit in variants:
            out, ref, _ = run_case(kernel, case, "cuda", unsplit=unsplit)
            err, ok = compare(out, ref, case.dtype)
            name = "unsplit" if unsplit else "split"
            checks.append({"case": case.id, "kernel": name, "max_abs_err": err, "within_tolerance": ok})
            print(f"  check {case.id} {name}: max abs error {err:.3e}{'' if ok else ' FAIL'}", flush=True)
            del out, ref
            torch.cuda.empty_cache()
    for kv_int8 in (False, True):
        for label, err, ok in graph_replay_check(kernel, kv_int8):
            kv = "int8" if kv_int8 else "bf16"
            checks.append({"case": f"graph {kv}: {label}", "kernel": "split", "max_abs_err": err,
                           "within_tolerance": ok})
            print(f"  check graph {kv} {label}: max abs error {err:.3e}{'' if ok else ' FAIL'}", flush=True)


def print_table(report: dict) -> None:
    rows = report["rows"]
    names = [n for n in ("split", "unsplit", "fa2", "vllm") if any(r["kernel"] == n for r in rows)]
    print(f"\nus per attention layer, {report['device']}, heads {report['heads']}, "
          f"{report['query_tokens']} query tokens per request")
    header = f"{'kv':>5} {'reqs':>4} {'context':>8} " + " ".join(f"{n:>10}" for n in names)
    header += "   unsplit/split"
    header += ("   fa2/split" if "fa2" in names else "") + ("   vllm/split" if "vllm" in names else "")
    print(header)
    keys = sorted({(r["kv"], r["batch"], r["context"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        got = {r["kernel"]: r["us"] for r in rows if (r["kv"], r["batch"], r["context"]) == key}
        cells = " ".join(f"{got[n]:>10.1f}" if n in got else f"{'-':>10}" for n in names)
        split = got.get("split") or math.nan
        ratios = f"   {got.get('unsplit', math.nan) / split:13.2f}"
        if "fa2" in names:
            ratios += f"   {got['fa2'] / split:9.2f}" if "fa2" in got else f"   {'-':>9}"
        if "vllm" in names:
            ratios += f"   {got['vllm'] / split:10.2f}" if "vllm" in got else f"   {'-':>10}"
        print(f"{key[0]:>5} {key[1]:>4} {key[2]:>8} {cells}{ratios}")


if __name__ == "__main__":
    sys.exit(main())
