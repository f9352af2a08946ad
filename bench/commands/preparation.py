"""`qwen38 bench verify|requantize|adapter`: the micro-benchmarks of the preparation steps.

Each runs the real step on synthetic files of the real sizes (`bench.verify`: start-up
verification cold, warm and after prepare; `bench.requantize`: the int8 requantization of a
full-size table against plain I/O; `bench.adapter`: `qwen38 adapter build` at full size) and
prints its figures against the step's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import adapter, requantize, verify
from core.errors import BenchError


def _cmd_verify(args: argparse.Namespace) -> int:
    from core.hashing import available_cores  # deferred: `qwen38 bench --help` needs none of it

    jobs = args.jobs or available_cores()
    parent = Path(args.dir) if args.dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="qwen38-bench-verify-", dir=parent))
    cold_bytes = int(args.cold_gb * 1e9)
    free = shutil.disk_usage(root).free
    if not args.skip_cold and free < cold_bytes * 1.2:
        shutil.rmtree(root)
        raise BenchError(f"{root}: the cold bench writes {args.cold_gb} GB, only {free / 1e9:.1f} GB free")
    if not args.skip_first and free < args.first_gb * 1e9 * 2.1:
        shutil.rmtree(root)
        raise BenchError(
            f"{root}: the first-verify bench needs {args.first_gb * 2:.0f} GB (the files and their prepared copy), "
            f"only {free / 1e9:.1f} GB free; lower --first-gb or pass --skip-first"
        )
    results: dict = {"machine": verify.describe_machine(), "jobs": jobs}
    print(f"machine: {results['machine']}; verify threads: {jobs}", flush=True)
    try:
        if not args.skip_cold:
            results["cold"] = verify.bench_cold(root, cold_bytes, args.cold_files, jobs, args.drop, args.repeat)
        if not args.skip_warm:
            results["warm"] = verify.bench_warm(root, int(args.warm_gb * 1e9), args.warm_files, jobs)
        if not args.skip_first:
            results["first"] = verify.bench_first(root, int(args.first_gb * 1e9), args.first_files, jobs, args.drop)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


def _print_requantize(figures: dict) -> None:
    gb = 1e9
    print(
        f"table: {figures['rows']:,} x {figures['cols']:,} bf16 = {figures['table_bytes'] / gb:.2f} GB; "
        f"{figures['cpus']} CPUs, load average {figures['load_average']:.1f}"
    )
    for mode in ("baseline", "requantize"):
        f = figures[mode]
        print(
            f"{mode:>10}: {f['seconds']:6.1f} s  {f['throughput_bytes_per_s'] / gb:5.2f} GB/s  "
            f"peak RSS {f['peak_rss_bytes'] / gb:5.2f} GB  CPU {f['cpu_seconds']:5.1f} s"
            + (
                f"  (quantize loop {f['quantize_seconds']:.1f} s, relative error {f['relative_error']:.3%})"
                if mode == "requantize"
                else ""
            )
        )
    print(
        f"requantize/baseline throughput {figures['throughput_ratio']:.0%} (target >= 50 %), "
        f"peak RSS {figures['rss_ratio']:.2f} x table (target < 1.5): "
        + ("targets met" if figures["targets_met"] else "TARGETS MISSED")
    )


def _cmd_requantize(args: argparse.Namespace) -> int:
    base = Path(args.dir) if args.dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="qwen38-bench-requantize-", dir=base))
    try:
        figures = requantize.run_bench(workdir, args.rows, args.cols, args.workers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(figures, indent=2) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        _print_requantize(figures)
    return 0 if figures["targets_met"] else 1


def _cmd_adapter(args: argparse.Namespace) -> int:
    from prepare.adapter import DEFAULT_ROW_CHUNK  # deferred: `qwen38 bench --help` needs none of it

    gib = adapter.GIB
    work = Path(tempfile.mkdtemp(prefix="qwen38-bench-adapter-", dir=args.work_dir))
    try:
        t0 = time.perf_counter()
        sizes = adapter.generate_in_child(work, args.layers)
        prep = time.perf_counter() - t0
        row_chunk = args.row_chunk or DEFAULT_ROW_CHUNK
        parent_rss = adapter.own_rss()
        seconds, peak, stdout = adapter.run_build_child(
            work / "model", work / "directions" / adapter.DIRECTIONS_FILE, work / "adapter", row_chunk
        )
        adapter_size = (work / "adapter" / "adapter_model.safetensors").stat().st_size
        bound = 2 * sizes["largest"] + gib
        print(f"synthetic checkpoint: {args.layers} layers, {2 * args.layers} modules, "
              f"{sizes['bytes'] / gib:.2f} GiB stored, largest tensor {sizes['largest'] / (1 << 20):.1f} MiB "
              f"(written in {prep:.1f} s)")  # fmt: skip
        print(stdout.strip())
        print(f"convert: {seconds:.1f} s wall ({sizes['bytes'] / gib / seconds:.2f} GiB/s of stored weights), "
              f"row chunk {row_chunk}")  # fmt: skip
        print(f"peak RSS of the converting process: {peak / (1 << 20):.0f} MiB; "
              f"bound 2 x largest tensor + 1 GiB = {bound / (1 << 20):.0f} MiB "
              f"(this bench process: {parent_rss / (1 << 20):.0f} MiB, a floor for the figure)")  # fmt: skip
        print(f"adapter: {adapter_size / (1 << 20):.2f} MiB")
        if peak >= bound:
            raise BenchError(f"peak RSS {peak / (1 << 20):.0f} MiB is over the bound {bound / (1 << 20):.0f} MiB")
        print("within bound: yes")
        if args.keep:
            print(f"kept: {work}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def register_verify(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="start-up verification throughput (cold, vs cat/sha256sum), warm restart time, first start after prepare",
        description=verify.__doc__.split("\n\n")[0] if verify.__doc__ else None,
    )
    parser.add_argument("--dir", help="where to create the synthetic files (default: the temp dir)")
    parser.add_argument("--cold-gb", type=float, default=4.0, help="total size of the cold files (GB)")
    parser.add_argument("--cold-files", type=int, default=8)
    parser.add_argument("--warm-gb", type=float, default=25.0, help="total size of the sparse warm directory (GB)")
    parser.add_argument("--warm-files", type=int, default=15)
    parser.add_argument("--jobs", type=int, default=None, help="verify threads (default: the usable cores)")
    parser.add_argument("--drop", choices=["fadvise", "global"], default="fadvise", help="how to evict the page cache")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved cat/verify cold runs (median)")
    parser.add_argument(
        "--first-gb", type=float, default=20.0,
        help="total size of the files prepared, then verified by a first start (GB; needs twice that free)",
    )
    parser.add_argument("--first-files", type=int, default=8)
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-warm", action="store_true")
    parser.add_argument("--skip-first", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--out", help="write the figures as JSON to this file")
    parser.set_defaults(func=_cmd_verify)


def register_requantize(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "requantize", help="int8 requantization of a full-size table vs plain safetensors I/O"
    )
    parser.add_argument("--rows", type=int, default=requantize.ROWS, help="table rows (default: %(default)s)")
    parser.add_argument("--cols", type=int, default=requantize.COLS, help="table columns (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None, help="quantization threads (default: the step's own)")
    parser.add_argument("--dir", default=None, help="scratch directory (needs ~3x the table on disk)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.set_defaults(func=_cmd_requantize)


def register_adapter(subparsers: argparse._SubParsersAction) -> None:
    layers = adapter.LAYERS
    parser = subparsers.add_parser(
        "adapter", help="time and peak RSS of the adapter converter on full-size synthetic modules"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="where to write the synthetic files (default: a temp dir)"
    )
    parser.add_argument("--layers", type=int, default=layers, help=f"decoder layers (default {layers}: 128 modules)")
    parser.add_argument("--row-chunk", type=int, default=None, help="passed to `adapter build` (default: its own)")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and adapter")
    parser.set_defaults(func=_cmd_adapter)
