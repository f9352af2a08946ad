"""`qwen38 generate`: models of the real architectures and formats, from nothing, at any size.

One generator for the tiny models and for Qwen3.8-27B's own shapes (docs/prepare.md,
"Generated models"). ``--size`` picks a preset of `prepare.synthetic`:

- ``tiny``: the `cpu` profile's set, as ``qwen38 tiny`` writes it (`prepare.tiny`);
- ``full``: the four artifacts the GPU profiles serve, under their artifact keys -
  ``qwen3.8-27b-w4a16`` (compressed-tensors int4 target), ``qwen3.8-27b-dflash2-w4a16``
  (GPTQ drafter), ``qwen3.8-27b-nvfp4`` (ModelOpt NVFP4/FP8/BF16 target) and
  ``qwen3.8-27b-dflash2`` (bf16 drafter) - plus ``qwen3.8-27b-mode-b-directions`` for the
  Spark adapter, all with config.json like profiles/model-configs/;
- ``small``: the same formats at sizes the CPU engine serves (tests);
- ``tiny-vl`` / ``tiny-hybrid``: the targets the requantize, draft-vocab, embed-int8 and
  planner tests build on.

Streaming and bounded memory: `prepare.synthetic` lays out every shard (header and each
tensor's offset) before a byte is drawn; the file is created at its final size and a pool
of worker processes fills it, each task one block of rows (~32 MB) of one tensor, drawn
from a generator seeded by (seed, tensor name, block), so the bytes do not depend on the
number of workers and nothing bigger than a block is ever in memory. Each directory is
built in a staging directory, hashed into its manifest (identity: generator ``tiny`` - the
``generated = "tiny"`` of a profile slot -, its version, the preset, the model and the
seed) and swapped in whole (`prepare.atomic`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entrypoint.errors import PrepareError
from prepare.atomic import atomic_directory
from prepare.identity import GeneratedIdentity
from prepare.manifest import read_manifest, write_manifest
from prepare.safetensors_stream import encode_header
from prepare.synthetic import (
    INDEX_NAME,
    PRESET_NAMES,
    TINY_PRESET,
    VARIANTS,
    Preset,
    StoredTensor,
    drafter_config,
    iter_blocks,
    plan_shards,
    preset,
    target_config,
    variant_role,
    variant_tensors,
)

BLOCK_BYTES = 32 << 20  # one task's output: rows of one tensor
INLINE_BYTES = 64 << 20  # below this a model is written in this process (no pool start-up)
DIRECTIONS = "qwen3.8-27b-mode-b-directions"  # the spark-lora adapter's input artifact key
DIRECTIONS_FILE = "directions.safetensors"
ADAPTER_STRENGTH = 4.0  # coefficient c of the full-size directions (docs/adapter.md)
METADATA = {"format": "pt"}


def _torch_dtype(dtype: str):
    import torch

    return {
        "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
        "I64": torch.int64, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn,
    }[dtype]


def block_seed(seed: int, name: str, block: int) -> int:
    """The seed of one block's draw (block 0: `prepare.tiny`'s per-tensor rule, so the tiny
    drafters keep their bytes)."""
    key = name if block == 0 else f"{name}#{block}"
    return seed ^ int(hashlib.sha256(key.encode()).hexdigest()[:12], 16)


def _random_words(count: int, seed: int):
    """``count`` uniform 32-bit words (numpy PCG64: ~0.5-1 GB/s a core)."""
    import numpy as np

    return np.random.Generator(np.random.PCG64(seed)).integers(0, 1 << 32, size=count, dtype=np.uint32)


def _int4_words(count: int, seed: int):
    """Packed words of 8 int4 codes in [-7, 7]: a stored nibble n is the code n - 8, and the
    one nibble value outside the symmetric range (0, code -8) is replaced by 8 (code 0),
    with in-place bit operations on the words (a table lookup a byte measured slower)."""
    import numpy as np

    words = _random_words(count, seed)
    spread = np.right_shift(words, np.uint32(1))
    spread |= words
    other = np.right_shift(spread, np.uint32(2))
    spread |= other
    np.invert(spread, out=spread)
    spread &= np.uint32(0x11111111)  # bit 0 of each all-zero nibble
    spread <<= np.uint32(3)
    words |= spread
    return words.view(np.int32)


def draw_block(t: StoredTensor, start: int, end: int, seed: int, block: int) -> bytes:
    """The bytes of rows [start, end) of ``t`` (the whole tensor for a scalar)."""
    import numpy as np
    import torch

    r = t.recipe
    rows = end - start
    rest = t.shape[1:]
    count = rows * (int(np.prod(rest)) if rest else 1) if t.shape else 1
    shape = (rows, *rest) if t.shape else ()
    gen_seed = block_seed(seed, r.seed_name or t.name, block)
    if r.kind == "normal":
        g = torch.Generator().manual_seed(gen_seed)
        values = torch.randn(*shape, generator=g) * r.std
    elif r.kind == "const":
        values = torch.full(shape, r.value, dtype=torch.float64 if t.dtype in ("I32", "I64") else torch.float32)
    elif r.kind == "log_uniform":
        g = torch.Generator().manual_seed(gen_seed)
        values = torch.empty(shape).uniform_(r.low, r.high, generator=g).log()
    elif r.kind in ("int4_ct", "int4_gptq"):
        return _int4_words(count, gen_seed).tobytes()
    elif r.kind == "e2m1":
        return _random_words(-(-count // 4), gen_seed).view(np.uint8)[:count].tobytes()
    elif r.kind == "fp8_normal":
        g = torch.Generator().manual_seed(gen_seed)
        values = (torch.randn(*shape, generator=g) * (r.std / r.scale)).clamp(-448.0, 448.0)
    elif r.kind == "group_index":
        values = torch.arange(start, end, dtype=torch.int64) // r.group
    elif r.kind == "shape_of":
        values = torch.tensor([r.rows, r.cols], dtype=torch.int64)
    elif r.kind == "dflash2_base_kernel":
        values = torch.zeros(shape)
        values[:, 0, :] = 1.0  # tap 0 passes the input through, like a trained identity start
    else:  # pragma: no cover - synthetic.Recipe names every kind
        raise ValueError(f"unknown recipe {r.kind}")
    stored = values.to(_torch_dtype(t.dtype)).contiguous()
    return stored.reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------
# Writing shards: headers first, then blocks in parallel at their offsets


@dataclass(frozen=True)
class BlockTask:
    path: str
    offset: int  # absolute file offset of this block
    tensor: StoredTensor
    start: int
    end: int
    block: int
    seed: int


def _run_task(task: BlockTask) -> int:
    data = draw_block(task.tensor, task.start, task.end, task.seed, task.block)
    fd = os.open(task.path, os.O_WRONLY)
    try:
        view = memoryview(data)
        position = task.offset
        while view:
            done = os.pwrite(fd, view, position)
            view, position = view[done:], position + done
    finally:
        os.close(fd)
    return len(data)


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)  # one block a process: no intra-op threads to oversubscribe


def shard_tasks(directory: Path, shards: dict[str, list[StoredTensor]], seed: int) -> list[BlockTask]:
    """Create every shard at its final size with its header; the block tasks that fill it."""
    from prepare.safetensors_stream import TensorSpec

    tasks: list[BlockTask] = []
    for shard, tensors in shards.items():
        specs = [TensorSpec(t.name, t.dtype, t.shape) for t in tensors]
        header, offsets = encode_header(specs, METADATA)
        path = directory / shard
        with open(path, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + sum(t.nbytes for t in tensors))
        for t in tensors:
            rows = t.shape[0] if t.shape else 1
            row_bytes = t.nbytes // max(rows, 1)
            for block, (start, end) in enumerate(iter_blocks(t, BLOCK_BYTES)):
                tasks.append(BlockTask(str(path), offsets[t.name] + start * row_bytes, t, start, end, block, seed))
    # Biggest first: the pool's tail is short blocks, not one late 32 MB one.
    return sorted(tasks, key=lambda task: -_task_bytes(task))


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def fill(tasks: list[BlockTask], workers: int) -> int:
    """Run the block tasks (in this process when small, else in ``workers`` processes)."""
    if workers <= 1 or sum(_task_bytes(t) for t in tasks) < INLINE_BYTES:
        return sum(_run_task(t) for t in tasks)
    import multiprocessing

    # spawn, not fork: forked children of a process that ran OpenMP threads can deadlock.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init) as pool:
        return sum(pool.map(_run_task, tasks, chunksize=1))


def _task_bytes(task: BlockTask) -> int:
    rows = task.tensor.shape[0] if task.tensor.shape else 1
    return task.tensor.nbytes * (task.end - task.start) // max(rows, 1)


# ---------------------------------------------------------------------------------------
# One model directory


def tokenizer_for(p: Preset, seed: int):
    """The tiny byte-level BPE (`prepare.tiny.build_tokenizer`), its vocabulary filled up to
    the model's with decodable placeholder tokens."""
    from prepare.tiny import build_tokenizer

    return build_tokenizer(seed, vocab=p.tokenizer_vocab, fill_to=p.target.vocab_size, corpus=p.tokenizer_corpus)


