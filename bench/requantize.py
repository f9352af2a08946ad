"""`qwen38 bench requantize`: int8 requantization of a full-size table, against plain I/O.

Builds a checkpoint holding one 248,320 x 5,120 bf16 table (2.54 GB, the size of
Qwen3.8-27B's lm_head and embed_tokens) with a manifest (as a verified download has), then
runs two child processes on it, each with the table evicted from the page cache first:

1. baseline - a plain safetensors read + write of the same bytes: ``safe_open`` /
   ``get_tensor`` then ``save_file`` and fsync;
2. requantize - the real step, ``requantize_checkpoint(src, dst, ["lm_head"])``: stream,
   quantize, pack, write, fsync, check the source shard's sha256 against the input's
   manifest (a thread of its own, alongside), and hash the output into its manifest.

Each child's wall time (after its imports) and peak RSS (``ru_maxrss`` from ``wait4``)
are reported, with throughput = table bytes / wall time. Targets on the 2-core dev
machine: requantize peak RSS < 1.5 x the bf16 table, and its throughput >= 50 % of the
baseline's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from core.errors import BenchError
from core.identity import GeneratedIdentity
from core.manifest import write_manifest
from core.safetensors_stream import TensorSpec
from prepare.checkpoint_writer import CheckpointWriter

ROWS, COLS = 248_320, 5_120
TENSOR = "lm_head.weight"


def _evict(path: Path) -> None:
    """Drop a file's pages from the page cache so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def build_input(directory: Path, rows: int, cols: int) -> Path:
    """A checkpoint directory with one random bf16 table, written a block at a time."""
    import torch

    directory.mkdir(parents=True)
    checkpoint = CheckpointWriter(directory)
    writer = checkpoint.open_shard("model.safetensors", [TensorSpec(TENSOR, "BF16", (rows, cols))])
    generator = torch.Generator().manual_seed(0)
    block = max(1, (32 << 20) // (cols * 2))
    for start in range(0, rows, block):
        count = min(block, rows - start)
        values = (torch.randn(count, cols, generator=generator) * 0.02).to(torch.bfloat16)
        writer.write(TENSOR, values.view(torch.uint8).numpy())
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "tie_word_embeddings": False,
        "vocab_size": rows,
        "hidden_size": cols,
    }
    checkpoint.finish(config=config, index=False)
    write_manifest(
        directory,
        GeneratedIdentity(generator="bench-requantize", generator_version="1", params={"rows": rows, "cols": cols}),
    )
    return directory


# ----------------------------------------------------------------------------- children


def _child_baseline(src: Path, dst: Path) -> dict:
    import torch  # noqa: F401  (imported before the clock starts, like the other child)
    from safetensors import safe_open
    from safetensors.torch import save_file

    began = time.perf_counter()
    with safe_open(str(src / "model.safetensors"), "pt") as handle:
        table = handle.get_tensor(TENSOR)
    dst.mkdir(parents=True)
    save_file({TENSOR: table}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    fd = os.open(dst / "model.safetensors", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return {"seconds": time.perf_counter() - began}


def _child_requantize(src: Path, dst: Path, workers: int | None) -> dict:
    import torch  # noqa: F401

    from prepare.requantize import requantize_checkpoint  # torch: in the child that measures, not in `qwen38 bench`

    began = time.perf_counter()
    result = requantize_checkpoint(src, dst, ["lm_head"], workers=workers)
    seconds = time.perf_counter() - began
    report = result.tensors[0]
    return {"seconds": seconds, "quantize_seconds": report.seconds, "relative_error": report.relative_error}


def _child_main(argv: list[str]) -> None:
    mode, src, dst, workers = argv
    if mode == "baseline":
        out = _child_baseline(Path(src), Path(dst))
    else:
        out = _child_requantize(Path(src), Path(dst), int(workers) or None)
    print(json.dumps(out))


def _run_child(mode: str, src: Path, dst: Path, workers: int | None) -> dict:
    code = "import sys; from bench.requantize import _child_main; _child_main(sys.argv[1:])"
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, mode, str(src), str(dst), str(workers or 0)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    began = time.perf_counter()
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise BenchError(
            f"{mode} child exited {proc.returncode}: {stderr.decode(errors='replace').strip().splitlines()[-1:]}"
        )
    out = json.loads(stdout.decode().strip().splitlines()[-1])
    out["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux reports KiB
    out["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    out["process_seconds"] = wall
    return out


# ----------------------------------------------------------------------------- bench


def run_bench(workdir: Path, rows: int = ROWS, cols: int = COLS, workers: int | None = None) -> dict:
    table_bytes = rows * cols * 2
    free = shutil.disk_usage(workdir).free
    if free < 3 * table_bytes:
        raise BenchError(
            f"{workdir}: {free / 1e9:.1f} GB free, the benchmark needs {3 * table_bytes / 1e9:.1f} GB; pass --dir"
        )
    src = build_input(workdir / "input", rows, cols)
    figures: dict = {
        "rows": rows,
        "cols": cols,
        "table_bytes": table_bytes,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg()[0],  # other work on the machine skews both runs
    }
    for mode in ("baseline", "requantize"):
        _evict(src / "model.safetensors")
        out_dir = workdir / mode
        figures[mode] = _run_child(mode, src, out_dir, workers)
        figures[mode]["throughput_bytes_per_s"] = table_bytes / figures[mode]["seconds"]
        shutil.rmtree(out_dir)
    base, quant = figures["baseline"], figures["requantize"]
    figures["throughput_ratio"] = quant["throughput_bytes_per_s"] / base["throughput_bytes_per_s"]
    figures["rss_ratio"] = quant["peak_rss_bytes"] / table_bytes
    figures["targets_met"] = figures["throughput_ratio"] >= 0.5 and figures["rss_ratio"] < 1.5
    return figures

