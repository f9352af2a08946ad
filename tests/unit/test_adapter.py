"""The converter: rank-1 algebra on every stored format, vLLM naming, refusals, records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.checkpoint import open_checkpoint
from core.errors import AdapterError, VerifyError
from core.identity import ArtifactIdentity, DerivedIdentity
from core.manifest import MANIFEST_NAME, input_ref, read_manifest, sha256_file, write_manifest
from entrypoint.cli import main
from prepare.adapter import (
    CONVERSION_FILE,
    TRANSFORM,
    TRANSFORM_VERSION,
    build_adapter,
    lora_tensor_names,
    verify_adapter_binding,
)
from prepare.checkpoint_writer import write_checkpoint
from prepare.directions import target_modules, write_directions
from prepare.weight_formats import linear_modules
from tests.support.identified import seal
from tests.support.quantize import stored_module

HIDDEN = 192  # not a multiple of 128: block-FP8 tiles are ragged at the edge
IN_FEATURES = {"linear_attn.out_proj": 256, "self_attn.o_proj": 128, "mlp.down_proj": 320}
# Qwen3.5 layout: three Gated DeltaNet layers, then one full-attention layer
LAYER_KINDS = ["linear_attn.out_proj", "linear_attn.out_proj", "linear_attn.out_proj", "self_attn.o_proj"]
FORMATS = ["bf16", "fp8-tensor", "fp8-channel", "fp8-block", "nvfp4-modelopt", "nvfp4-ct"]


def make_checkpoint(
    directory: Path, fmt: str | dict[str, str], *, prefix: str = "model.", seed: int = 0
) -> dict[str, torch.Tensor]:
    """A weights-only Qwen3.5-shaped checkpoint with its manifest; returns each target's reference W (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    modules = []
    for layer, mixer in enumerate(LAYER_KINDS):
        modules += [f"{prefix}layers.{layer}.{mixer}", f"{prefix}layers.{layer}.mlp.down_proj"]
        # neighbours that are not residual-writing: must be left alone
        tensors[f"{prefix}layers.{layer}.mlp.up_proj.weight"] = torch.randn(320, HIDDEN, generator=gen).bfloat16()
    tensors["mtp.layers.0.mlp.down_proj.weight"] = torch.randn(HIDDEN, 320, generator=gen).bfloat16()
    for module in modules:
        kind = ".".join(module.split(".")[-2:])
        module_fmt = fmt if isinstance(fmt, str) else fmt[kind]
        w = torch.randn(HIDDEN, IN_FEATURES[kind], generator=gen) * 0.05
        stored, ref = stored_module(module, module_fmt, w)
        tensors.update(stored)
        reference[module] = ref
    config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": HIDDEN}
    write_checkpoint(directory, {"model.safetensors": tensors}, config=config)
    seal(directory, fmt=fmt, prefix=prefix, seed=seed)
    return reference


def make_directions(path: Path, modules: list[str], *, seed: int = 1, size: int = HIDDEN) -> tuple[dict, dict]:
    """A directions file at ``path``, its directory sealed as an imported artifact would be."""
    gen = torch.Generator().manual_seed(seed)
    vectors, coefs = {}, {}
    for module in modules:
        r = torch.randn(size, generator=gen)
        vectors[module] = r / r.norm()
        coefs[module] = float(torch.rand((), generator=gen)) * 2 + 0.25
    write_directions(path, vectors, coefs)
    seal(path.parent, seed=seed)
    return vectors, coefs


@pytest.fixture
def bf16_model(tmp_path):
    model = tmp_path / "base"
    reference = make_checkpoint(model, "bf16")
    directions = tmp_path / "directions" / "directions.safetensors"
    make_directions(directions, list(reference))
    return model, directions, reference


