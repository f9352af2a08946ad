"""`qwen38 prepare requantize`: int8 embed_tokens / lm_head (/ MTP) for the RTX 3090 profiles.

Qwen3.8-27B's embedding tables are untied: embed_tokens and lm_head are 248,320 x 5,120
bf16 tables of 2.54 GB each, kept in bf16 by the public W4A16 checkpoint. Storing them as
int8 (symmetric, one scale per 128 input columns) frees ~2.6 GB of a 24 GB card.

The output is a new directory in compressed-tensors' pack-quantized layout, which vLLM's
compressed-tensors loader reads (REFERENCE.md section 5, docs/prepare.md):

- ``<module>.weight_packed`` int32 [rows, cols / 4] (4 int8 codes per word along dim 1),
  ``<module>.weight_scale`` [rows, cols / 128] (fp16 for lm_head, bf16 otherwise) and
  ``<module>.weight_shape`` int64 [2] replace ``<module>.weight``;
- ``config.json``'s ``quantization_config`` gains one config group per target (8-bit
  int, symmetric, group 128, format pack-quantized), placed first so it takes precedence,
  and no ``ignore`` entry names a requantized module any more;
- untouched shards and files are hard-linked (or reflinked, else copied) from the input,
  changed shards are written fresh, streamed a row block at a time; the input is only
  read, and each shard it rewrites is hashed (alongside the work) and must match the
  input's manifest, so altered input bytes never enter the output unnoticed.

The work is one pure plan (`plan_requantize`) and its execution (`requantize_checkpoint`);
the directory is built atomically with its own manifest (`prepare.derived`), whose
identity is a `DerivedIdentity` (transform ``requantize-int8``, `TRANSFORM_VERSION`, the
plan's parameters, and the input model, plus the draft vocabulary when one is carried).
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, open_checkpoint
from core.errors import PrepareError
from core.hashing import sha256_file
from core.identity import DerivedIdentity
from core.manifest import MANIFEST_NAME, ManifestFile, is_current
from core.progress import Progress
from core.safetensors_stream import DTYPE_SIZES, SafetensorsFile, ShardWriter, TensorSpec
from prepare.derived import InputDirectory, build_lock, derived_directory, open_input, refuse_overlap
from prepare.draft_vocab import draft_vocab_files
from prepare.int8_pack import GroupQuantizer, rows_per_block

TRANSFORM = "requantize-int8"
TRANSFORM_VERSION = "1"  # bump whenever the output bytes would change for the same input and params
GROUP_SIZE = 128
NUM_BITS = 8
PACKED_FORMAT = "pack-quantized"
DEFAULT_TARGETS: tuple[str, ...] = ("lm_head", "embed_tokens")
SOURCE_DTYPES = ("BF16", "F16", "F32")
MEASURE_EVERY = 8


@dataclass(frozen=True)
class Target:
    """A family of weights that ``--only`` can name."""

    key: str
    pattern: re.Pattern[str]  # over checkpoint tensor names
    scale_dtype: str  # safetensors dtype of weight_scale
    group_name: str  # the config group added to quantization_config
    config_target: str | None  # a regex target, or None to list the module names

    def selects(self, name: str) -> bool:
        return bool(self.pattern.search(name))


TARGETS: dict[str, Target] = {
    t.key: t
    for t in (
        Target("lm_head", re.compile(r"(?:^|\.)lm_head\.weight$"), "F16", "int8_lm_head", "re:.*lm_head$"),
        Target(
            "embed_tokens",
            re.compile(r"(?:^|\.)embed_tokens\.weight$"),
            "BF16",
            "int8_embed_tokens",
            "re:.*embed_tokens$",
        ),
        # The MTP module's linear layers (fc, attention and MLP projections); its norms are
        # 1-D and skipped. vLLM names them exactly as the checkpoint does (mtp.layers.0...).
        Target(
            "mtp", re.compile(r"^mtp\.(?!.*(?:embed_tokens|lm_head)\.weight$).+\.weight$"), "BF16", "int8_mtp", None
        ),
    )
}


def weight_args(group_size: int) -> dict[str, Any]:
    """The ``weights`` entry of a config group (compressed-tensors QuantizationArgs fields)."""
    return {
        "num_bits": NUM_BITS,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
    }


@dataclass(frozen=True)
class QuantizedTensor:
    """One ``<module>.weight`` and the three tensors that replace it."""

    module: str
    target: str
    shard: str
    dtype: str
    rows: int
    cols: int
    scale_dtype: str
    group_size: int

    @property
    def source_name(self) -> str:
        return f"{self.module}.weight"

    @property
    def packed(self) -> TensorSpec:
        return TensorSpec(f"{self.module}.weight_packed", "I32", (self.rows, self.cols // 4))

    @property
    def scale(self) -> TensorSpec:
        return TensorSpec(f"{self.module}.weight_scale", self.scale_dtype, (self.rows, self.cols // self.group_size))

    @property
    def shape(self) -> TensorSpec:
        return TensorSpec(f"{self.module}.weight_shape", "I64", (2,))

    def outputs(self) -> list[TensorSpec]:
        return [self.packed, self.scale, self.shape]


@dataclass(frozen=True)
class RequantizePlan:
    targets: tuple[str, ...]
    group_size: int
    tensors: tuple[QuantizedTensor, ...]
    shard_specs: dict[str, list[TensorSpec]]  # changed shard -> all tensors it will hold
    config: dict[str, Any]
    index: dict[str, Any] | None

    def params(self) -> dict[str, Any]:
        """What shapes the output besides the input: the identity's ``params``."""
        return {
            "targets": list(self.targets),
            "group_size": self.group_size,
            "num_bits": NUM_BITS,
            "scale_dtypes": {key: TARGETS[key].scale_dtype for key in self.targets},
        }