def special_ids(tokenizer) -> dict[str, int]:
    """The ids the configs name (eos, pad, the drafter's mask token)."""
    return {
        "eos": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "mask": tokenizer.convert_tokens_to_ids("<|mask|>"),
    }


def write_tokenizer(directory: Path, tokenizer) -> None:
    from prepare.tiny import drop_nondeterministic

    tokenizer.save_pretrained(directory)
    drop_nondeterministic(directory)
    ids = special_ids(tokenizer)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["eos"], "pad_token_id": ids["pad"], "do_sample": False}, indent=2) + "\n"
    )


@dataclass
class Written:
    path: Path
    bytes: int
    files: int
    seconds: float
    shards: int = 0
    skipped: bool = False  # already current: nothing written


def identity(p: Preset, model: str, seed: int) -> GeneratedIdentity:
    from prepare.tiny import GENERATOR, GENERATOR_VERSION

    return GeneratedIdentity(
        generator=GENERATOR, generator_version=str(GENERATOR_VERSION),
        params={"model": model, "preset": p.name, "seed": seed},
    )


def _current(out: Path, p: Preset, model: str, seed: int) -> Written | None:
    """What ``out`` already holds when it is this exact model, whole (sizes checked, not hashes)."""
    from prepare.derived import is_up_to_date

    if not is_up_to_date(out, identity(p, model, seed)):
        return None
    manifest = read_manifest(out)
    return Written(out, manifest.total_size, len(manifest.files), 0.0, skipped=True)


