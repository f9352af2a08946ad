"""Streaming safetensors I/O: read any byte range of a tensor, write a shard piecewise.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header
length, a JSON header mapping each tensor name to ``dtype``, ``shape`` and
``data_offsets`` (relative to the end of the header) plus an optional ``__metadata__``
string map, then the raw little-endian tensor bytes. Reading with plain ``pread`` into a
reused buffer keeps the resident set to one block: a memory map of a multi-GB shard would
count every page it touched towards RSS. Writing the header first and each tensor's bytes
at their precomputed offsets lets a 2.5 GB tensor be produced a row block at a time.

Files written here use one deterministic layout: tensors ordered by element size (widest
first, so every tensor stays aligned to its element size) then by name, compact JSON
header padded with spaces to a multiple of 8, ``__metadata__`` first - the same choices
safetensors' own serializer makes, so the same tensors always give the same bytes.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.errors import PrepareError

# Element sizes in bytes for the dtypes safetensors defines (sub-byte types excluded).
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

_MAX_HEADER = 100 << 20  # safetensors itself refuses headers above 100 MB
_COPY_CHUNK = 16 << 20


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of an existing file: where its bytes lie (absolute file offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a scalar)."""
        if not self.shape or self.shape[0] == 0:
            return self.nbytes
        return self.nbytes // self.shape[0]

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


def _bad(path: Path, what: str) -> PrepareError:
    return PrepareError(f"{path}: not a valid safetensors file ({what}); re-download it or check the path")


class SafetensorsFile:
    """An opened safetensors file: its header, and reads of any tensor's byte ranges."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise PrepareError(f"{self.path}: cannot open ({exc.strerror}); check the checkpoint directory") from exc
        try:
            # Blocks are read in ascending order (by a few threads): keep readahead wide.
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self.metadata, self.tensors, self.data_start = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> tuple[dict[str, str], dict[str, TensorEntry], int]:
        size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, 8, 0)
        if len(raw) != 8:
            raise _bad(self.path, f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise _bad(self.path, f"header length {header_len} for a {size}-byte file")
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _bad(self.path, f"header is not JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise _bad(self.path, "header is not a JSON object")
        data_start = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, TensorEntry] = {}
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise _bad(self.path, f"malformed entry for {name!r}") from exc
            if dtype not in DTYPE_SIZES:
                raise _bad(self.path, f"{name!r} has unsupported dtype {dtype}")
            expected = TensorSpec(name, dtype, shape).nbytes
            if end - begin != expected or begin < 0:
                raise _bad(self.path, f"{name!r} spans {end - begin} bytes, its shape needs {expected}")
            tensors[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
        covered = data_start
        for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
            if entry.start != covered:
                raise _bad(self.path, f"data of {entry.name!r} does not follow the previous tensor")
            covered = entry.end
        if covered != size:
            raise _bad(self.path, f"tensors cover {covered} of {size} bytes")
        return dict(metadata), tensors, data_start

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(self, entry: TensorEntry, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the tensor's bytes starting at ``offset`` (bytes into the tensor)."""
        if offset < 0 or offset + len(buffer) > entry.nbytes:
            raise ValueError(f"read of {len(buffer)} bytes at {offset} outside {entry.name} ({entry.nbytes} bytes)")
        position = entry.start + offset
        done = 0
        while done < len(buffer):
            got = os.preadv(self._fd, [buffer[done:]], position + done)
            if got <= 0:
                raise _bad(self.path, f"unexpected end of file inside {entry.name!r}")
            done += got

    def iter_bytes(self, entry: TensorEntry, chunk: int = _COPY_CHUNK) -> Iterator[memoryview]:
        """The tensor's bytes in chunks of at most ``chunk`` bytes (one reused buffer)."""
        buffer = memoryview(bytearray(min(chunk, max(entry.nbytes, 1))))
        offset = 0
        while offset < entry.nbytes:
            size = min(len(buffer), entry.nbytes - offset)
            view = buffer[:size]
            self.read_into(entry, offset, view)
            yield view
            offset += size


def read_header(path: Path | str) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    with SafetensorsFile(path) as handle:
        return handle.metadata, handle.tensors


def layout_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The deterministic on-disk order: widest elements first, then by name."""
    return sorted(specs, key=lambda s: (-DTYPE_SIZES[s.dtype], s.name))


def encode_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) and each tensor's absolute file offset."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in one shard")
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    relative: dict[str, int] = {}
    cursor = 0
    for spec in layout_order(specs):
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [cursor, cursor + spec.nbytes],
        }
        relative[spec.name] = cursor
        cursor += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {name: len(prefix) + off for name, off in relative.items()}


class ShardWriter:
    """Writes one safetensors file: header first, then each tensor's bytes at its offset.

    ``write(name, data)`` appends to a tensor front to back; ``write_at(name, offset, data)``
    places a disjoint piece anywhere in it (thread-safe: pieces of one tensor may come from
    several workers); pieces other processes wrote at ``offset(name)`` are counted with
    ``record``. ``finish()`` refuses a file with a tensor not fully written.
    """

    def __init__(
        self, path: Path | str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self._specs = {s.name: s for s in specs}
        header, self._offsets = encode_header(specs, metadata)
        self._written = dict.fromkeys(self._specs, 0)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = len(header) + sum(s.nbytes for s in specs)
        try:
            self._pwrite(header, 0)
            os.ftruncate(self._fd, self.size)
        except BaseException:
            os.close(self._fd)
            raise

    def _pwrite(self, data: bytes | memoryview, position: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            done = os.pwrite(self._fd, view, position)
            view = view[done:]
            position += done

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        self.write_at(name, self._written[name], data)

    def write_at(self, name: str, offset: int, data: bytes | bytearray | memoryview) -> None:
        spec = self._specs[name]
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > spec.nbytes:
            raise ValueError(f"{name}: writing {len(view)} bytes at {offset} overflows {spec.nbytes}")
        self._pwrite(view, self._offsets[name] + offset)
        with self._lock:
            self._written[name] += len(view)

    def offset(self, name: str) -> int:
        """The absolute file offset of tensor ``name``'s first byte (for a writer in another process)."""
        return self._offsets[name]

    def record(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` of tensor ``name`` written at `offset` by another process."""
        if nbytes < 0 or self._written[name] + nbytes > self._specs[name].nbytes:
            raise ValueError(f"{name}: {nbytes} more bytes overflow {self._specs[name].nbytes}")
        with self._lock:
            self._written[name] += nbytes

    def finish(self) -> None:
        short = [n for n, s in self._specs.items() if self._written[n] != s.nbytes]
        try:
            if short:
                raise ValueError(f"{self.path.name}: tensors not fully written: {', '.join(sorted(short))}")
        finally:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
