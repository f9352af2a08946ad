"""The artifact lock: the committed file, its typed loader, one-line errors, the writer."""

from __future__ import annotations

import hashlib

import pytest

from core.artifact_lock import (
    LOCK_PATH,
    UNPINNED,
    ArtifactLock,
    LockedArtifact,
    LockedFile,
    load_lock,
    parse_lock,
    render_lock,
    write_lock,
)
from core.errors import ArtifactError

KEYS = {
    "qwen3.8-27b-w4a16",
    "qwen3.8-27b-dflash2-w4a16",
    "qwen3.8-27b-nvfp4",
    "qwen3.8-27b-dflash2",
    "qwen3.8-27b-mode-b-directions",
}


def test_committed_lock_lists_every_artifact_key_with_reference_revisions():
    lock = load_lock()
    assert set(lock.artifacts) == KEYS
    assert lock.artifacts["qwen3.8-27b-nvfp4"].repo == "RadixArk/Qwen3.8-27B-NVFP4"
    assert lock.artifacts["qwen3.8-27b-nvfp4"].revision == "319f741cce68d7914884900c138a1fbb70a42f30"
    assert lock.artifacts["qwen3.8-27b-dflash2"].revision == "50307d4c4cde6860d4eee73e2547cd786fe8e8a4"
    assert lock.artifacts["qwen3.8-27b-w4a16"].repo == "dbirks/Qwen3.8-27B-W4A16-AutoRound"
    assert lock.artifacts["qwen3.8-27b-dflash2-w4a16"].repo == "syvai/Qwen3.8-27B-DFlash2-W4A16"
    assert lock.artifacts["qwen3.8-27b-mode-b-directions"].source == "local"


def test_every_hub_artifact_of_the_committed_lock_names_its_public_commit_and_its_source():
    """The owner's first run needs no reviewer who reaches the hub: each hub artifact is pinned by
    commit (files read at first use where not listed), with the public source in its note."""
    lock = load_lock()
    revisions = {
        "qwen3.8-27b-w4a16": "1f05c441c4e64ae0549de44fa9ea5a6d43610314",
        "qwen3.8-27b-dflash2-w4a16": "4d30ec736ffc6b8688dc2ae2b502d9b48bdec279",
        "qwen3.8-27b-dflash2": "50307d4c4cde6860d4eee73e2547cd786fe8e8a4",
        "qwen3.8-27b-nvfp4": "319f741cce68d7914884900c138a1fbb70a42f30",
    }
    for key, revision in revisions.items():
        artifact = lock.get(key)
        assert artifact.revision == revision
        assert artifact.is_pinned or artifact.pinned_at_first_use
        assert "read 2026-12-06" in artifact.note and "/" in artifact.note
    target = lock.get("qwen3.8-27b-w4a16")
    assert len(target.known) == 9 and sum(f.size for f in target.known) == 19_472_769_333
    assert {f.path for f in lock.get("qwen3.8-27b-dflash2").known} == {"config.json", "model.safetensors"}


def test_committed_lock_is_in_canonical_layout():
    assert render_lock(load_lock()) == LOCK_PATH.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("key", "what", "command"),
    [
        (
            "qwen3.8-27b-nvfp4",
            "pins commit 319f741cce68d7914884900c138a1fbb70a42f30 of RadixArk/Qwen3.8-27B-NVFP4; its files are read "
            "from the hub's listing of that commit at first use, and this machine has not recorded them yet",
            "run `qwen38 prepare download qwen3.8-27b-nvfp4`",
        ),
        (
            "qwen3.8-27b-mode-b-directions",
            "file sizes and sha256 are UNPINNED",
            "qwen38 lock update qwen3.8-27b-mode-b-directions --from PATH",
        ),
    ],
)
def test_unpinned_artifact_refuses_with_the_command_that_pins_it(key, what, command):
    artifact = load_lock().get(key)
    with pytest.raises(ArtifactError) as exc:
        artifact.require_pinned()
    message = str(exc.value)
    assert "\n" not in message
    assert key in message and what in message and command in message


def test_unknown_artifact_key_names_the_known_ones():
    with pytest.raises(ArtifactError, match="no artifact 'nope'; known artifacts: qwen3.8-27b-dflash2"):
        load_lock().get("nope")


