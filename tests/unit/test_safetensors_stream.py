"""Streaming safetensors reads and writes, checked against the safetensors library."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.errors import PrepareError
from core.safetensors_stream import SafetensorsFile, ShardWriter, TensorSpec, encode_header


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "b.weight": torch.randn(7, 12, generator=g).to(torch.bfloat16),
        "a.weight_shape": torch.tensor([7, 12], dtype=torch.int64),
        "a.weight_packed": torch.randint(-(2**31), 2**31 - 1, (5, 3), dtype=torch.int32, generator=g),
        "c.mask": torch.tensor([True, False, True]),
        "d.scale": torch.randn(5, 1, generator=g).to(torch.float16),
    }


def test_reads_tensors_written_by_safetensors(tmp_path):
    tensors = sample()
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        assert set(f.tensors) == set(tensors)
        for name, t in tensors.items():
            entry = f.tensors[name]
            assert entry.shape == tuple(t.shape)
            assert b"".join(bytes(c) for c in f.iter_bytes(entry, chunk=5)) == tensor_bytes(t)
        # a row range of a 2-D tensor
        entry = f.tensors["b.weight"]
        buf = memoryview(bytearray(2 * entry.row_bytes))
        f.read_into(entry, 3 * entry.row_bytes, buf)
        assert bytes(buf) == tensor_bytes(tensors["b.weight"][3:5])


def test_written_shard_loads_in_safetensors_with_pieces_written_in_any_order(tmp_path):
    tensors = sample()
    specs = [
        TensorSpec(
            n,
            {torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.float16: "F16"}[
                t.dtype
            ],
            tuple(t.shape),
        )
        for n, t in tensors.items()
    ]
    writer = ShardWriter(tmp_path / "y.safetensors", specs, {"format": "pt"})
    packed = tensor_bytes(tensors["a.weight_packed"])
    writer.write_at("a.weight_packed", 24, packed[24:])  # second half first
    writer.write_at("a.weight_packed", 0, packed[:24])
    for name in ("b.weight", "a.weight_shape", "c.mask", "d.scale"):
        data = tensor_bytes(tensors[name])
        writer.write(name, data[:3])
        writer.write(name, data[3:])
    writer.finish()
    with safe_open(str(tmp_path / "y.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)


def test_layout_is_deterministic_and_aligned():
    specs = [
        TensorSpec("z", "BF16", (3,)),
        TensorSpec("a", "I64", (2,)),
        TensorSpec("m", "I32", (1,)),
        TensorSpec("b", "I64", (1,)),
    ]
    header, offsets = encode_header(specs, {"format": "pt"})
    again, _ = encode_header(list(reversed(specs)), {"format": "pt"})
    assert header == again
    assert len(header) % 8 == 0
    parsed = json.loads(header[8:])
    assert list(parsed) == ["__metadata__", "a", "b", "m", "z"]  # widest dtype first, then name
    for name, off in offsets.items():
        width = {"BF16": 2, "I64": 8, "I32": 4}[parsed[name]["dtype"]]
        assert off % width == 0


def test_unfinished_tensor_is_refused(tmp_path):
    writer = ShardWriter(tmp_path / "z.safetensors", [TensorSpec("a", "I32", (4,))])
    writer.write("a", b"\0" * 8)
    with pytest.raises(ValueError, match="not fully written"):
        writer.finish()
    writer = ShardWriter(tmp_path / "w.safetensors", [TensorSpec("a", "I32", (4,))])
    with pytest.raises(ValueError, match="overflows"):
        writer.write_at("a", 12, b"\0" * 8)
    writer.abort()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: raw[:-4], "cover"),
        (lambda raw: struct.pack("<Q", 10**12) + raw[8:], "header length"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "not JSON"),
        (lambda raw: raw[:8] + raw[8:].replace(b'"BF16"', b'"XX16"', 1), "unsupported dtype"),
    ],
)
def test_damaged_files_are_refused_with_the_path(tmp_path, damage, message):
    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, str(path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(PrepareError, match=message) as caught:
        SafetensorsFile(path)
    assert str(path) in str(caught.value)