def write_model(out: Path, p: Preset, variant: str, seed: int, workers: int, *, keep_current: bool = False) -> Written:
    """``out``: one generated model (config, tokenizer for a target, shards, index, manifest);
    ``keep_current``: leave it as it is when it already is that model (a resumed run)."""
    began = time.perf_counter()
    if keep_current and (kept := _current(out, p, variant, seed)) is not None:
        return kept
    role, fmt = variant_role(variant)
    tensors = variant_tensors(p, variant)
    plan = plan_shards(p, tensors)
    tokenizer = tokenizer_for(p, seed)
    special = special_ids(tokenizer)
    with atomic_directory(out) as stage:
        if role == "target":  # a drafter reads the target's tokenizer
            write_tokenizer(stage, tokenizer)
        config = target_config(p, fmt, special) if role == "target" else drafter_config(p, fmt, special)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        written = fill(shard_tasks(stage, plan.shards, seed), workers)
        if len(plan.shards) > 1 or p.shard_names is None:
            (stage / INDEX_NAME).write_text(json.dumps(plan.index(), indent=2) + "\n", encoding="utf-8")
        write_manifest(stage, identity(p, variant, seed), jobs=workers)
        files = sum(1 for _ in stage.iterdir())
    return Written(out, written, files, time.perf_counter() - began, len(plan.shards))


def write_directions(out: Path, target: Path, p: Preset, seed: int, *, keep_current: bool = False) -> Written:
    """The spark-lora adapter's directions for ``target`` (unit r per residual-writing module)."""
    from prepare.directions import random_directions

    began = time.perf_counter()
    if keep_current and (kept := _current(out, p, DIRECTIONS, seed)) is not None:
        return kept
    with atomic_directory(out) as stage:
        random_directions(target, stage / DIRECTIONS_FILE, seed, coef_range=(ADAPTER_STRENGTH, ADAPTER_STRENGTH))
        write_manifest(stage, identity(p, DIRECTIONS, seed))
    size = (out / DIRECTIONS_FILE).stat().st_size
    return Written(out, size, 2, time.perf_counter() - began)


@dataclass
class Generated:
    preset: str
    models: dict[str, Written] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        total = sum(w.bytes for w in self.models.values() if not w.skipped)
        return {
            "preset": self.preset,
            "seconds": round(self.seconds, 2),
            "bytes": total,
            "throughput_mb_s": round(total / max(self.seconds, 1e-9) / 1e6, 1),
            "models": {k: {"path": str(w.path), "bytes": w.bytes, "shards": w.shards, "seconds": round(w.seconds, 2),
                           "kept": w.skipped} for k, w in self.models.items()},
        }


