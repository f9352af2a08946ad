"""Writing a synthetic checkpoint directory: shards from tensor specs, then index and config.

The one writer of generated (random-weight) checkpoints: `prepare.generate`'s models, the
bench inputs (`bench.adapter`, `bench.requantize`) and the tests' model builders. A shard
is created at its final size with its header first - `core.safetensors_stream`'s
deterministic layout, the one safetensors' own serializer writes, so the same tensors
always give the same bytes - and its tensors' bytes then come in one of three ways:

- whole tensors (torch or numpy) in this process: `CheckpointWriter.write_shard`, which
  hashes the file as it writes it (no second read of a multi-GB shard for its manifest);
- pieces in this process: `CheckpointWriter.open_shard` returns the shard's
  `core.safetensors_stream.ShardWriter` (``write`` / ``write_at``);
- pieces written by other processes at the absolute file offsets `CheckpointWriter.locate`
  gives, each then counted with `CheckpointWriter.record`.

`CheckpointWriter.finish` refuses a shard with a tensor not fully written, then writes
``model.safetensors.index.json`` (when asked) and ``config.json`` (two-space JSON and a
final newline). It writes into the directory it is given: a caller that publishes the
checkpoint writes into an `core.atomic.atomic_directory` stage, so the shards, index and
config appear together or not at all. `write_checkpoint` is the whole-tensors shortcut.

The checkpoint is read back with `core.checkpoint.open_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from core.checkpoint import CONFIG_NAME, INDEX_NAME
from core.safetensors_stream import ShardWriter, TensorSpec, encode_header, layout_order

FORMAT_METADATA: Mapping[str, str] = {"format": "pt"}  # what safetensors.torch writes and transformers expects

# torch / numpy dtype names (``str(dtype)`` without ``torch.``) -> safetensors dtype strings
_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
}


class SpecLike(Protocol):
    """A tensor to be stored: `core.safetensors_stream.TensorSpec` or `prepare.synthetic.StoredTensor`."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...


def safetensors_dtype(tensor: Any) -> str:
    """The safetensors dtype string of a torch tensor or numpy array."""
    key = str(tensor.dtype).removeprefix("torch.")
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"dtype {tensor.dtype} has no safetensors equivalent") from None


def tensor_bytes(tensor: Any) -> memoryview:
    """The raw little-endian bytes of a torch tensor or numpy array, C order (no copy when contiguous)."""
    if type(tensor).__module__.startswith("torch"):
        import torch

        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return memoryview(flat.view(torch.uint8).numpy()).cast("B")
    import numpy as np

    return memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)).cast("B")


def tensor_spec(name: str, tensor: Any) -> TensorSpec:
    return TensorSpec(name, safetensors_dtype(tensor), tuple(int(d) for d in tensor.shape))


def index_document(shards: Mapping[str, Iterable[SpecLike]]) -> dict[str, Any]:
    """``model.safetensors.index.json``'s content: total tensor bytes and the sorted tensor -> shard map."""
    total = 0
    weight_map: list[tuple[str, str]] = []
    for shard, specs in shards.items():
        for spec in specs:
            total += spec.nbytes
            weight_map.append((spec.name, shard))
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map))}


def json_text(data: Any) -> str:
    """How the writer stores JSON (index, config): two-space indent and a final newline."""
    return json.dumps(data, indent=2) + "\n"


class CheckpointWriter:
    """One checkpoint directory: its shards (each laid out before its bytes come), index and config."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._specs: dict[str, list[TensorSpec]] = {}  # shard -> its tensors
        self._open: dict[str, ShardWriter] = {}  # shards whose bytes are still coming
        self._shard_of: dict[str, str] = {}  # tensor -> shard
        self.hashes: dict[str, str] = {}  # sha256 of the files written whole here (a manifest's `files=`)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # after `finish`, nothing is left open

    def _add(self, shard: str, specs: Sequence[SpecLike]) -> list[TensorSpec]:
        if shard in self._specs:
            raise ValueError(f"{self.directory / shard}: written twice")
        specs = [TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in specs]
        for spec in specs:
            if spec.name in self._shard_of:
                raise ValueError(f"{spec.name}: in both {self._shard_of[spec.name]} and {shard}")
            self._shard_of[spec.name] = shard
        self._specs[shard] = specs
        return specs

    def open_shard(
        self, shard: str, specs: Sequence[SpecLike], metadata: Mapping[str, str] | None = FORMAT_METADATA
    ) -> ShardWriter:
        """Create ``shard`` at its final size with its header; its bytes are written through the result."""
        writer = ShardWriter(self.directory / shard, self._add(shard, specs), metadata)
        self._open[shard] = writer
        return writer

    def write_shard(
        self, shard: str, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = FORMAT_METADATA
    ) -> str:
        """Write ``shard`` whole from in-memory tensors (torch or numpy); returns its sha256.

        The file is written beside its name and renamed onto it: the tensors may be mapped
        from the file it replaces (``safetensors.torch.load_file`` of a copy being edited)."""
        specs = self._add(shard, [tensor_spec(name, t) for name, t in tensors.items()])
        header, _offsets = encode_header(specs, metadata)
        digest = hashlib.sha256(header)
        path = self.directory / shard
        partial = path.with_name(f".{shard}.partial")
        try:
            with open(partial, "wb") as handle:
                handle.write(header)
                for spec in layout_order(specs):
                    data = tensor_bytes(tensors[spec.name])
                    handle.write(data)
                    digest.update(data)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        self.hashes[shard] = digest.hexdigest()
        return self.hashes[shard]

    def locate(self, name: str) -> tuple[Path, int]:
        """The file holding tensor ``name`` and the absolute offset of its first byte (an open shard's)."""
        writer = self._open[self._shard_of[name]]
        return writer.path, writer.offset(name)

    def record(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` of tensor ``name`` written by another process at `locate`'s offset."""
        self._open[self._shard_of[name]].record(name, nbytes)

    def finish(self, *, config: Mapping[str, Any] | None = None, index: bool = True) -> dict[str, str]:
        """Close every shard (refusing one not fully written), then write the index and config.json.

        Returns `hashes`: the sha256 of every file written whole here."""
        try:
            for writer in self._open.values():
                writer.finish()
        finally:
            self.abort()
        for name, data in ((INDEX_NAME, index_document(self._specs) if index else None), (CONFIG_NAME, config)):
            if data is not None:
                text = json_text(data).encode("utf-8")
                (self.directory / name).write_bytes(text)
                self.hashes[name] = hashlib.sha256(text).hexdigest()
        return dict(self.hashes)

    def abort(self) -> None:
        """Close the shards still open (their files stay, incomplete: the caller's stage is discarded)."""
        for writer in self._open.values():
            writer.abort()
        self._open.clear()


def write_checkpoint(
    directory: Path | str,
    shards: Mapping[str, Mapping[str, Any]],
    *,
    config: Mapping[str, Any] | None = None,
    index: bool | None = None,
    metadata: Mapping[str, str] | None = FORMAT_METADATA,
) -> dict[str, str]:
    """Write whole tensors as ``{shard file: {tensor name: tensor}}`` into ``directory``, plus
    ``config`` and the index (``index=None``: written when there is more than one shard).
    Returns the sha256 of every file written."""
    writer = CheckpointWriter(directory)
    for shard, tensors in shards.items():
        writer.write_shard(shard, tensors, metadata)
    return writer.finish(config=config, index=len(shards) > 1 if index is None else index)
