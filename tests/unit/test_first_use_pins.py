"""Pins an owner gets without a reviewer who reaches the hub: an artifact the repository lock
pins by commit only is listed at that commit on first use, checked against the hashes the lock
names, recorded in MODELS_DIR's machine-local lock and verified against it from then on; an
artifact with no revision only on the owner's opt-in; files already downloaded (a Hugging Face
cache, a folder) are used when their sha256 is the pinned one. All through the real
huggingface_hub client against the local hub stand-in (tests/hub_server.py)."""

from __future__ import annotations

import hashlib
import types

import pytest
import tomllib

from core.artifact_lock import (
    LOCAL_LOCK_NAME,
    UNPINNED,
    ArtifactLock,
    LockedArtifact,
    LockedFile,
    effective_lock,
    load_local_lock,
    load_lock,
    write_lock,
)
from core.errors import ArtifactError
from core.manifest import content_files
from entrypoint.cli import main
from entrypoint.verify import verify_profile
from tests.pinning_support import (  # noqa: F401 (hf_isolated, hub, no_racy_window are fixtures)
    hf_isolated,
    hub,
    make_profile,
    make_settings,
    no_racy_window,
    write_model_files,
)

REPO = "org/base"
COMMIT, NEWER = "1" * 40, "3" * 40
SHARD1 = "model-00001-of-00002.safetensors"


