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


# ---- the one freshness check: core.manifest.is_current / current_manifest / files_match ----


def _prepared(tmp_path, identity=TINY):
    """A directory of three files and its manifest: (directory, manifest)."""
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"aaaa")
    (d / "b.bin").write_bytes(b"bb")
    (d / "sub" / "c.bin").write_bytes(b"c")
    return d, write_manifest(d, identity)


def test_a_directory_as_its_manifest_lists_it_is_current(tmp_path):
    from core.manifest import current_manifest, file_mismatches, files_match, is_current

    d, manifest = _prepared(tmp_path)
    assert is_current(d) and is_current(d, TINY) and is_current(d, manifest)
    assert is_current(d, lambda m: m.identity.generator == "tiny")
    assert current_manifest(d, TINY) == manifest
    assert files_match(d, manifest) and files_match(d, manifest, sha256=True)
    assert file_mismatches(d, manifest) == []
    assert is_current(str(d), TINY, sha256=True)


def test_another_identity_or_manifest_is_not_current(tmp_path):
    from core.manifest import build_manifest, current_manifest, is_current

    d, manifest = _prepared(tmp_path)
    other = GeneratedIdentity(generator="tiny", generator_version="1", params={"seed": 1})
    assert not is_current(d, other)
    assert current_manifest(d, other) is None
    assert not is_current(d, lambda m: False)
    # The same identity with other files is another manifest: a lock's expected manifest
    # is compared by digest, identity and files together.
    elsewhere = build_manifest(TINY, [f.model_copy(update={"sha256": "0" * 64}) for f in manifest.files])
    assert elsewhere.identity == manifest.identity and not is_current(d, elsewhere)


def test_a_missing_or_broken_manifest_is_not_current(tmp_path):
    from core.manifest import is_current

    assert not is_current(tmp_path / "absent")
    assert not is_current(tmp_path / "absent", TINY, sizes=False)
    d, _ = _prepared(tmp_path)
    (d / MANIFEST_NAME).write_text("{not json")
    assert not is_current(d) and not is_current(d, sizes=False)
    (d / MANIFEST_NAME).unlink()
    (d / MANIFEST_NAME).mkdir()  # a directory where the manifest should be
    assert not is_current(d)


def test_a_file_at_another_size_missing_or_unlisted_is_not_current(tmp_path):
    from core.manifest import FileMismatch, file_mismatches, files_match, is_current

    d, manifest = _prepared(tmp_path)
    (d / "a.bin").write_bytes(b"aaaaa")  # grown
    (d / "sub" / "c.bin").unlink()  # missing
    (d / "z.bin").write_bytes(b"z")  # not listed
    (d / "d.bin").write_bytes(b"d")  # not listed
    mismatches = file_mismatches(d, manifest)
    assert mismatches == [
        FileMismatch("a.bin", 4, 5),
        FileMismatch("sub/c.bin", 1, None),
        FileMismatch("d.bin", None, None),
        FileMismatch("z.bin", None, None),
    ]  # listed files in the manifest's order, then unlisted ones sorted
    assert [m.kind for m in mismatches] == ["size", "missing", "extra", "extra"]
    assert not files_match(d, manifest) and not is_current(d, TINY)
    assert is_current(d, TINY, sizes=False)  # identity only: what the tiny step asks without --recheck


@pytest.mark.parametrize("change", ["grown", "missing", "extra", "dangling", "loop", "directory"])
def test_each_way_out_of_step_fails_sizes_and_recheck_alike(tmp_path, change):
    import os

    from core.manifest import files_match, is_current

    d, manifest = _prepared(tmp_path)
    if change == "grown":
        (d / "b.bin").write_bytes(b"bbb")
    elif change == "missing":
        (d / "b.bin").unlink()
    elif change == "extra":
        (d / "sub" / "e.bin").write_bytes(b"e")
    elif change == "dangling":  # a listed file replaced by a link to nothing
        (d / "b.bin").unlink()
        os.symlink(tmp_path / "nowhere", d / "b.bin")
    elif change == "loop":  # a link to itself: not there, and no OSError escapes
        (d / "b.bin").unlink()
        os.symlink("b.bin", d / "b.bin")
    else:  # a directory of the listed size's name: not a content file
        (d / "b.bin").unlink()
        (d / "b.bin").mkdir()
    assert not files_match(d, manifest)
    assert not files_match(d, manifest, sha256=True)
    assert not is_current(d, TINY)
    assert not is_current(d, TINY, sizes=False, sha256=True)


def test_hidden_files_and_a_symlinked_listed_file_at_its_size_stay_current(tmp_path):
    import os

    from core.manifest import is_current

    d, _ = _prepared(tmp_path)
    (d / ".qwen38-staging").mkdir()
    (d / ".qwen38-staging" / "x.part").write_bytes(b"partial")
    (d / ".lock").write_bytes(b"")
    kept = tmp_path / "kept.bin"
    (d / "b.bin").rename(kept)
    os.symlink(kept, d / "b.bin")  # a link counts at the size of what it points to
    assert is_current(d, TINY, sha256=True)


def test_a_same_size_edit_passes_sizes_and_fails_only_the_recheck(tmp_path):
    from core.manifest import current_manifest, is_current

    d, manifest = _prepared(tmp_path)
    (d / "a.bin").write_bytes(b"aaab")
    assert current_manifest(d, TINY) == manifest
    assert not is_current(d, TINY, sha256=True)
    assert not is_current(d, TINY, sizes=False, sha256=True)


@pytest.mark.parametrize("change", ["missing", "size", "extra"])
def test_the_input_guards_name_the_first_mismatch_in_one_wording(tmp_path, change):
    """`prepare.derived.check_input_files` and the adapter's input check refuse the first
    `file_mismatches` entry, described once (`FileMismatch.describe`), each with its own fix."""
    from core.errors import AdapterError
    from prepare.adapter import _input_manifest
    from prepare.derived import check_input_files

    d, manifest = _prepared(tmp_path)
    if change == "missing":
        (d / "b.bin").unlink()
        line, fix = f"{d / 'b.bin'}: listed in {d / MANIFEST_NAME} but missing", "re-verify the download"
    elif change == "size":
        (d / "b.bin").write_bytes(b"bbbbb")
        line, fix = f"{d / 'b.bin'}: size expected 2 (its {MANIFEST_NAME}), found 5", "re-verify the download"
    else:
        (d / "sub" / "x.bin").write_bytes(b"x")
        line = f"{d / 'sub' / 'x.bin'}: not in {d / MANIFEST_NAME} (expected absent)"
        fix = "remove it or re-download the input"
    with pytest.raises(PrepareError) as info:
        check_input_files(d, manifest)
    assert str(info.value) == f"{line}; {fix} before preparing"
    with pytest.raises(AdapterError) as info:
        _input_manifest(d, "directions")
    assert str(info.value).startswith(f"{line}; ")
