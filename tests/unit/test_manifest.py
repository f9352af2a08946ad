"""Manifests and identities: written from real files, typed, digest-protected."""

from __future__ import annotations

import hashlib
import json

import pytest

from core.errors import PrepareError
from core.hashing import git_blob_sha1, hash_files, sha256_file
from core.identity import ArtifactIdentity, DerivedIdentity, GeneratedIdentity
from core.manifest import MANIFEST_NAME, ManifestError, input_ref, read_manifest, write_manifest
from tests.pinning_support import write_model_files

TINY = GeneratedIdentity(generator="tiny", generator_version="1", params={"seed": 0})


def test_manifest_lists_every_real_file_with_size_and_sha256(tmp_path):
    files = write_model_files(tmp_path / "m")
    manifest = write_manifest(tmp_path / "m", TINY)
    assert [f.path for f in manifest.files] == sorted(files)
    for entry in manifest.files:
        assert entry.size == len(files[entry.path])
        assert entry.sha256 == hashlib.sha256(files[entry.path]).hexdigest()
    assert read_manifest(tmp_path / "m") == manifest


def test_hidden_files_and_the_manifest_itself_are_not_content(tmp_path):
    d = tmp_path / "m"
    write_model_files(d, shards=1)
    (d / ".qwen38-staging").mkdir()
    (d / ".qwen38-staging" / "x.part").write_bytes(b"partial")
    (d / ".cache").mkdir()
    (d / ".cache" / "y").write_bytes(b"tool cache")
    manifest = write_manifest(d, TINY)
    paths = [f.path for f in manifest.files]
    assert MANIFEST_NAME not in paths and not any(p.startswith(".") for p in paths)
    assert "config.json" in paths


def test_files_in_subdirectories_are_listed_with_posix_paths(tmp_path):
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "a.bin").write_bytes(b"a")
    assert [f.path for f in write_manifest(d, TINY).files] == ["sub/a.bin"]


def test_a_digest_edit_by_hand_is_detected(tmp_path):
    d = tmp_path / "m"
    write_model_files(d, shards=1)
    write_manifest(d, TINY)
    data = json.loads((d / MANIFEST_NAME).read_text())
    data["files"][0]["sha256"] = "0" * 64
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="edited by hand: its content digests to [0-9a-f]{64}, the recorded"):
        read_manifest(d)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "not valid JSON"),
        ('{"version": 1}', "identity: Field required"),
        ('{"version": 1, "identity": {"kind": "nope"}, "files": [], "digest": ""}', "identity"),
    ],
)
def test_malformed_manifest_is_one_line(tmp_path, text, expected):
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError) as exc:
        read_manifest(tmp_path)
    assert "\n" not in str(exc.value) and expected in str(exc.value)


def test_missing_manifest_says_the_directory_was_never_completed(tmp_path):
    with pytest.raises(ManifestError, match="missing \\(the directory was never completed and verified\\)"):
        read_manifest(tmp_path)


def test_known_hashes_must_cover_exactly_the_directory(tmp_path):
    d = tmp_path / "m"
    files = write_model_files(d, shards=1)
    known = {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}
    assert write_manifest(d, TINY, files=known) == write_manifest(d, TINY)
    known.pop("config.json")
    with pytest.raises(PrepareError, match=r"present but not verified \['config.json'\]"):
        write_manifest(d, TINY, files=known)