def _entry(path: str, data: bytes) -> LockedFile:
    return LockedFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def env(tmp_path, hub, monkeypatch):
    files = write_model_files(tmp_path / "upstream")
    hub.add_commit(REPO, COMMIT, {**files, "README.md": b"# card\n"})
    monkeypatch.chdir(tmp_path)  # no .env of the caller's checkout
    monkeypatch.setenv("MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("ALLOW_BRANCH_HEAD", raising=False)
    monkeypatch.delenv("MODELS_SEED_DIR", raising=False)
    lock_path = tmp_path / "artifacts.lock.toml"
    env = types.SimpleNamespace(hub=hub, files=files, lock_path=lock_path, tmp=tmp_path, models=tmp_path / "models")
    _write(env, revision=COMMIT, known=(_entry(SHARD1, files[SHARD1]),))
    return env


def _write(env, **fields) -> None:
    artifact = LockedArtifact(key="base", source="hub", repo=REPO, exclude=("*.md",), **fields)
    write_lock(ArtifactLock(artifacts={"base": artifact}), env.lock_path)


def _download(env, *extra: str) -> int:
    return main(["prepare", "download", "base", "--endpoint", env.hub.hub_url, "--lock", str(env.lock_path), *extra])


def _cdn_gets(hub) -> list[str]:
    return [p for m, p, _ in hub.requests if m == "GET" and p.startswith("/cdn/")]


def _local(env) -> dict:
    return tomllib.loads((env.models / LOCAL_LOCK_NAME).read_text())["artifacts"]["base"]


def test_a_commit_without_files_is_listed_at_first_use_recorded_here_and_verified(env, capsys, no_racy_window):
    before = env.lock_path.read_bytes()
    assert _download(env) == 0
    out = capsys.readouterr().out
    assert (
        f"base: pinned 4 files (0.00 GB) of {REPO} from the hub's listing: commit {COMMIT}, 1 agree with the "
        f"repository lock's hashes; recorded in {env.models / LOCAL_LOCK_NAME}"
    ) in out
    # The repository's lock is never rewritten behind the owner's back.
    assert env.lock_path.read_bytes() == before
    recorded = _local(env)
    assert recorded["revision"] == COMMIT and recorded["pinned_by"] == "first-use"
    assert {f["path"]: f["sha256"] for f in recorded["files"]} == {
        p: hashlib.sha256(b).hexdigest() for p, b in env.files.items()
    }
    # Every later start verifies against the recorded pin.
    profile = make_profile({"target": {"dir": "base", "artifact": "base"}})
    report = verify_profile(profile, make_settings(env.tmp), full=True, lock_path=env.lock_path)
    assert not report.problems
    # A second prepare asks the hub nothing: the pin is recorded, the files are in place.
    env.hub.requests.clear()
    assert _download(env) == 0
    assert env.hub.requests == []
    assert main(["lock", "show", "--lock", str(env.lock_path), "--models-dir", str(env.models)]) == 0
    shown = capsys.readouterr().out
    assert f"pinned    base  {REPO}@{COMMIT}  4 files" in shown
    assert "from: first use (" in shown and "the hub's listing of the locked commit" in shown


def test_a_listing_that_contradicts_a_hash_the_lock_names_is_refused_with_both_values(env, capsys):
    wrong = "0" * 64
    _write(env, revision=COMMIT, known=(LockedFile(path=SHARD1, size=len(env.files[SHARD1]), sha256=wrong),))
    assert _download(env) != 0
    err = capsys.readouterr().err
    real = hashlib.sha256(env.files[SHARD1]).hexdigest()
    assert f"{REPO}@{COMMIT}/{SHARD1}: sha256 the repository lock names {wrong}, the listing has {real}; refusing" in err
    assert err.count("\n") == 1
    assert not (env.models / LOCAL_LOCK_NAME).exists() and _cdn_gets(env.hub) == []


def test_a_flipped_byte_at_first_use_is_refused_with_both_hashes(env, capsys):
    env.hub.corrupt.add(SHARD1)
    assert _download(env) != 0
    err = capsys.readouterr().err
    assert f"sha256 expected {hashlib.sha256(env.files[SHARD1]).hexdigest()}" in err and "found " in err
    assert "nothing was installed" in err
    assert not (env.models / "base" / SHARD1).exists()


def test_no_revision_is_refused_unless_the_owner_opts_in_then_the_head_is_recorded(env, capsys, monkeypatch):
    _write(env, revision=UNPINNED)
    assert _download(env) != 0
    err = capsys.readouterr().err
    assert "names no revision, and a branch is not a pin" in err and "set ALLOW_BRANCH_HEAD=true" in err
    assert env.hub.requests == []

    monkeypatch.setenv("ALLOW_BRANCH_HEAD", "true")
    assert _download(env) == 0
    assert f"its main branch is at commit {COMMIT}" in capsys.readouterr().out
    assert _local(env)["pinned_by"] == "owner"
    # The branch moving on changes nothing: the recorded commit is the pin.
    env.hub.add_commit(REPO, NEWER, {**env.files, "extra.json": b"{}"})
    env.hub.requests.clear()
    assert _download(env) == 0 and env.hub.requests == []
    assert main(["lock", "show", "--lock", str(env.lock_path), "--models-dir", str(env.models)]) == 0
    assert "from: owner (" in capsys.readouterr().out


def test_a_local_pin_of_an_older_commit_is_ignored_and_the_new_commit_listed(env, capsys):
    assert _download(env) == 0
    env.hub.add_commit(REPO, NEWER, {**env.files, "extra.json": b"{}"})
    _write(env, revision=NEWER)
    assert effective_lock(load_lock(env.lock_path), env.models).get("base").pinned_at_first_use
    assert _download(env, "--prune") == 0
    assert _local(env)["revision"] == NEWER
    assert (env.models / "base" / "extra.json").read_bytes() == b"{}"


def test_the_repository_lock_wins_over_the_machine_local_one(env):
    assert _download(env) == 0
    full = [_entry(p, b) for p, b in sorted(env.files.items())]
    _write(env, revision=COMMIT, files=tuple(full))
    text = (env.models / LOCAL_LOCK_NAME).read_text()
    (env.models / LOCAL_LOCK_NAME).write_text(text.replace(full[0].sha256, "f" * 64))
    artifact = effective_lock(load_lock(env.lock_path), env.models).get("base")
    assert artifact.files == tuple(full) and artifact.provenance == "repository lock"


def test_a_local_lock_contradicting_a_hash_the_repository_names_is_refused(env):
    assert _download(env) == 0
    real = hashlib.sha256(env.files[SHARD1]).hexdigest()
    path = env.models / LOCAL_LOCK_NAME
    path.write_text(path.read_text().replace(real, "e" * 64))
    with pytest.raises(ArtifactError) as exc:
        effective_lock(load_lock(env.lock_path), env.models)
    assert str(exc.value) == (
        f"{path}: {REPO}@{COMMIT}/{SHARD1}: sha256 the repository lock names {real}, the listing has {'e' * 64}; refusing"
    )


def test_a_hand_written_local_entry_that_is_not_a_recorded_pin_is_refused(env):
    env.models.mkdir()
    write_lock(ArtifactLock(artifacts={"base": LockedArtifact(key="base", source="hub", repo=REPO, revision=COMMIT)}),
               env.models / LOCAL_LOCK_NAME)
    with pytest.raises(ArtifactError, match="not a pin this machine recorded .* delete the file and run prepare again"):
        load_local_lock(env.models)


def test_pinned_by_in_the_repository_lock_is_refused(env):
    text = env.lock_path.read_text().replace('files = "UNPINNED"', 'pinned_by = "owner"\nfiles = "UNPINNED"')
    env.lock_path.write_text(text)
    with pytest.raises(ArtifactError, match="pinned_by/pinned_at belong to the machine-local lock"):
        load_lock(env.lock_path)


# ---- models already on disk ---------------------------------------------------------------


def test_a_hugging_face_cache_seeds_the_models_without_downloading_again(env, capsys):
    from huggingface_hub import hf_hub_download

    cache = env.tmp / "hf-cache"
    for path in env.files:  # the real client lays out its cache (snapshots -> blobs)
        hf_hub_download(REPO, path, revision=COMMIT, cache_dir=cache, endpoint=env.hub.hub_url)
    assert (cache / "models--org--base" / "snapshots" / COMMIT / SHARD1).is_file()
    env.hub.requests.clear()
    assert _download(env, "--seed", str(cache)) == 0
    out = capsys.readouterr().out
    assert f"base: {SHARD1} taken from {cache}" in out
    assert _cdn_gets(env.hub) == []  # the listing was read, no file fetched
    for path, data in env.files.items():
        assert (env.models / "base" / path).read_bytes() == data


def test_a_folder_of_files_seeds_and_a_copy_with_other_bytes_is_downloaded_instead(env, capsys, monkeypatch):
    folder = env.tmp / "downloads" / "base"
    folder.mkdir(parents=True)
    for path, data in env.files.items():
        (folder / path).write_bytes(data)
    flipped = bytearray(env.files[SHARD1])
    flipped[100] ^= 0xFF
    (folder / SHARD1).write_bytes(bytes(flipped))
    monkeypatch.setenv("MODELS_SEED_DIR", str(env.tmp / "downloads"))
    assert _download(env) == 0
    out = capsys.readouterr().out
    assert f"base: {(folder / SHARD1).resolve()} is not the pinned {SHARD1} (sha256 " in out and "not used" in out
    assert [p for p in _cdn_gets(env.hub)] == [f"/cdn/{hashlib.sha256(env.files[SHARD1]).hexdigest()}"]
    assert sorted(p.relative_to(env.models / "base").as_posix() for p in content_files(env.models / "base")) == sorted(
        env.files
    )
    assert (env.models / "base" / SHARD1).read_bytes() == env.files[SHARD1]