def parse_targets(text: str | Sequence[str]) -> tuple[str, ...]:
    items = text.split(",") if isinstance(text, str) else list(text)
    chosen = {item.strip() for item in items if item.strip()}
    unknown = sorted(chosen - set(TARGETS))
    if unknown or not chosen:
        raise PrepareError(
            f"--only {','.join(items) if items else ''!s}: expected a comma list of {', '.join(TARGETS)}; "
            f"found {', '.join(unknown) or 'nothing'}"
        )
    return tuple(key for key in TARGETS if key in chosen)  # canonical order


def fix_ignore(ignore: Sequence[str], quantized: set[str], modules: set[str]) -> list[str]:
    """The ``ignore`` list with no entry matching a requantized module (vLLM: re.match)."""
    fixed: list[str] = []
    for entry in ignore:
        if entry.startswith("re:"):
            pattern = re.compile(entry[3:])
            if not any(pattern.match(m) for m in quantized):
                fixed.append(entry)
                continue
            # Keep ignoring everything else it matched, by name.
            fixed.extend(sorted(m for m in modules - quantized if pattern.match(m)))
        elif entry not in quantized:
            fixed.append(entry)
    return list(dict.fromkeys(fixed))


def requantized_quantization_config(
    existing: dict[str, Any] | None, tensors: Sequence[QuantizedTensor], modules: set[str], group_size: int, where: Path
) -> dict[str, Any]:
    if existing is None:
        config: dict[str, Any] = {
            "config_groups": {},
            "format": PACKED_FORMAT,
            "ignore": [],
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
        }
    else:
        if existing.get("quant_method") != "compressed-tensors":
            raise PrepareError(
                f"{where}: quantization_config.quant_method is {existing.get('quant_method')!r}, expected "
                "'compressed-tensors' (or none); requantize only extends compressed-tensors checkpoints"
            )
        config = copy.deepcopy(existing)
    groups = dict(config.get("config_groups") or {})
    added: dict[str, Any] = {}
    for key in TARGETS:
        members = sorted(t.module for t in tensors if t.target == key)
        if not members:
            continue
        target = TARGETS[key]
        if target.group_name in groups:
            raise PrepareError(
                f"{where}: quantization_config already has group {target.group_name!r}; "
                "run requantize on the original download, not on a prepared directory"
            )
        added[target.group_name] = {
            "targets": [target.config_target] if target.config_target else members,
            "weights": weight_args(group_size),
            "input_activations": None,
            "output_activations": None,
            "format": PACKED_FORMAT,
        }
    # vLLM takes the first config group whose target matches a layer name: ours go first.
    config["config_groups"] = {**added, **groups}
    config["ignore"] = fix_ignore(config.get("ignore") or [], {t.module for t in tensors}, modules)
    return config


