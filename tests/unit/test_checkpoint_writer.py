"""The one writer of synthetic checkpoints, read back by the one reader (`core.checkpoint`)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save as numpy_save
from safetensors.torch import save as torch_save

from core.checkpoint import INDEX_NAME, open_checkpoint
from core.errors import PrepareError
from core.safetensors_stream import TensorSpec
from prepare.checkpoint_writer import (
    FORMAT_METADATA,
    CheckpointWriter,
    index_document,
    safetensors_dtype,
    write_checkpoint,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "a.weight_scale": (torch.rand(8, 1, generator=g) * 100).to(torch.float8_e4m3fn),
        "a.weight_scale_2": torch.tensor(2e-6),
        "b.weight": torch.randint(0, 256, (4, 8), generator=g, dtype=torch.uint8),
        "b.g_idx": torch.arange(16, dtype=torch.int32),
        "b.shape": torch.tensor([4, 16], dtype=torch.int64),
        "c.t": torch.randn(3, 5, generator=g).t(),  # not contiguous
    }


@pytest.mark.parametrize("metadata", [FORMAT_METADATA, None])
def test_a_shard_reads_back_through_safetensors_and_is_hashed_as_written(tmp_path, metadata):
    tensors = _tensors()
    digest = CheckpointWriter(tmp_path).write_shard("model.safetensors", tensors, metadata)
    data = (tmp_path / "model.safetensors").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert handle.metadata() == (dict(metadata) if metadata else None)
        assert sorted(handle.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            got = handle.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8))


def test_one_dtype_a_size_gives_the_bytes_safetensors_writes(tmp_path):
    # Layout: widest elements first, then by name (safetensors also orders same-size dtypes
    # by dtype, so its bytes are ours where no two dtypes share a size).
    tensors = {k: v for k, v in _tensors().items() if k in ("a.weight", "a.weight_scale_2", "b.weight", "b.shape")}
    CheckpointWriter(tmp_path).write_shard("model.safetensors", tensors)
    assert (tmp_path / "model.safetensors").read_bytes() == torch_save(tensors, metadata=dict(FORMAT_METADATA))


def test_numpy_arrays_are_written_as_safetensors_numpy_writes_them(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((4, 4)).astype(np.float32), "n": np.ones(4, dtype=np.float16)}
    write_checkpoint(tmp_path, {"model.safetensors": arrays}, metadata=None)
    assert (tmp_path / "model.safetensors").read_bytes() == numpy_save(arrays)
    assert safetensors_dtype(arrays["n"]) == "F16" and safetensors_dtype(torch.zeros(1, dtype=torch.bool)) == "BOOL"
    with pytest.raises(ValueError, match="complex64"):
        safetensors_dtype(np.zeros(1, dtype=np.complex64))


def test_shards_index_and_config_read_back_through_the_one_reader(tmp_path):
    tensors = _tensors()
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("a.")},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith("a.")},
    }
    config = {"architectures": ["X"], "text_config": {"hidden_size": 16}}
    hashes = write_checkpoint(tmp_path, shards, config=config)  # two shards: an index by default
    assert set(hashes) == {*shards, INDEX_NAME, "config.json"}
    for name, digest in hashes.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    assert (tmp_path / "config.json").read_text() == json.dumps(config, indent=2) + "\n"
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())
    assert list(index["weight_map"]) == sorted(tensors)

    ckpt = open_checkpoint(tmp_path)
    assert ckpt.source == "index" and ckpt.config == config and ckpt.text_config == {"hidden_size": 16}
    assert ckpt.weight_map == {n: s for s, group in shards.items() for n in group}
    assert ckpt.entry("a.weight").dtype == "BF16" and ckpt.entry("c.t").shape == (5, 3)
    assert ckpt.shard_path("b.weight") == tmp_path / "model-00002-of-00002.safetensors"
    assert ckpt.has("b.g_idx") and not ckpt.has("b.bias")
    assert ckpt.shard_metadata["model-00001-of-00002.safetensors"] == dict(FORMAT_METADATA)
    assert ckpt.linear_module_names() == {"a", "b"}  # 2-D .weight only


def test_one_shard_has_no_index_unless_asked(tmp_path):
    write_checkpoint(tmp_path / "one", {"model.safetensors": {"w": torch.zeros(2, 2)}})
    assert not (tmp_path / "one" / INDEX_NAME).exists()
    assert open_checkpoint(tmp_path / "one", require_config=False).source == "scan"
    write_checkpoint(tmp_path / "two", {"model.safetensors": {"w": torch.zeros(2, 2)}}, index=True)
    assert open_checkpoint(tmp_path / "two", require_config=False).source == "index"


def test_pieces_written_elsewhere_are_counted_and_a_short_tensor_is_refused(tmp_path):
    specs = [TensorSpec("big", "F32", (4, 3)), TensorSpec("small", "I64", (2,))]
    values = {"big": np.arange(12, dtype=np.float32).reshape(4, 3), "small": np.array([7, 9], dtype=np.int64)}
    writer = CheckpointWriter(tmp_path / "ok")
    writer.open_shard("model.safetensors", specs)
    for name, array in values.items():  # as a worker process does: pwrite at the located offset
        path, offset = writer.locate(name)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, array.tobytes(), offset)
        finally:
            os.close(fd)
        writer.record(name, array.nbytes)
    writer.finish(index=False)
    assert (tmp_path / "ok" / "model.safetensors").read_bytes() == numpy_save(values, metadata=dict(FORMAT_METADATA))

    short = CheckpointWriter(tmp_path / "short")
    shard = short.open_shard("model.safetensors", specs)
    shard.write("big", values["big"].tobytes())
    with pytest.raises(ValueError, match="overflow"):
        short.record("big", 4)
    with pytest.raises(ValueError, match="not fully written: small"):
        short.finish()


def test_a_tensor_in_two_shards_is_refused_before_it_is_written(tmp_path):
    writer = CheckpointWriter(tmp_path)
    writer.write_shard("one.safetensors", {"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="w: in both one.safetensors and two.safetensors"):
        writer.write_shard("two.safetensors", {"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="written twice"):
        writer.write_shard("one.safetensors", {"v": torch.zeros(1)})


def test_index_document_counts_every_tensor():
    doc = index_document({"s1": [TensorSpec("b", "BF16", (2, 3))], "s2": [TensorSpec("a", "U8", (5,))]})
    assert doc == {"metadata": {"total_size": 17}, "weight_map": {"a": "s2", "b": "s1"}}


def test_the_reader_refuses_what_does_not_agree(tmp_path):
    shards = {"x.safetensors": {"a": torch.zeros(2), "c": torch.zeros(1)}, "y.safetensors": {"b": torch.zeros(2)}}
    write_checkpoint(tmp_path, shards)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["a"] = "y.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(PrepareError, match="maps a to y.safetensors, which does not hold it"):
        open_checkpoint(tmp_path, require_config=False)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "x.safetensors", "b": "y.safetensors"}}))
    with pytest.raises(PrepareError, match=r"x.safetensors: holds tensors the index does not list \(c\)"):
        open_checkpoint(tmp_path, require_config=False)
    with pytest.raises(PrepareError, match="no such checkpoint directory"):
        open_checkpoint(tmp_path / "missing")