def test_identity_as_a_dict_is_validated_into_its_typed_shape(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    manifest = write_manifest(tmp_path, {"kind": "generated", "generator": "tiny", "generator_version": "2"})
    assert isinstance(manifest.identity, GeneratedIdentity)
    with pytest.raises(PrepareError, match="manifest identity"):
        write_manifest(tmp_path, {"kind": "artifact", "artifact": "k", "source": "hub"})


def test_artifact_identity_rules():
    with pytest.raises(ValueError, match="40-hex"):
        ArtifactIdentity(artifact="k", source="hub", repo="o/r", revision="main")
    with pytest.raises(ValueError, match="local artifact has no repo"):
        ArtifactIdentity(artifact="k", source="local", repo="o/r")
    assert ArtifactIdentity(artifact="k", source="hub", repo="o/r", revision="a" * 40).describe() == "k@aaaaaaaaaaaa"


def test_derived_identity_binds_its_inputs_manifest_digests(tmp_path):
    src = tmp_path / "src"
    write_model_files(src, shards=1)
    pinned = ArtifactIdentity(artifact="base", source="hub", repo="o/r", revision="b" * 40)
    src_manifest = write_manifest(src, pinned)
    ref = input_ref(src, role="model")
    assert ref.manifest_digest == src_manifest.digest and ref.identity == pinned
    derived = DerivedIdentity(transform="requantize", transform_version="1", params={"bits": 8}, inputs=(ref,))
    out = tmp_path / "out"
    write_model_files(out, shards=1, seed=1)
    manifest = write_manifest(out, derived)
    again = read_manifest(out)
    assert again.identity == derived
    assert again.identity.artifacts() == [(pinned, src_manifest.digest)]
    assert manifest.identity.describe() == "requantize-v1(base@bbbbbbbbbbbb)"


def test_parallel_hashes_equal_sequential_ones_and_hashlib(tmp_path):
    paths = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * (1 << 20) * (i + 1) + b"tail")
        paths.append(p)
    parallel = hash_files(paths, jobs=3)
    assert parallel == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    assert parallel == hash_files(paths, jobs=1)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sha256_file(empty) == hashlib.sha256(b"").hexdigest()


def test_git_blob_sha1_matches_git():
    # `printf 'hello\n' | git hash-object --stdin`
    assert git_blob_sha1(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_a_hard_link_of_a_verified_input_keeps_its_known_hash_without_being_read(tmp_path):
    import os
    import shutil

    from core.manifest import LinkedFile

    src, out = tmp_path / "src", tmp_path / "out"
    files = write_model_files(src, shards=2)
    out.mkdir()
    linked_name, copied_name = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    os.link(src / linked_name, out / linked_name)
    shutil.copyfile(src / copied_name, out / copied_name)
    (out / "config.json").write_bytes(b"{}")
    # A deliberately different "known" hash shows whether the file was read: a hard link
    # (same inode, same size) keeps what the caller vouched for; a copy is hashed.
    vouched = "f" * 64
    linked = {
        linked_name: LinkedFile(src / linked_name, len(files[linked_name]), vouched),
        copied_name: LinkedFile(src / copied_name, len(files[copied_name]), vouched),
        "config.json": LinkedFile(src / "config.json", len(files["config.json"]), vouched),  # not a link either
    }
    entries = write_manifest(out, TINY, linked=linked).by_path()
    assert entries[linked_name].sha256 == vouched
    assert entries[copied_name].sha256 == hashlib.sha256(files[copied_name]).hexdigest()
    assert entries["config.json"].sha256 == hashlib.sha256(b"{}").hexdigest()


def test_a_known_hash_whose_size_no_longer_matches_is_not_trusted(tmp_path):
    import os

    from core.manifest import LinkedFile

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "a.bin").write_bytes(b"abc")
    os.link(src / "a.bin", out / "a.bin")
    with open(out / "a.bin", "ab") as handle:  # grows the shared inode after it was vouched for
        handle.write(b"d")
    manifest = write_manifest(out, TINY, linked={"a.bin": LinkedFile(src / "a.bin", 3, "f" * 64)})
    assert manifest.by_path()["a.bin"].sha256 == hashlib.sha256(b"abcd").hexdigest()
    with pytest.raises(ValueError, match="not both"):
        write_manifest(out, TINY, files={"a.bin": "0" * 64}, linked={"a.bin": LinkedFile(src / "a.bin", 4, "f" * 64)})