def plan_requantize(checkpoint: Checkpoint, targets: Sequence[str], group_size: int = GROUP_SIZE) -> RequantizePlan:
    """Which tensors change, the new shard contents, config and index (no I/O)."""
    targets = parse_targets(targets)
    root = checkpoint.root
    tensors: list[QuantizedTensor] = []
    for key in targets:
        target = TARGETS[key]
        found = 0
        for shard, entries in sorted(checkpoint.shards.items()):
            for name, entry in sorted(entries.items()):
                if not target.selects(name):
                    continue
                if key == "mtp" and len(entry.shape) != 2:
                    continue
                module = name[: -len(".weight")]
                if f"{module}.weight_packed" in checkpoint.weight_map:
                    raise PrepareError(
                        f"{root / shard}: {module} is already quantized; run requantize on the original download"
                    )
                if len(entry.shape) != 2:
                    raise PrepareError(f"{root / shard}: {name} has shape {list(entry.shape)}, expected a 2-D table")
                if entry.dtype not in SOURCE_DTYPES:
                    raise PrepareError(
                        f"{root / shard}: {name} is {entry.dtype}, expected one of {', '.join(SOURCE_DTYPES)}"
                    )
                rows, cols = entry.shape
                if cols % group_size:
                    raise PrepareError(
                        f"{root / shard}: {name} has {cols} input columns, not a multiple of the group size {group_size}"
                    )
                tensors.append(
                    QuantizedTensor(module, key, shard, entry.dtype, rows, cols, target.scale_dtype, group_size)
                )
                found += 1
        if not found:
            already = [
                n
                for n in checkpoint.weight_map
                if n.endswith(".weight_packed") and target.selects(n[: -len("_packed")])
            ]
            hint = "it is already quantized" if already else "tied embeddings or another architecture?"
            raise PrepareError(f"{root}: no tensor for --only {key} (looked for {target.pattern.pattern}); {hint}")

    changed = {t.shard for t in tensors}
    shard_specs: dict[str, list[TensorSpec]] = {}
    replaced = {t.source_name for t in tensors}
    for shard in sorted(changed):
        specs = [e.spec() for n, e in checkpoint.shards[shard].items() if n not in replaced]
        for t in tensors:
            if t.shard == shard:
                specs.extend(t.outputs())
        shard_specs[shard] = specs

    config = copy.deepcopy(checkpoint.config)
    config["quantization_config"] = requantized_quantization_config(
        checkpoint.config.get("quantization_config"),
        tensors,
        checkpoint.linear_module_names(),
        group_size,
        root / CONFIG_NAME,
    )

    index = None
    if checkpoint.index is not None:
        weight_map = {n: s for n, s in checkpoint.weight_map.items() if n not in replaced}
        for t in tensors:
            weight_map.update({spec.name: t.shard for spec in t.outputs()})
        total = sum(
            spec.nbytes
            for shard, entries in checkpoint.shards.items()
            for spec in (shard_specs[shard] if shard in shard_specs else [e.spec() for e in entries.values()])
        )
        index = copy.deepcopy(checkpoint.index)
        index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
        index["weight_map"] = dict(sorted(weight_map.items()))
    return RequantizePlan(targets, group_size, tuple(tensors), shard_specs, config, index)


# ----------------------------------------------------------------------------- execution


@dataclass
class TensorReport:
    name: str
    shape: tuple[int, int]
    seconds: float
    relative_error: float  # ||W - dequant(Q)|| / ||W||, over every MEASURE_EVERY-th row block of large tables


@dataclass
class RequantizeResult:
    dst: Path
    up_to_date: bool
    tensors: list[TensorReport] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # files written fresh
    placed: dict[str, str] = field(default_factory=dict)  # file -> reflink | hardlink | copy
    bytes_quantized: int = 0
    seconds: float = 0.0


