"""The directions file: round trip, determinism of random_directions, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from core.errors import AdapterError
from core.manifest import sha256_file
from prepare.directions import COEFS_KEY, ORDER_KEY, random_directions, read_directions, write_directions
from tests.unit.test_adapter import make_checkpoint


def test_written_directions_read_back_in_order(tmp_path):
    vectors = {"m.b": torch.tensor([1.0, 2.0]), "m.a": torch.tensor([0.5, -1.0], dtype=torch.bfloat16)}
    coefs = {"m.b": 0.25, "m.a": -3.0}
    write_directions(tmp_path / "d.safetensors", vectors, coefs)
    read = read_directions(tmp_path / "d.safetensors")
    assert read.modules == ["m.b", "m.a"]
    assert read.coefs == coefs
    assert read.vectors["m.a"].dtype == torch.float32
    assert read.vectors["m.a"].tolist() == [0.5, -1.0]


def test_a_file_written_by_other_tooling_in_the_documented_format_reads(tmp_path):
    # exactly the documented layout, written with plain safetensors
    tensors = {
        "model.language_model.layers.3.mlp.down_proj": torch.tensor([0.6, 0.8], dtype=torch.float16),
        "model.language_model.layers.0.linear_attn.out_proj": torch.tensor([1.0, 0.0]),
        COEFS_KEY: torch.tensor([2.0, 0.5], dtype=torch.float64),
    }
    order = ["model.language_model.layers.0.linear_attn.out_proj", "model.language_model.layers.3.mlp.down_proj"]
    save_file(tensors, str(tmp_path / "d.safetensors"), metadata={ORDER_KEY: json.dumps(order)})
    read = read_directions(tmp_path / "d.safetensors")
    assert read.coefs == {order[0]: 2.0, order[1]: 0.5}


def test_random_directions_are_deterministic_unit_vectors_for_every_target(tmp_path):
    reference = make_checkpoint(tmp_path / "model", "bf16")
    a = random_directions(tmp_path / "model", tmp_path / "a.safetensors", seed=7)
    b = random_directions(tmp_path / "model", tmp_path / "b.safetensors", seed=7)
    c = random_directions(tmp_path / "model", tmp_path / "c.safetensors", seed=8)
    assert sha256_file(a) == sha256_file(b) != sha256_file(c)
    read = read_directions(a)
    assert read.modules == list(reference)
    for module, vec in read.vectors.items():
        assert vec.shape == (reference[module].shape[0],)
        assert abs(float(vec.double().norm()) - 1.0) < 1e-6
        assert 4.0 <= read.coefs[module] < 8.0


def _bad_file(tmp_path, tensors, metadata):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(AdapterError) as info:
        read_directions(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_coef_order_is_refused(tmp_path):
    assert "no 'coef_order'" in _bad_file(tmp_path, {"m": torch.ones(2), COEFS_KEY: torch.ones(1)}, {"x": "y"})


def test_coefficients_of_the_wrong_length_are_refused(tmp_path):
    msg = _bad_file(tmp_path, {"m": torch.ones(2), COEFS_KEY: torch.ones(2)}, {ORDER_KEY: json.dumps(["m"])})
    assert "1-D float tensor of 1 values" in msg


def test_a_tensor_not_in_coef_order_is_refused(tmp_path):
    tensors = {"m": torch.ones(2), "n": torch.ones(2), COEFS_KEY: torch.ones(1)}
    assert "disagree" in _bad_file(tmp_path, tensors, {ORDER_KEY: json.dumps(["m"])})


def test_a_two_dimensional_direction_is_refused(tmp_path):
    tensors = {"m": torch.ones(2, 2), COEFS_KEY: torch.ones(1)}
    assert "must be a 1-D float tensor" in _bad_file(tmp_path, tensors, {ORDER_KEY: json.dumps(["m"])})


def test_non_finite_values_are_refused(tmp_path):
    tensors = {"m": torch.tensor([1.0, float("nan")]), COEFS_KEY: torch.ones(1)}
    assert "NaN" in _bad_file(tmp_path, tensors, {ORDER_KEY: json.dumps(["m"])})
    tensors = {"m": torch.ones(2), COEFS_KEY: torch.tensor([float("inf")])}
    assert "not finite" in _bad_file(tmp_path, tensors, {ORDER_KEY: json.dumps(["m"])})


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="not found"):
        read_directions(tmp_path / "nope.safetensors")