# ---------------------------------------------------------------------------------------
# The algebra


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_reproduces_the_projection_for_every_module_type(tmp_path, fmt):
    model = tmp_path / "base"
    reference = make_checkpoint(model, fmt)
    vectors, coefs = make_directions(tmp_path / "dirs" / "d.safetensors", list(reference))
    record = build_adapter(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "lora", row_chunk=50)
    assert record["formats"] == {fmt: len(reference)}
    lora = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    kinds_seen = set()
    for module, w in reference.items():
        a_name, b_name = lora_tensor_names(module)
        a, b = lora[a_name], lora[b_name]
        assert a.dtype == b.dtype == torch.float32
        assert a.shape == (1, w.shape[1]) and b.shape == (w.shape[0], 1)
        r, c = vectors[module].double(), coefs[module]
        x = torch.randn(w.shape[1], 7, dtype=torch.float64)
        wd = w.double()
        projected = wd @ x - c * torch.outer(r, r @ (wd @ x))  # y - c r (r^T y)
        merged = (w + b @ a) @ x.float()  # (W + B A) x, all fp32
        torch.testing.assert_close(merged.double(), projected, rtol=1e-5, atol=1e-5 * float(projected.abs().max()))
        kinds_seen.add(".".join(module.split(".")[-2:]))
    assert kinds_seen == {"linear_attn.out_proj", "self_attn.o_proj", "mlp.down_proj"}


def test_mixed_formats_as_in_the_spark_checkpoint(tmp_path):
    # RadixArk's mix: static FP8 for out_proj / o_proj, packed NVFP4 for down_proj
    model = tmp_path / "base"
    fmt = {"linear_attn.out_proj": "fp8-tensor", "self_attn.o_proj": "fp8-channel", "mlp.down_proj": "nvfp4-modelopt"}
    reference = make_checkpoint(model, fmt, prefix="model.language_model.")
    vectors, _ = make_directions(tmp_path / "dirs" / "d.safetensors", list(reference))
    record = build_adapter(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "lora")
    assert record["formats"] == {"fp8-tensor": 3, "fp8-channel": 1, "nvfp4-modelopt": 4}
    lora = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    for module, w in reference.items():
        a_name, _ = lora_tensor_names(module)
        torch.testing.assert_close(
            lora[a_name][0].double(), vectors[module].double() @ w.double(), rtol=1e-5, atol=1e-6
        )