def default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _as_bytes(tensor: Any) -> memoryview:
    import torch

    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def _quantize_tensor(
    reader: SafetensorsFile, tensor: QuantizedTensor, writer: ShardWriter, workers: int, on_bytes: Any
) -> TensorReport:
    import torch

    torch_dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    entry = reader.tensors[tensor.source_name]
    rows, cols, group = tensor.rows, tensor.cols, tensor.group_size
    row_bytes = cols * DTYPE_SIZES[tensor.dtype]
    scale_row_bytes = (cols // group) * DTYPE_SIZES[tensor.scale_dtype]
    block = rows_per_block(cols)
    blocks = -(-rows // block)
    local = threading.local()

    def run(start: int) -> tuple[float, float]:
        count = min(block, rows - start)
        state = getattr(local, "state", None)
        if state is None:
            state = local.state = (
                GroupQuantizer(cols, group, torch_dtypes[tensor.scale_dtype], block),
                bytearray(block * row_bytes),
            )
        quantizer, buffer = state
        reader.read_into(entry, start * row_bytes, memoryview(buffer)[: count * row_bytes])
        source = torch.frombuffer(buffer, dtype=torch_dtypes[tensor.dtype], count=count * cols).view(count, cols)
        # The error figure costs ~40 % more arithmetic per block: on large tables every
        # MEASURE_EVERY-th block gives it (a fixed, deterministic sample of rows).
        index = start // block
        out = quantizer.quantize(source, measure=blocks <= MEASURE_EVERY or index % MEASURE_EVERY == 0)
        writer.write_at(tensor.packed.name, start * cols, _as_bytes(out.packed))
        writer.write_at(tensor.scale.name, start * scale_row_bytes, _as_bytes(out.scale))
        on_bytes(count * row_bytes)
        return out.sq_error, out.sq_norm

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="requantize") as pool:
        try:
            sums = list(pool.map(run, range(0, rows, block)))
        except BaseException:
            pool.shutdown(cancel_futures=True)  # do not quantize the rest of a failed table
            raise
    writer.write(tensor.shape.name, struct.pack("<2q", rows, cols))
    sq_error = sum(e for e, _ in sums)  # summed in block order: deterministic
    sq_norm = sum(n for _, n in sums)
    relative = (sq_error / sq_norm) ** 0.5 if sq_norm > 0 else 0.0
    return TensorReport(tensor.source_name, (rows, cols), time.perf_counter() - began, relative)


def _write_shard(
    src: Path,
    dst: Path,
    plan: RequantizePlan,
    shard: str,
    workers: int,
    on_bytes: Any,
    expected: ManifestFile | None = None,
) -> list[TensorReport]:
    """Write ``shard`` fresh; with ``expected`` its source must hash to the input manifest's sha256.

    The source is hashed by a thread of its own while the shard is rewritten: both read the
    same file, so the page cache serves it to the second reader.
    """
    reports: list[TensorReport] = []
    cancel = threading.Event()

    def hash_source() -> str:
        def stop_when_cancelled(_: int) -> None:
            if cancel.is_set():
                raise _Cancelled

        return sha256_file(src / shard, stop_when_cancelled)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        check: Future[str] | None = hasher.submit(hash_source) if expected is not None else None
        with SafetensorsFile(src / shard) as reader:
            writer = ShardWriter(dst / shard, plan.shard_specs[shard], reader.metadata)
            try:
                quantized = {t.source_name: t for t in plan.tensors if t.shard == shard}
                for name, entry in sorted(reader.tensors.items()):
                    if name not in quantized:
                        for chunk in reader.iter_bytes(entry):
                            writer.write(name, chunk)
                for name in sorted(quantized):
                    reports.append(_quantize_tensor(reader, quantized[name], writer, workers, on_bytes))
                if check is not None and expected is not None and (found := check.result()) != expected.sha256:
                    raise PrepareError(
                        f"{src / shard}: sha256 expected {expected.sha256} (its manifest), found {found}; the "
                        "input was altered after it was verified: re-verify the download "
                        "(`qwen38 prepare download --recheck`) before preparing"
                    )
                writer.finish()
            except BaseException:
                cancel.set()  # do not finish hashing a shard whose output is discarded
                writer.abort()
                raise
    return reports


class _Cancelled(Exception):
    pass


def _dump_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def requantize_identity(
    plan: RequantizePlan, model: InputDirectory, draft_vocab: InputDirectory | None = None
) -> DerivedIdentity:
    """The output's identity: this step, its version, the plan's parameters and the inputs."""
    inputs = (model.ref,) if draft_vocab is None else (model.ref, draft_vocab.ref)
    return DerivedIdentity(
        transform=TRANSFORM, transform_version=TRANSFORM_VERSION, params=plan.params(), inputs=inputs
    )


def requantize_checkpoint(
    src: Path | str,
    dst: Path | str,
    targets: Sequence[str] = DEFAULT_TARGETS,
    *,
    group_size: int = GROUP_SIZE,
    draft_vocab: Path | str | None = None,
    workers: int | None = None,
    progress: bool = False,
    allow_unmanifested_input: bool = True,
    force: bool = False,
) -> RequantizeResult:
    """Write ``dst``: ``src`` with the ``targets`` requantized to int8 (idempotent, atomic).

    ``draft_vocab`` (a `prepare.draft_vocab` output directory) is copied in beside the
    weights, for the MTP speculator. An input without a manifest is identified by hashing
    its files (``allow_unmanifested_input``, the stand-alone command) or refused (profile
    preparation: only verified downloads). Returns what was done; ``up_to_date`` when
    ``dst`` already was this exact output (``force`` rebuilds it anyway: its bytes were
    found altered).
    """
    began = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if workers is not None and workers < 1:
        raise PrepareError(f"--workers {workers}: expected a positive number of threads")
    vocab_dir = Path(draft_vocab) if draft_vocab is not None else None
    refuse_overlap([src] + ([vocab_dir] if vocab_dir else []), dst)
    model = open_input(src, "model", allow_unmanifested=allow_unmanifested_input)
    checkpoint = open_checkpoint(src)
    plan = plan_requantize(checkpoint, targets, group_size)
    vocab: InputDirectory | None = None
    vocab_files: list[Path] = []
    if vocab_dir is not None:

        vocab_files = draft_vocab_files(vocab_dir)
        vocab = open_input(vocab_dir, "draft_vocab", allow_unmanifested=allow_unmanifested_input)
    identity = requantize_identity(plan, model, vocab)
    result = RequantizeResult(dst=dst, up_to_date=False)

    with build_lock(dst):
        if not force and is_current(dst, identity):
            result.up_to_date = True
            result.seconds = time.perf_counter() - began
            return result
        import torch

        threads = torch.get_num_threads()
        # Workers parallelise over row blocks; one intra-op thread each avoids
        # oversubscribing (and OpenMP spin-waits on a busy machine).
        torch.set_num_threads(1)
        bar = _progress(sum(t.rows * t.cols * DTYPE_SIZES[t.dtype] for t in plan.tensors), progress, dst)
        try:
            with derived_directory(dst, identity) as stage:
                skip = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, *plan.shard_specs}
                for rel in sorted(f.path for f in model.manifest.files):
                    if rel not in skip:
                        stage.place(model, rel)
                for shard in sorted(plan.shard_specs):
                    # An input hashed just now (no manifest) needs no second look.
                    expected = None if model.hashed_now else model.file(shard)
                    result.tensors += _write_shard(
                        src, stage.path, plan, shard, workers or default_workers(), bar.update, expected
                    )
                    result.written.append(shard)
                (stage.path / CONFIG_NAME).write_text(_dump_json(plan.config), encoding="utf-8")
                result.written.append(CONFIG_NAME)
                if plan.index is not None:
                    (stage.path / INDEX_NAME).write_text(_dump_json(plan.index), encoding="utf-8")
                    result.written.append(INDEX_NAME)
                for path in vocab_files:
                    stage.place(vocab, path.name)  # type: ignore[arg-type]
                result.placed = dict(stage.placed)
        finally:
            bar.close()
            torch.set_num_threads(threads)
    result.bytes_quantized = sum(t.rows * t.cols * DTYPE_SIZES[t.dtype] for t in plan.tensors)
    result.seconds = time.perf_counter() - began
    return result


def _progress(total: int, enabled: bool, dst: Path) -> Any:
    """Bytes of the tables being requantized (a bar in a terminal, else a line every 20 s)."""

    return Progress(f"requantize {dst.name}: int8 tables", total, shown=enabled)
