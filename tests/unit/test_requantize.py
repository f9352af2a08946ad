"""`qwen38 prepare requantize` on tiny checkpoints in the real tensor layout."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors import safe_open

from core.checkpoint import open_checkpoint
from core.errors import PrepareError
from core.identity import ArtifactIdentity, DerivedIdentity, InputRef
from core.manifest import MANIFEST_NAME, read_manifest, sha256_file, write_manifest
from prepare.checkpoint_writer import write_checkpoint
from prepare.generate import generate_model
from prepare.requantize import TRANSFORM_VERSION, requantize_checkpoint
from tests.conftest import run_cli_here

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """The generator's tiny-vl targets, as a plain checkpoint (no manifest: a local directory)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in ("bf16", "w4a16"):
        out[kind] = generate_model(root / kind, "tiny-vl", f"qwen3.8-27b-{kind}")
        (out[kind] / MANIFEST_NAME).unlink()
    return out


def pinned_identity(key: str, revision: str) -> ArtifactIdentity:
    return ArtifactIdentity(artifact=key, source="hub", repo=f"org/{key}", revision=revision)


def tree_digest(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(directory)
    assert checkpoint.source == "index"
    out = {}
    for shard in sorted(checkpoint.shards):
        with safe_open(str(directory / shard), "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    assert set(out) == set(checkpoint.weight_map)
    return out


def cli(*args: str) -> subprocess.CompletedProcess:
    """`qwen38 prepare requantize ARGS` through the command line's own entry point, in this
    process (`tests.conftest.run_cli_here`): a new Python spent ~3.5 s importing the command
    before its second of work. The command as a process of its own is what `kill_while_writing`
    starts (and kills)."""
    return run_cli_here("prepare", "requantize", *args, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("kind", ["bf16", "w4a16"])
def test_requantized_tensors_decompress_through_compressed_tensors(targets, tmp_path, kind):
    src = targets[kind]
    before = tensors_of(src)
    result = requantize_checkpoint(src, tmp_path / "out", ["lm_head", "embed_tokens", "mtp"])
    after = tensors_of(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])

    quantized = [r.name[: -len(".weight")] for r in result.tensors]
    assert "lm_head" in quantized and "model.language_model.embed_tokens" in quantized
    assert "mtp.fc" in quantized and "mtp.layers.0.self_attn.q_proj" in quantized
    for module in quantized:
        original = before[f"{module}.weight"]
        assert f"{module}.weight" not in after
        packed, scale, shape = (after[f"{module}.weight_{s}"] for s in ("packed", "scale", "shape"))
        assert packed.dtype == torch.int32 and packed.shape == (original.shape[0], original.shape[1] // 4)
        assert scale.dtype == (torch.float16 if module == "lm_head" else torch.bfloat16)
        assert scale.shape == (original.shape[0], original.shape[1] // 128)
        assert shape.dtype == torch.int64 and shape.tolist() == list(original.shape)
        group = next(g for name, g in qconfig.config_groups.items() if name.startswith("int8_") and _targets(g, module))
        restored = PackedQuantizationCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": shape}, group
        )["weight"]
        error = (restored - original.float()).norm() / original.float().norm()
        assert error < 0.01, (module, float(error))
    # everything else is carried over bit for bit
    for name, tensor in before.items():
        if name[: -len(".weight")] not in quantized:
            assert torch.equal(after[name], tensor), name


def _targets(scheme: QuantizationScheme, module: str) -> bool:
    return any(t == module or (t.startswith("re:") and re.match(t[3:], module)) for t in scheme.targets)


def test_config_groups_come_first_and_ignore_no_longer_names_requantized_modules(targets, tmp_path):
    requantize_checkpoint(targets["w4a16"], tmp_path / "out", ["lm_head", "mtp"])
    before = json.loads((targets["w4a16"] / "config.json").read_text())["quantization_config"]
    after = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert list(after["config_groups"]) == ["int8_lm_head", "int8_mtp", *before["config_groups"]]
    assert after["config_groups"]["int8_lm_head"]["targets"] == ["re:.*lm_head$"]
    assert after["config_groups"]["int8_lm_head"]["weights"]["num_bits"] == 8
    assert after["config_groups"]["group_0"] == before["config_groups"]["group_0"]
    assert "lm_head" in before["ignore"] and "lm_head" not in after["ignore"]
    # the MTP regex was replaced by the MTP modules still ignored: none (all requantized)
    assert not any(entry.startswith("re:^mtp") or entry.startswith("mtp.") for entry in after["ignore"])
    assert [e for e in after["ignore"] if "in_proj" in e] == [e for e in before["ignore"] if "in_proj" in e]


def test_vllm_compressed_tensors_config_picks_int8_for_lm_head_and_embed(targets, tmp_path):
    from torch import nn
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM

    requantize_checkpoint(targets["w4a16"], tmp_path / "out", ["lm_head", "embed_tokens"])
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    config = CompressedTensorsConfig.from_config(qc)
    config.apply_vllm_mapper(Qwen3_5ForCausalLM.hf_to_vllm_mapper)
    layer = nn.Linear(1, 1)
    for name in ("lm_head", "model.embed_tokens"):
        weights = config.get_scheme_dict(layer, name)["weights"]
        assert (weights.num_bits, weights.strategy, weights.group_size, weights.symmetric) == (8, "group", 128, True)
        assert config.get_scheme_dict(layer, name)["format"] == "pack-quantized"
    down = config.get_scheme_dict(layer, "model.layers.0.mlp.down_proj")["weights"]
    assert down.num_bits == 4
    assert config.get_scheme_dict(layer, "model.layers.0.linear_attn.in_proj_a") is None


def test_input_stays_byte_identical_and_untouched_shards_are_linked(targets, tmp_path):
    src = targets["w4a16"]
    digest = tree_digest(src)
    result = requantize_checkpoint(src, tmp_path / "out")
    assert tree_digest(src) == digest
    assert result.placed["model-00002-of-00003.safetensors"] in ("reflink", "hardlink", "copy")
    assert set(result.written) == {
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "config.json",
        "model.safetensors.index.json",
    }
    untouched = "model-00002-of-00003.safetensors"
    assert sha256_file(tmp_path / "out" / untouched) == digest[untouched]
    if result.placed[untouched] == "hardlink":
        assert (tmp_path / "out" / untouched).stat().st_ino == (src / untouched).stat().st_ino
    manifest = read_manifest(tmp_path / "out")
    assert manifest.identity.transform == "requantize-int8"
    assert manifest.identity.params["targets"] == ["lm_head", "embed_tokens"]
    assert {f.path for f in manifest.files} == set(tree_digest(tmp_path / "out")) - {MANIFEST_NAME}
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    sizes = sum(t.numel() * t.element_size() for t in tensors_of(tmp_path / "out").values())
    assert index["metadata"]["total_size"] == sizes


def test_same_input_gives_byte_identical_output(targets, tmp_path):
    requantize_checkpoint(targets["bf16"], tmp_path / "one", ["lm_head", "embed_tokens", "mtp"], workers=1)
    requantize_checkpoint(targets["bf16"], tmp_path / "two", ["mtp", "embed_tokens", "lm_head"], workers=3)
    assert tree_digest(tmp_path / "one") == tree_digest(tmp_path / "two")


def test_rerun_on_complete_output_does_nothing_and_says_so(targets, tmp_path):
    out = tmp_path / "out"
    first = cli("--model", str(targets["bf16"]), "--out", str(out))
    assert first.returncode == 0, first.stderr
    stamps = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    again = cli("--model", str(targets["bf16"]), "--out", str(out))
    assert again.returncode == 0 and "up to date" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_new_options_rebuild_the_output_whole(targets, tmp_path):
    out = tmp_path / "out"
    requantize_checkpoint(targets["bf16"], out, ["lm_head"])
    result = requantize_checkpoint(targets["bf16"], out, ["lm_head", "embed_tokens"])
    assert not result.up_to_date
    assert "model.language_model.embed_tokens.weight_packed" in tensors_of(out)
    assert read_manifest(out).identity.params["targets"] == ["lm_head", "embed_tokens"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".incomplete", ".old"))]


def test_single_file_checkpoint_without_quantization_config(tmp_path):
    src = tmp_path / "single"
    g = torch.Generator().manual_seed(0)
    tensors = {
        "lm_head.weight": torch.randn(64, 256, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(256, dtype=torch.bfloat16),
    }
    write_checkpoint(src, {"model.safetensors": tensors}, config={"architectures": ["X"], "tie_word_embeddings": False})
    requantize_checkpoint(src, tmp_path / "out", ["lm_head"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", MANIFEST_NAME]
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and list(qc["config_groups"]) == ["int8_lm_head"]
    QuantizationConfig.model_validate(qc)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [
            "lm_head.weight_packed",
            "lm_head.weight_scale",
            "lm_head.weight_shape",
            "model.norm.weight",
        ]


def test_refusals_name_the_problem(targets, tmp_path):
    with pytest.raises(PrepareError, match="overlaps the input"):
        requantize_checkpoint(targets["bf16"], targets["bf16"] / "prepared")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not ours")
    with pytest.raises(PrepareError, match="not a requantize-int8 output"):
        requantize_checkpoint(targets["bf16"], foreign)
    assert (foreign / "keep.txt").read_text() == "not ours"
    requantize_checkpoint(targets["bf16"], tmp_path / "once", ["lm_head"])
    with pytest.raises(PrepareError, match="already quantized"):
        requantize_checkpoint(tmp_path / "once", tmp_path / "twice", ["lm_head"])
    bad = cli("--model", str(targets["bf16"]), "--out", str(tmp_path / "x"), "--only", "lm_head,vision")
    assert (
        bad.returncode == 2 and bad.stderr.count("\n") == 1 and "vision" in bad.stderr and "Traceback" not in bad.stderr
    )


def test_input_that_disagrees_with_its_manifest_is_refused(targets, tmp_path):
    src = tmp_path / "download"
    subprocess.run(["cp", "-r", str(targets["bf16"]), str(src)], check=True)
    write_manifest(src, pinned_identity("tiny", "0" * 40))
    with open(src / "model-00002-of-00003.safetensors", "ab") as handle:
        handle.write(b"x")
    with pytest.raises(PrepareError, match="re-verify the download"):
        requantize_checkpoint(src, tmp_path / "out")


def test_input_manifest_identity_is_recorded(targets, tmp_path):
    src = tmp_path / "download"
    subprocess.run(["cp", "-r", str(targets["bf16"]), str(src)], check=True)
    source = write_manifest(src, pinned_identity("qwen3.8-27b-w4a16", "a" * 40))
    requantize_checkpoint(src, tmp_path / "out")
    identity = read_manifest(tmp_path / "out").identity
    assert isinstance(identity, DerivedIdentity)
    assert (identity.transform, identity.transform_version) == ("requantize-int8", TRANSFORM_VERSION)
    assert identity.params == {
        "targets": ["lm_head", "embed_tokens"],
        "group_size": 128,
        "num_bits": 8,
        "scale_dtypes": {"lm_head": "F16", "embed_tokens": "BF16"},
    }
    assert identity.inputs == (
        InputRef(role="model", identity=pinned_identity("qwen3.8-27b-w4a16", "a" * 40), manifest_digest=source.digest),
    )
    assert identity.artifacts() == [(pinned_identity("qwen3.8-27b-w4a16", "a" * 40), source.digest)]


def manifested_copy(src: Path, dst: Path):
    """``src`` as a verified download would hold it: a copy with its artifact manifest."""
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return write_manifest(dst, pinned_identity("qwen3.8-27b-w4a16", "a" * 40))


def test_linked_files_keep_the_input_manifest_hash_and_only_written_files_are_hashed(targets, tmp_path, monkeypatch):
    import core.manifest

    src = tmp_path / "download"
    source = manifested_copy(targets["w4a16"], src)
    hashed: list[str] = []
    real_hash_files = core.manifest.hash_files

    def recording_hash_files(paths, **kwargs):
        paths = list(paths)
        hashed.extend(p.name for p in paths)
        return real_hash_files(paths, **kwargs)

    monkeypatch.setattr(core.manifest, "hash_files", recording_hash_files)
    result = requantize_checkpoint(src, tmp_path / "out")
    assert set(result.placed.values()) == {"hardlink"}, "this test needs a filesystem with hard links"
    assert sorted(hashed) == sorted(result.written)  # the linked shard and tokenizer files were not read
    manifest = read_manifest(tmp_path / "out")
    for entry in manifest.files:
        assert sha256_file(tmp_path / "out" / entry.path) == entry.sha256, entry.path
        if entry.path in result.placed:
            assert entry == source.by_path()[entry.path]


def test_an_input_shard_altered_after_its_download_is_refused_and_nothing_is_installed(targets, tmp_path):
    src = tmp_path / "download"
    source = manifested_copy(targets["w4a16"], src)
    shard = src / "model-00003-of-00003.safetensors"  # holds lm_head: rewritten, so read
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # same size: the cheap size check cannot see it
    shard.write_bytes(data)
    expected = source.by_path()[shard.name].sha256
    with pytest.raises(PrepareError, match=f"sha256 expected {expected} \\(its manifest\\), found "):
        requantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".incomplete")]


def test_an_altered_linked_input_file_keeps_its_pinned_hash_so_verification_fails(targets, tmp_path):
    src = tmp_path / "download"
    source = manifested_copy(targets["w4a16"], src)
    linked = "model-00002-of-00003.safetensors"
    data = bytearray((src / linked).read_bytes())
    data[-1] ^= 0x01
    (src / linked).write_bytes(data)
    requantize_checkpoint(src, tmp_path / "out")
    recorded = read_manifest(tmp_path / "out").by_path()[linked].sha256
    # The output vouches for the pinned bytes, not the altered ones: verify of it fails.
    assert recorded == source.by_path()[linked].sha256
    assert recorded != sha256_file(tmp_path / "out" / linked)


def test_an_input_without_a_manifest_is_identified_by_its_content_or_refused(targets, tmp_path):
    from core.hashing import hash_files
    from core.identity import GeneratedIdentity
    from core.manifest import ManifestFile, build_manifest, content_files

    src = targets["bf16"]
    requantize_checkpoint(src, tmp_path / "out", ["lm_head"])
    identity = read_manifest(tmp_path / "out").identity
    local = GeneratedIdentity(generator="local", generator_version="1")
    files = content_files(src)
    digests = hash_files(files)
    would_be = build_manifest(
        local,
        [ManifestFile(path=p.relative_to(src).as_posix(), size=p.stat().st_size, sha256=digests[p]) for p in files],
    )
    assert identity.inputs == (InputRef(role="model", identity=local, manifest_digest=would_be.digest),)
    assert not (src / MANIFEST_NAME).exists()  # the input is only read
    # Content, not location: the same bytes elsewhere give the same output, byte for byte.
    moved = tmp_path / "moved"
    subprocess.run(["cp", "-r", str(src), str(moved)], check=True)
    requantize_checkpoint(moved, tmp_path / "again", ["lm_head"])
    assert tree_digest(tmp_path / "again") == tree_digest(tmp_path / "out")
    # Other bytes: another identity, so the output is rebuilt.
    (moved / "generation_config.json").write_text("{}")
    assert not requantize_checkpoint(moved, tmp_path / "again", ["lm_head"]).up_to_date
    with pytest.raises(PrepareError, match="has no qwen38-manifest.json, so nothing vouches for its content"):
        requantize_checkpoint(src, tmp_path / "profile-run", ["lm_head"], allow_unmanifested_input=False)


def test_an_input_with_a_broken_manifest_or_an_unlisted_file_is_refused(targets, tmp_path):
    src = tmp_path / "download"
    manifested_copy(targets["bf16"], src)
    (src / "stray.safetensors").write_bytes(b"x")
    with pytest.raises(PrepareError, match="stray.safetensors: not in .*qwen38-manifest.json \\(expected absent\\)"):
        requantize_checkpoint(src, tmp_path / "out")
    (src / "stray.safetensors").unlink()
    manifest = json.loads((src / MANIFEST_NAME).read_text())
    manifest["files"][0]["size"] += 1
    (src / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(PrepareError, match="edited by hand.*the input cannot be identified"):
        requantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ crash safety


def big_checkpoint(directory: Path) -> Path:
    """A checkpoint whose lm_head takes a few seconds to requantize (kill window)."""
    directory.mkdir()
    g = torch.Generator().manual_seed(7)
    write_checkpoint(
        directory,
        {
            "a.safetensors": {"model.embed_tokens.weight": torch.randn(4096, 1024, generator=g).to(torch.bfloat16)},
            "b.safetensors": {"lm_head.weight": torch.randn(131072, 1024, generator=g).to(torch.bfloat16)},
        },
        config={"architectures": ["X"], "tie_word_embeddings": False},
    )
    return directory


def kill_while_writing(src: Path, dst: Path, only: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "entrypoint.cli",
            "prepare",
            "requantize",
            "--model",
            str(src),
            "--out",
            str(dst),
            "--only",
            only,
            "--workers",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            staged = list(dst.parent.glob(f".{dst.name}.*.incomplete/b.safetensors"))
            if staged and staged[0].stat().st_blocks > 0:
                break
            assert proc.poll() is None, "the run finished before it could be killed"
            time.sleep(0.02)
        else:
            raise AssertionError("no staged shard appeared")
        time.sleep(0.1)  # mid-quantization
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()


def verify(directory: Path) -> dict:
    manifest = read_manifest(directory)
    for item in manifest.files:
        assert sha256_file(directory / item.path) == item.sha256, item.path
    return manifest


def test_kill_mid_step_leaves_old_state_and_a_rerun_completes(tmp_path):
    src = big_checkpoint(tmp_path / "src")
    reference = tmp_path / "reference"
    requantize_checkpoint(src, reference, ["lm_head", "embed_tokens"])

    dst = tmp_path / "prepared"
    kill_while_writing(src, dst, "lm_head")  # first build killed: no output at all
    assert not dst.exists()
    assert cli("--model", str(src), "--out", str(dst), "--only", "lm_head").returncode == 0
    old = verify(dst)
    assert old.identity.params["targets"] == ["lm_head"]

    kill_while_writing(src, dst, "lm_head,embed_tokens")  # rebuild killed: the old output, whole
    assert verify(dst) == old
    rerun = cli("--model", str(src), "--out", str(dst), "--only", "lm_head,embed_tokens")
    assert rerun.returncode == 0, rerun.stderr
    verify(dst)
    assert tree_digest(dst) == tree_digest(reference)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepared.") and not p.name.endswith(".lock")]