def generate(
    out: Path | str,
    size: str,
    *,
    seed: int | None = None,
    only: list[str] | None = None,
    workers: int | None = None,
    layers: int | None = None,
    keep_current: bool = False,
) -> Generated:
    """Write the preset's models (or ``only`` those) under ``out``/<model>; returns what was written.
    ``keep_current``: models already whole under ``out`` are kept (a resumed run writes the rest)."""
    from prepare.tiny import DEFAULT_SEED, build_tiny_models

    out = Path(out)
    seed = DEFAULT_SEED if seed is None else seed
    began = time.perf_counter()
    if size == TINY_PRESET:
        if only or layers:
            raise PrepareError("--size tiny writes the cpu profile's whole set; --only and --layers do not apply")
        paths = build_tiny_models(out, seed=seed)
        result = Generated(TINY_PRESET, {k: Written(v, _tree_bytes(v), 0, 0.0) for k, v in paths.items()})
        result.seconds = time.perf_counter() - began
        return result
    p = preset(size, layers)
    chosen = list(only) if only else list(p.variants) + ([DIRECTIONS] if "qwen3.8-27b-nvfp4" in p.variants else [])
    for name in chosen:
        if name != DIRECTIONS:
            variant_role(name)  # refuse an unknown name before writing anything
    result = Generated(p.name)
    for name in chosen:
        if name == DIRECTIONS:
            target = out / "qwen3.8-27b-nvfp4"
            if not target.is_dir():
                raise PrepareError(f"{target}: missing; the directions are drawn for the nvfp4 target: generate it first")
            result.models[name] = write_directions(out / name, target, p, seed, keep_current=keep_current)
        else:
            result.models[name] = write_model(out / name, p, name, seed, workers or default_workers(),
                                              keep_current=keep_current)
    result.seconds = time.perf_counter() - began
    return result


def generate_model(out: Path | str, size: str, variant: str, *, seed: int | None = None) -> Path:
    """One model of a preset written at ``out`` itself (what a test fixture wants)."""
    from prepare.tiny import DEFAULT_SEED

    p = preset(size)
    write_model(Path(out), p, variant, DEFAULT_SEED if seed is None else seed, default_workers())
    return Path(out)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------
# The int8-embed pair (the embed patch's tests): requantized by the real step


def int8_embed_pair(root: Path | str, seed: int = 0) -> dict[str, Path]:
    """``root/int8-embed`` (the tiny-hybrid target with embed_tokens requantized to int8 by
    `prepare.requantize`) and ``root/dequantized`` (the same model with that table
    dequantized back to bf16, as vLLM computes it): the two answer identically."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from prepare.int8_pack import dequantize_rows
    from prepare.requantize import requantize_checkpoint

    root = Path(root)
    bf16 = generate_model(root / "bf16", "tiny-hybrid", "qwen3.8-27b-bf16", seed=seed)
    quantized = root / "int8-embed"
    requantize_checkpoint(bf16, quantized, ["embed_tokens"], workers=1)
    name = "model.embed_tokens"
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        table = dequantize_rows(f.get_tensor(f"{name}.weight_packed"), f.get_tensor(f"{name}.weight_scale"), 128)
    dequantized = root / "dequantized"
    with atomic_directory(dequantized) as stage:
        for entry in bf16.iterdir():
            if entry.is_file() and entry.name not in ("model.safetensors", "qwen38-manifest.json"):
                shutil.copy2(entry, stage / entry.name)
        with safe_open(str(bf16 / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors[f"{name}.weight"] = table.to(torch.bfloat16)
        save_file(tensors, str(stage / "model.safetensors"), metadata=METADATA)
        write_manifest(stage, identity(preset("tiny-hybrid"), "qwen3.8-27b-int8-embed-dequantized", seed))
    return {"int8": quantized, "dequantized": dequantized}


# ---------------------------------------------------------------------------------------
# CLI


def _cmd_generate(args: argparse.Namespace) -> int:
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    result = generate(args.out, args.size, seed=args.seed, only=only, workers=args.workers, layers=args.layers)
    summary = result.summary()
    for name, model in summary["models"].items():
        print(f"{name}: {model['path']} ({model['bytes'] / 1e9:.3f} GB, {model['seconds']:.1f} s)")
    print(f"generate: {summary['bytes'] / 1e9:.3f} GB in {summary['seconds']:.1f} s "
          f"({summary['throughput_mb_s']:.0f} MB/s)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate models of the real architectures and formats (tiny to full size), with manifests",
        description="Write generated models under --out: --size tiny is `qwen38 tiny`'s set; full writes "
        "Qwen3.8-27B-shaped W4A16 / GPTQ / NVFP4 / bf16 artifacts under their artifact keys (docs/prepare.md).",
    )
    parser.add_argument("--size", required=True, choices=PRESET_NAMES, help="preset (prepare/synthetic.py)")
    parser.add_argument("--out", required=True, help="output directory (each model's subdirectory is replaced)")
    parser.add_argument("--only", default=None, help=f"comma list of {', '.join([*VARIANTS, DIRECTIONS])}")
    parser.add_argument("--seed", type=int, default=None, help="default: the tiny models' seed")
    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: every core)")
    parser.add_argument("--layers", type=int, default=None, help="target layers (a multiple of 4): a slice, to measure")
    parser.add_argument("--json", default=None, help="write the summary (bytes, seconds, throughput) here")
    parser.set_defaults(func=_cmd_generate)