def test_row_chunk_does_not_change_the_result(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    one_record = build_adapter(model, directions, tmp_path / "one", row_chunk=1)
    many_record = build_adapter(model, directions, tmp_path / "many", row_chunk=10_000)
    assert one_record["base"]["weights_read_sha256"] == many_record["base"]["weights_read_sha256"]
    one = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    many = load_file(str(tmp_path / "many" / "adapter_model.safetensors"))
    for name in one:
        torch.testing.assert_close(one[name], many[name], rtol=1e-6, atol=1e-7)


def test_the_same_inputs_give_the_same_adapter_bytes(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    first = build_adapter(model, directions, tmp_path / "a")
    second = build_adapter(model, directions, tmp_path / "b")
    assert first["adapter"]["sha256"] == second["adapter"]["sha256"]


# ---------------------------------------------------------------------------------------
# What vLLM 0.28.0 makes of the tensor names


def _vllm_module_names(adapter_dir: Path, architecture: str) -> dict[str, tuple]:
    """Module name -> (A shape, B shape) as vLLM's own LoRA loader parses the adapter."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.models import qwen3_5

    model_cls = getattr(qwen3_5, architecture)
    peft = PEFTHelper.from_local_dir(str(adapter_dir), max_position_embeddings=4096)
    lora = LoRAModel.from_local_checkpoint(
        str(adapter_dir),
        expected_lora_modules={"out_proj", "o_proj", "down_proj"},
        peft_helper=peft,
        lora_model_id=1,
        device="cpu",
        weights_mapper=model_cls.hf_to_vllm_mapper.get_unstacked_mapper(),
    )
    assert peft.r == 1 and peft.vllm_lora_scaling_factor == 1.0
    return {name: (tuple(w.lora_a.shape), tuple(w.lora_b.shape)) for name, w in lora.loras.items()}


@pytest.mark.parametrize(
    ("prefix", "architecture", "vllm_prefix"),
    [
        ("model.", "Qwen3_5ForCausalLM", "model."),
        ("model.language_model.", "Qwen3_5ForCausalLM", "model."),
        ("model.language_model.", "Qwen3_5ForConditionalGeneration", "language_model.model."),
    ],
)
def test_vllm_maps_every_adapter_tensor_onto_its_qwen35_module(tmp_path, prefix, architecture, vllm_prefix):
    model = tmp_path / "base"
    reference = make_checkpoint(model, "bf16", prefix=prefix)
    make_directions(tmp_path / "dirs" / "d.safetensors", list(reference))
    build_adapter(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "lora")
    parsed = _vllm_module_names(tmp_path / "lora", architecture)
    expected = {
        vllm_prefix + module[len(prefix) :]: ((1, w.shape[1]), (w.shape[0], 1)) for module, w in reference.items()
    }
    assert parsed == expected


def test_a_checkpoint_with_a_vision_tower_gets_lora_on_its_language_model_alone(tmp_path):
    """The generated tiny-vision target (hub names: `model.language_model.*` and a tower under
    `model.visual.*`, whose `attn.proj` and `linear_fc2` write its own residual): the adapter
    covers the decoder layers only, and vLLM puts every tensor on Qwen3_5ForConditionalGeneration's
    language model (`language_model.model.*`), the part vLLM applies LoRA to by default."""
    from prepare.generate import DEFAULT_SEED, generate_model
    from prepare.generate import write_directions as generate_directions
    from prepare.synthetic import TINY_VISION, TINY_VISION_PRESET

    model = generate_model(tmp_path / "target", TINY_VISION_PRESET, "qwen3.8-27b-bf16")
    assert any(m.startswith("model.visual.blocks.") for m in linear_modules(open_checkpoint(model)))
    generate_directions(tmp_path / "directions", model, TINY_VISION, DEFAULT_SEED)
    record = build_adapter(model, tmp_path / "directions", tmp_path / "lora")
    modules = [m["module"] for m in record["modules"]]
    assert len(modules) == 8 and all(m.startswith("model.language_model.layers.") for m in modules)
    parsed = _vllm_module_names(tmp_path / "lora", "Qwen3_5ForConditionalGeneration")
    assert set(parsed) == {"language_model.model." + m.removeprefix("model.language_model.") for m in modules}


def test_adapter_config_is_a_rank_1_alpha_1_peft_lora_of_exactly_the_targets(tmp_path, bf16_model):
    model, directions, reference = bf16_model
    build_adapter(model, directions, tmp_path / "lora")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 1 and config["lora_alpha"] == 1
    assert config["bias"] == "none" and not config["use_dora"] and not config["use_rslora"]
    assert sorted(config["target_modules"]) == sorted(reference)


def test_mtp_and_non_residual_modules_are_not_targets(tmp_path):
    reference = make_checkpoint(tmp_path, "bf16")
    targets = target_modules(open_checkpoint(tmp_path))
    assert targets == list(reference)  # layer order, mixer before MLP
    assert not any(t.startswith("mtp.") or t.endswith("up_proj") for t in targets)
    assert len(targets) == 8


# ---------------------------------------------------------------------------------------
# Records and binding


def test_manifest_identity_derives_from_the_base_and_directions_inputs(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    write_manifest(model, ArtifactIdentity(artifact="tiny-test", source="hub", repo="test/tiny", revision="0" * 40))
    record = build_adapter(model, directions, tmp_path / "lora")
    out = tmp_path / "lora"
    assert record["adapter"]["sha256"] == sha256_file(out / "adapter_model.safetensors")
    assert record["directions"]["sha256"] == sha256_file(directions)
    assert json.loads((out / CONVERSION_FILE).read_text()) == record
    manifest = read_manifest(out)
    assert manifest.identity == DerivedIdentity(
        transform=TRANSFORM,
        transform_version=TRANSFORM_VERSION,
        params={"row_chunk": 512},
        inputs=(input_ref(model, "model"), input_ref(directions.parent, "directions")),
    )
    assert manifest.identity.inputs[0].identity.revision == "0" * 40
    assert manifest.identity.inputs[1].manifest_digest == read_manifest(directions.parent).digest
    assert {f.path for f in manifest.files} == {"adapter_config.json", "adapter_model.safetensors", CONVERSION_FILE}
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("test/tiny", "0" * 40)
    assert verify_adapter_binding(out, model) == manifest.identity


def test_the_directions_directory_names_its_one_file(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    by_file = build_adapter(model, directions, tmp_path / "a")
    by_dir = build_adapter(model, directions.parent, tmp_path / "b")
    assert by_dir == by_file
    assert read_manifest(tmp_path / "a").identity == read_manifest(tmp_path / "b").identity


def test_verify_refuses_an_adapter_built_from_another_base(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    build_adapter(model, directions, tmp_path / "lora")
    other = tmp_path / "other"
    make_checkpoint(other, "bf16", seed=5)
    with pytest.raises(VerifyError, match="built from test-v1#") as info:
        verify_adapter_binding(tmp_path / "lora", other)
    assert "\n" not in str(info.value) and str(other) in str(info.value)


def test_verify_refuses_when_the_base_manifest_changed(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    write_manifest(model, ArtifactIdentity(artifact="tiny-test", source="hub", repo="test/tiny", revision="a" * 40))
    build_adapter(model, directions, tmp_path / "lora")
    write_manifest(model, ArtifactIdentity(artifact="tiny-test", source="hub", repo="test/tiny", revision="b" * 40))
    with pytest.raises(VerifyError, match="built from tiny-test@aaaaaaaaaaaa#") as info:
        verify_adapter_binding(tmp_path / "lora", model)
    assert "tiny-test@bbbbbbbbbbbb#" in str(info.value)


def test_verify_refuses_a_directory_that_is_not_an_adapter_build(tmp_path, bf16_model):
    model, _, _ = bf16_model
    with pytest.raises(VerifyError, match="identity expected a `adapter-build` output, found test-v1"):
        verify_adapter_binding(model, model)


# ---------------------------------------------------------------------------------------
# Inputs: identified directories only, in step with their manifests


def test_a_base_without_a_manifest_is_refused(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    (model / MANIFEST_NAME).unlink()
    msg = _refused(model, directions, tmp_path / "o")
    assert msg.startswith("model input: ") and "identified inputs only" in msg and "qwen38 prepare download" in msg


def test_directions_outside_an_identified_directory_are_refused(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "d.safetensors").write_bytes(directions.read_bytes())
    msg = _refused(model, loose / "d.safetensors", tmp_path / "o")
    assert (
        msg.startswith("directions input: ") and "qwen38 prepare download qwen3.8-27b-mode-b-directions --from" in msg
    )


def test_directions_changed_after_their_import_are_refused(tmp_path, bf16_model):
    model, directions, reference = bf16_model
    make_directions(tmp_path / "other" / "d.safetensors", list(reference), seed=7)
    manifest_before = (directions.parent / MANIFEST_NAME).read_bytes()
    directions.write_bytes((tmp_path / "other" / "d.safetensors").read_bytes())  # same size, other bytes
    assert (directions.parent / MANIFEST_NAME).read_bytes() == manifest_before
    msg = _refused(model, directions, tmp_path / "o")
    assert f"{directions}: sha256 " in msg and "its qwen38-manifest.json lists" in msg


@pytest.mark.parametrize("change", ["truncated", "extra file"])
def test_a_base_out_of_step_with_its_manifest_is_refused(tmp_path, bf16_model, change):
    model, directions, _ = bf16_model
    if change == "truncated":
        with open(model / "model.safetensors", "r+b") as handle:
            handle.truncate(100)
        expected = "model.safetensors: size expected"
    else:
        save_file({"model.layers.9.mlp.down_proj.weight": torch.zeros(HIDDEN, 4)}, str(model / "extra.safetensors"))
        expected = "extra.safetensors: not in"
    msg = _refused(model, directions, tmp_path / "o")
    assert expected in msg
    assert not (tmp_path / "o").exists()


def test_an_output_inside_an_input_is_refused(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    assert "overlaps the input" in _refused(model, directions, model / "lora", force=True)
    assert "overlaps the input" in _refused(model, directions, model, force=True)
    assert read_manifest(model).identity.generator == "test"


# ---------------------------------------------------------------------------------------
# Refusals: one clear line each, nothing written


def _refused(*args, **kwargs) -> str:
    with pytest.raises(AdapterError) as info:
        build_adapter(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_non_empty_output_is_refused_without_force_and_replaced_with_it(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    out = tmp_path / "lora"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "not empty; pass --force" in _refused(model, directions, out)
    assert (out / "keep.txt").exists()
    build_adapter(model, directions, out, force=True)
    assert not (out / "keep.txt").exists()
    assert (out / "adapter_model.safetensors").is_file()


def test_a_failed_build_leaves_the_previous_adapter_untouched(tmp_path, bf16_model):
    model, directions, reference = bf16_model
    out = tmp_path / "lora"
    build_adapter(model, directions, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # a direction of the wrong length for the last module: refused, old adapter intact
    vectors = {m: torch.ones(HIDDEN) for m in reference}
    vectors[list(reference)[-1]] = torch.ones(HIDDEN + 1)
    write_directions(tmp_path / "bad" / "d.safetensors", vectors, {m: 1.0 for m in reference})
    seal(tmp_path / "bad")
    assert "has 193 values, the module's output size is 192" in _refused(
        model, tmp_path / "bad" / "d.safetensors", out, force=True
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_direction_for_an_unknown_module_is_refused(tmp_path, bf16_model):
    model, _, reference = bf16_model
    modules = list(reference) + ["model.layers.9.mlp.down_proj"]
    make_directions(tmp_path / "dirs" / "d.safetensors", modules)
    assert "unknown module 'model.layers.9.mlp.down_proj'" in _refused(
        model, tmp_path / "dirs" / "d.safetensors", tmp_path / "o"
    )


def test_a_direction_for_a_non_residual_module_is_refused(tmp_path, bf16_model):
    model, _, reference = bf16_model
    make_directions(tmp_path / "dirs" / "d.safetensors", list(reference) + ["model.layers.0.mlp.up_proj"])
    assert "not one of the residual-writing modules" in _refused(
        model, tmp_path / "dirs" / "d.safetensors", tmp_path / "o"
    )


def test_directions_with_the_wrong_name_prefix_are_refused_naming_the_checkpoints(tmp_path, bf16_model):
    model, _, reference = bf16_model
    vl_names = [m.replace("model.", "model.language_model.", 1) for m in reference]
    make_directions(tmp_path / "dirs" / "d.safetensors", vl_names)
    msg = _refused(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "o")
    assert "has no such module" in msg and "model.layers.N" in msg


def test_missing_directions_are_refused(tmp_path, bf16_model):
    model, _, reference = bf16_model
    make_directions(tmp_path / "dirs" / "d.safetensors", list(reference)[:-1])
    assert "no direction for 1 of the 8" in _refused(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "o")


def test_a_missing_scale_is_refused_before_anything_is_written(tmp_path):
    model = tmp_path / "base"
    reference = make_checkpoint(model, "nvfp4-modelopt")
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["model.layers.2.mlp.down_proj.weight_scale_2"]
    write_checkpoint(model, {"model.safetensors": tensors})
    seal(model)
    make_directions(tmp_path / "dirs" / "d.safetensors", list(reference))
    msg = _refused(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "o")
    assert "model.layers.2.mlp.down_proj" in msg and "weight_scale_2" in msg
    assert not (tmp_path / "o").exists()


def test_a_model_without_target_modules_is_refused(tmp_path):
    model = tmp_path / "base"
    write_checkpoint(model, {"model.safetensors": {"encoder.dense.weight": torch.zeros(4, 4)}})
    seal(model)
    write_directions(tmp_path / "dirs" / "d.safetensors", {"encoder.dense": torch.ones(4)}, {"encoder.dense": 1.0})
    seal(tmp_path / "dirs")
    assert "no residual-writing modules" in _refused(model, tmp_path / "dirs" / "d.safetensors", tmp_path / "o")


def test_hidden_size_disagreeing_with_config_is_refused(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    (model / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    seal(model)
    assert "hidden_size is 4096" in _refused(model, directions, tmp_path / "o")


def test_non_positive_row_chunk_is_refused(tmp_path, bf16_model):
    model, directions, _ = bf16_model
    assert "--row-chunk" in _refused(model, directions, tmp_path / "o", row_chunk=0)


# ---------------------------------------------------------------------------------------
# The CLI


def test_cli_builds_and_verifies(tmp_path, bf16_model, capsys):
    model, directions, _ = bf16_model
    out = tmp_path / "lora"
    assert main(["adapter", "build", "--model", str(model), "--directions", str(directions), "--out", str(out)]) == 0
    assert "8 modules (8 bf16)" in capsys.readouterr().out
    assert main(["adapter", "verify", "--adapter", str(out), "--model", str(model)]) == 0


def test_cli_prints_one_line_and_exits_non_zero_on_refusal(tmp_path, bf16_model, capsys):
    model, directions, _ = bf16_model
    out = tmp_path / "lora"
    out.mkdir()
    (out / "x").write_text("x")
    rc = main(["adapter", "build", "--model", str(model), "--directions", str(directions), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("qwen38: adapter: ") and "Traceback" not in err