GOOD = """
version = 1
[artifacts."a"]
source = "hub"
repo = "o/r"
revision = "0123456789abcdef0123456789abcdef01234567"
files = [ { path = "config.json", size = 3, sha256 = "%s" } ]
""" % ("ab" * 32)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version = 1\n[artifacts", "not valid TOML"),
        ("version = 1\n", "no [artifacts.KEY] table"),
        (GOOD.replace('revision = "0123', 'revision = "main'), "artifacts.a.revision: revision must be a 40-hex"),
        (GOOD.replace("ab" * 32, "AB" * 32), "artifacts.a.files.0.sha256: sha256 must be 64 lowercase hex"),
        (GOOD.replace('"config.json"', '"../config.json"'), "artifacts.a.files.0.path: path may not contain"),
        (GOOD.replace('"config.json"', '".gitattributes"'), "hidden parts"),
        (GOOD.replace("size = 3", "size = -1"), "artifacts.a.files.0.size"),
        (GOOD.replace('repo = "o/r"', ""), "a hub artifact needs `repo`"),
        (GOOD.replace('source = "hub"', 'source = "local"'), "a local artifact has no `repo`/`revision`"),
        (GOOD.replace('source = "hub"', 'source = "hub"\ncolour = "red"'), "artifacts.a.colour: Extra inputs"),
        (GOOD.replace("version = 1", "version = 2"), "version"),
        (GOOD.replace('[artifacts."a"]', '[artifacts."A b"]'), "artifact keys are lowercase"),
        (GOOD.replace("files = [ {", 'files = [ { path = "x", size = 1, sha256 = "%s" }, {' % ("cd" * 32)).replace(
            '"x"', '"config.json"'), "a file is listed twice: config.json"),
        (GOOD.replace('files = [ { path = "config.json", size = 3, sha256 = "%s" } ]' % ("ab" * 32), "files = []"),
         "an empty file list pins nothing"),
        (GOOD.replace('files = [ { path = "config.json", size = 3, sha256 = "%s" } ]' % ("ab" * 32),
                      'files = "unknown"'), "artifacts.a.files: files must be a list of {path, size, sha256} or 'UNPINNED'"),
    ],
)
def test_malformed_lock_is_one_line_naming_the_file_and_field(tmp_path, text, expected):
    path = tmp_path / "artifacts.lock.toml"
    path.write_text(text)
    with pytest.raises(ArtifactError) as exc:
        load_lock(path)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert expected in message


def test_missing_lock_file_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="the artifact lock is missing"):
        load_lock(tmp_path / "nope.toml")


def test_written_lock_reads_back_identically_and_sorts_files(tmp_path):
    files = (
        LockedFile(path="z.safetensors", size=10, sha256="1" * 64),
        LockedFile(path="a/config.json", size=2, sha256="2" * 64),
    )
    lock = ArtifactLock(
        artifacts={
            "k": LockedArtifact(key="k", source="hub", repo="o/r", revision="a" * 40, note='say "hi"', files=files,
                                exclude=("*.md",)),
            "u": LockedArtifact(key="u", source="hub", repo="o/u", revision=UNPINNED),
            "l": LockedArtifact(key="l", source="local"),
        }
    )
    path = tmp_path / "lock.toml"
    write_lock(lock, path)
    again = load_lock(path)
    assert again == lock
    assert [f.path for f in again.artifacts["k"].files] == ["a/config.json", "z.safetensors"]
    assert again.artifacts["k"].excludes("README.md") and not again.artifacts["k"].excludes("config.json")


def test_expected_manifest_of_a_pinned_artifact_follows_from_the_lock_alone():
    data = b"abc"
    artifact = parse_lock(GOOD.replace("ab" * 32, hashlib.sha256(data).hexdigest())).get("a")
    manifest = artifact.expected_manifest()
    assert manifest.identity.revision == artifact.revision
    assert [(f.path, f.size) for f in manifest.files] == [("config.json", 3)]
    # Deterministic: the same lock entry always implies the same digest.
    assert manifest.digest == artifact.expected_manifest().digest
    changed = artifact.model_copy(update={"revision": "f" * 40})
    assert changed.expected_manifest().digest != manifest.digest
