"""`qwen38 prepare --profile P` end to end: pinned downloads from a local hub-style server
(through the real huggingface_hub client), the int8 requantization, then `qwen38 verify`."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import types
from pathlib import Path

import pytest

from core.artifact_lock import UNPINNED, LockedArtifact, LockedFile, load_lock, write_lock
from core.errors import ArtifactError, PrepareError
from core.identity import DerivedIdentity
from core.manifest import MANIFEST_NAME, read_manifest, write_manifest
from core.profiles import load_profile
from entrypoint.cli import main
from entrypoint.patches import read_series_names
from entrypoint.verify import VerifyFailed, verify_profile
from prepare.generate import generate_model
from prepare.pipeline import HubAccess, plan_profile, prepare_profile
from prepare.requantize import TRANSFORM_VERSION, requantize_checkpoint
from tests.pinning_support import (  # noqa: F401 (hf_isolated, hub, no_racy_window are fixtures)
    hf_isolated,
    hub,
    make_settings,
    no_racy_window,
    write_model_files,
)

TARGET, DRAFTER = "qwen3.8-27b-w4a16", "qwen3.8-27b-dflash2-w4a16"
TARGET_REPO, DRAFTER_REPO = "dbirks/Qwen3.8-27B-W4A16-AutoRound", "syvai/Qwen3.8-27B-DFlash2-W4A16"
TARGET_COMMIT, DRAFTER_COMMIT = "1" * 40, "2" * 40
PREPARED = "prepared/qwen3.8-27b-w4a16-int8"
REWRITTEN = "model-00003-of-00003.safetensors"  # holds lm_head: written fresh, not linked
# Every patch of the series is missing from the stock engine.
PATCHES_ONLY = f"patches: profile single runs the patched engine, but {len(read_series_names())} patches are not delivered in "


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """What the two hub repos hold: a tiny W4A16 target in the real layout and a drafter."""
    root = tmp_path_factory.mktemp("upstream")
    target = generate_model(root / "target", "tiny-vl", "qwen3.8-27b-w4a16")
    (target / MANIFEST_NAME).unlink()  # what the hub repo holds: the files, no manifest of ours
    write_model_files(root / "drafter", seed=5)
    return {TARGET: _files(target), DRAFTER: _files(root / "drafter")}


def _pin(key: str, repo: str, commit: str, files: dict[str, bytes]) -> LockedArtifact:
    return LockedArtifact(
        key=key,
        source="hub",
        repo=repo,
        revision=commit,
        files=tuple(
            LockedFile(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest()) for p, b in sorted(files.items())
        ),
    )


@pytest.fixture
def stack(tmp_path, hub, upstream):
    """The committed lock with the two RTX 3090 artifacts pinned to the local hub's repos."""
    hub.add_commit(TARGET_REPO, TARGET_COMMIT, upstream[TARGET])
    hub.add_commit(DRAFTER_REPO, DRAFTER_COMMIT, upstream[DRAFTER])
    lock = (
        load_lock()
        .with_artifact(_pin(TARGET, TARGET_REPO, TARGET_COMMIT, upstream[TARGET]))
        .with_artifact(_pin(DRAFTER, DRAFTER_REPO, DRAFTER_COMMIT, upstream[DRAFTER]))
    )
    lock_path = tmp_path / "artifacts.lock.toml"
    write_lock(lock, lock_path)
    settings = make_settings(tmp_path)
    profile = load_profile("single")
    return types.SimpleNamespace(
        hub=hub,
        lock=lock,
        lock_path=lock_path,
        settings=settings,
        models=settings.models_dir,
        profile=profile,
        # Patch delivery is the patch series' business (tested in test_verify.py); here the
        # model directories are what is under test, so one check is also run without it.
        unpatched=profile.model_copy(update={"require_patches": False}),
    )


def _prepare(stack, **kw):
    return prepare_profile(
        stack.profile, stack.models, lock_path=stack.lock_path, hub=HubAccess(endpoint=stack.hub.hub_url), say=lambda _: None, **kw
    )


@pytest.fixture
def stock_vllm(tmp_path, monkeypatch):
    """Verify sees a stock vLLM 0.28.0 (the installed one walked back to pristine), whether or
    not `make setup` patched the installed tree."""
    from core.errors import PatchError
    from entrypoint import patches as ps
    from entrypoint import verify

    try:
        installed = ps.find_vllm_dir()
    except PatchError:
        pytest.skip("no vllm installed")
    stock = ps.series_tree(installed, tmp_path / "stock-vllm", patched=False) / "vllm"
    monkeypatch.setattr(verify, "find_vllm_dir", lambda: stock)
    return stock


def _verify(stack):
    return verify_profile(stack.unpatched, stack.settings, lock_path=stack.lock_path)


def _verify_fails(stack) -> str:
    with pytest.raises(VerifyFailed) as exc:
        _verify(stack)
    return str(exc.value)


def _stamps(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_plan_downloads_the_transform_input_then_requantizes_it(tmp_path):
    steps = plan_profile(load_profile("single"), tmp_path)
    assert [s.describe() for s in steps] == [
        f"target input: download {TARGET} -> {tmp_path / TARGET}",  # where `prepare download KEY` puts it
        f"drafter: download {DRAFTER} -> {tmp_path / 'artifacts' / DRAFTER}",
        f"target: requantize-int8 -> {tmp_path / PREPARED}",
    ]
    assert steps[-1].inputs == (tmp_path / TARGET,)


def test_plan_without_the_drafter_has_no_step_of_it_but_the_targets(tmp_path):
    steps = plan_profile(load_profile("single"), tmp_path, skip_slots=frozenset({"drafter"}))
    assert [s.describe() for s in steps] == [
        f"target input: download {TARGET} -> {tmp_path / TARGET}",
        f"target: requantize-int8 -> {tmp_path / PREPARED}",
    ]


def test_a_skipped_slot_still_lands_the_download_another_slots_transform_reads(tmp_path):
    """The drafter is skipped, but a target requantized from the drafter's artifact still
    downloads it, where it always lands: the skipped slot's directory."""
    profile = load_profile("single")
    models = profile.models.model_copy(
        update={"target": profile.models.target.model_copy(update={"artifact": DRAFTER})}
    )
    steps = plan_profile(profile.model_copy(update={"models": models}), tmp_path, skip_slots=frozenset({"drafter"}))
    assert [s.describe() for s in steps] == [
        f"target input: download {DRAFTER} -> {tmp_path / 'artifacts' / DRAFTER}",
        f"target: requantize-int8 -> {tmp_path / PREPARED}",
    ]
    assert steps[-1].inputs == (tmp_path / "artifacts" / DRAFTER,)


def test_prepare_single_makes_what_verify_accepts_and_a_second_run_does_nothing(stack, no_racy_window, stock_vllm):
    done = _prepare(stack)
    assert [(s.slot, s.action) for s in done] == [
        ("target input", "download"),
        ("drafter", "download"),
        ("target", "requantize-int8"),
    ]
    source = read_manifest(stack.models / TARGET)
    assert source == stack.lock.get(TARGET).expected_manifest()  # the download, untouched by the step
    prepared = read_manifest(stack.models / PREPARED)
    assert isinstance(prepared.identity, DerivedIdentity)
    assert (prepared.identity.transform, prepared.identity.transform_version) == ("requantize-int8", TRANSFORM_VERSION)
    assert prepared.identity.params["targets"] == ["lm_head", "embed_tokens"]
    index = json.loads((stack.models / PREPARED / "model.safetensors.index.json").read_text())
    assert {"lm_head.weight_packed", "model.language_model.embed_tokens.weight_packed"} <= set(index["weight_map"])

    report = _verify(stack)
    assert [(d.slot, d.identity) for d in report.dirs] == [
        ("target", f"requantize-int8-v{TRANSFORM_VERSION}({TARGET}@{TARGET_COMMIT[:12]})"),
        ("drafter", f"{DRAFTER}@{DRAFTER_COMMIT[:12]}"),
    ]
    assert f"target=requantize-int8-v{TRANSFORM_VERSION}({TARGET}@{TARGET_COMMIT[:12]})#" in report.identity
    # The real profile requires the patch series too: that is the only thing it still lacks here.
    with pytest.raises(VerifyFailed) as exc:
        verify_profile(stack.profile, stack.settings, lock_path=stack.lock_path)
    (only,) = exc.value.report.problems
    assert only.startswith(PATCHES_ONLY) and "`qwen38 patches apply --vllm-dir " in only

    before = _stamps(stack.models)
    stack.hub.requests.clear()
    assert _prepare(stack) == []
    assert stack.hub.requests == []  # not even a HEAD
    assert _stamps(stack.models) == before


def test_verify_refuses_a_tampered_prepared_target_and_recheck_rebuilds_it(stack, no_racy_window):
    _prepare(stack)
    shard = stack.models / PREPARED / REWRITTEN
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(data)
    message = _verify_fails(stack)
    assert message.startswith(f"{shard}: sha256 expected ")
    assert message.endswith("prepare it again with `qwen38 prepare --profile single --recheck`")
    assert _prepare(stack) == []  # sizes are right: only --recheck reads the bytes
    assert [s.slot for s in _prepare(stack, recheck=True)] == ["target"]
    _verify(stack)


def test_verify_refuses_a_target_made_by_another_transform_version_and_prepare_rebuilds_it(stack, no_racy_window):
    _prepare(stack)
    directory = stack.models / PREPARED
    identity = read_manifest(directory).identity
    write_manifest(directory, identity.model_copy(update={"transform_version": "0"}))
    assert (
        f"made by transform requantize-int8 v0, this stack's requantize-int8 is v{TRANSFORM_VERSION}"
        in _verify_fails(stack)
    )
    assert [s.slot for s in _prepare(stack)] == ["target"]
    assert read_manifest(directory).identity == identity
    _verify(stack)


def test_a_target_requantized_from_unpinned_local_files_is_not_served(stack, upstream, no_racy_window):
    _prepare(stack)
    local = stack.models.parent / "my-checkpoint"
    local.mkdir()
    for path, data in upstream[TARGET].items():
        (local / path).write_bytes(data)  # the pinned bytes, but nothing vouches for them
    requantize_checkpoint(local, stack.models / PREPARED)  # the stand-alone command allows it
    with pytest.raises(VerifyFailed) as exc:
        _verify(stack)
    assert any(
        p.endswith(
            "derives from local-v1 content that the lock does not pin; prepare it from the pinned download "
            "with `qwen38 prepare --profile single --recheck`"
        )
        for p in exc.value.report.problems
    )
    assert [s.slot for s in _prepare(stack)] == ["target"]  # the profile run puts the pinned one back
    _verify(stack)


def test_an_artifact_without_a_revision_stops_prepare_before_any_request(stack):
    write_lock(
        stack.lock.with_artifact(stack.lock.get(DRAFTER).model_copy(update={"revision": UNPINNED, "files": UNPINNED})),
        stack.lock_path,
    )
    with pytest.raises(ArtifactError) as exc:
        _prepare(stack)
    assert str(exc.value) == (
        f"{stack.lock_path}: artifact {DRAFTER} ({DRAFTER_REPO}) names no revision, and a branch is not a pin: pin a "
        f"commit with `qwen38 lock update {DRAFTER} --revision COMMIT`, or set ALLOW_BRANCH_HEAD=true to let prepare "
        "resolve its main branch once and record the commit on this machine"
    )
    assert stack.hub.requests == [] and not stack.models.exists()


@pytest.mark.skipif(importlib.util.find_spec("prepare.adapter") is not None, reason="this build has the builder")
def test_spark_lora_refuses_adapter_build_naming_the_command_before_any_download(stack, tmp_path):
    directions = tmp_path / "directions.safetensors"
    directions.write_bytes(b"\x01" * 2048)
    lock = stack.lock
    for key, repo, commit in (
        ("qwen3.8-27b-nvfp4", TARGET_REPO, TARGET_COMMIT),
        ("qwen3.8-27b-dflash2", DRAFTER_REPO, DRAFTER_COMMIT),
    ):
        pinned = _pin(key, repo, commit, {"config.json": b"{}"})
        lock = lock.with_artifact(pinned.model_copy(update={"repo": lock.get(key).repo}))
    lock = lock.with_artifact(
        LockedArtifact(
            key="qwen3.8-27b-mode-b-directions",
            source="local",
            files=(
                LockedFile(path=directions.name, size=2048, sha256=hashlib.sha256(directions.read_bytes()).hexdigest()),
            ),
        )
    )
    write_lock(lock, stack.lock_path)
    with pytest.raises(PrepareError) as exc:
        prepare_profile(
            load_profile("spark-lora"),
            stack.models,
            lock_path=stack.lock_path,
            hub=HubAccess(endpoint=stack.hub.hub_url),
            say=lambda _: None,
        )
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(
        f"adapter {stack.models / 'prepared/qwen3.8-27b-mode-b'}: transform adapter-build "
        "needs `qwen38 adapter build` (prepare.adapter), which this build does not include"
    )
    assert stack.hub.requests == [] and not stack.models.exists()


def test_cli_prepare_profile_then_again_then_verify(stack, monkeypatch, capsys, no_racy_window, stock_vllm):
    monkeypatch.chdir(stack.models.parent)  # no .env of the checkout
    monkeypatch.setenv("MODELS_DIR", str(stack.models))
    monkeypatch.setenv("CACHE_DIR", str(stack.settings.cache_dir))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = ["prepare", "--profile", "single", "--endpoint", stack.hub.hub_url, "--lock", str(stack.lock_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"prepared target: requantize-int8 -> {stack.models / PREPARED}" in out
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == "profile single: every model directory is prepared"
    assert main(["verify", "--profile", "single", "--lock", str(stack.lock_path)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"qwen38: verify: {PATCHES_ONLY}")
    assert (stack.models / PREPARED / MANIFEST_NAME).is_file()
    # What prepare hashed, and the downloaded shards it hard-linked into the prepared target,
    # are in the stat cache it left: the first verify of both served directories reads no byte.
    report = verify_profile(stack.unpatched, stack.settings, lock_path=stack.lock_path)
    assert [(d.hashed, d.trusted == d.files > 0) for d in report.dirs] == [(0, True), (0, True)]


def test_prepare_cpu_generates_the_tiny_models_once_without_reading_the_lock(tmp_path, no_racy_window):
    settings = make_settings(tmp_path)
    profile = load_profile("cpu")
    absent_lock = tmp_path / "no-such.lock.toml"
    done = prepare_profile(profile, settings.models_dir, lock_path=absent_lock, say=lambda _: None)
    assert [(s.slot, s.action) for s in done] == [("target", "tiny")]  # one generator run writes all three
    verify_profile(profile, settings, lock_path=absent_lock)
    before = _stamps(settings.models_dir)
    assert prepare_profile(profile, settings.models_dir, lock_path=absent_lock, say=lambda _: None) == []
    assert _stamps(settings.models_dir) == before


DRAFTER_DIR = f"artifacts/{DRAFTER}"
MTP_SKIP = (
    "qwen38: prepare: drafter skipped: SPECULATION=mtp serves the target's own MTP head; "
    "set SPECULATION=dflash or unset SPECULATION to prepare it"
)


def _cli_env(stack, monkeypatch) -> list[str]:
    monkeypatch.chdir(stack.models.parent)  # no .env of the checkout
    monkeypatch.setenv("MODELS_DIR", str(stack.models))
    monkeypatch.setenv("CACHE_DIR", str(stack.settings.cache_dir))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return ["prepare", "--profile", "single", "--endpoint", stack.hub.hub_url, "--lock", str(stack.lock_path)]


def test_cli_prepare_with_mtp_skips_the_drafter_and_its_hint_prepares_it(stack, monkeypatch, capsys, no_racy_window):
    args = _cli_env(stack, monkeypatch)
    monkeypatch.setenv("SPECULATION", "mtp")
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == MTP_SKIP
    assert f"prepared target: requantize-int8 -> {stack.models / PREPARED}" in lines
    assert not any("drafter" in line or DRAFTER in line for line in lines[1:])
    assert not (stack.models / DRAFTER_DIR).exists()
    assert not any(DRAFTER_REPO in path for _, path, _ in stack.hub.requests)  # not even its listing
    # Each way the line names prepares it: SPECULATION=dflash, then (with it gone again) unset.
    for hint in ({"SPECULATION": "dflash"}, {}):
        shutil.rmtree(stack.models / DRAFTER_DIR, ignore_errors=True)
        monkeypatch.delenv("SPECULATION")
        for name, value in hint.items():
            monkeypatch.setenv(name, value)
        assert main(args) == 0
        lines = capsys.readouterr().out.splitlines()
        assert f"prepared drafter: download {DRAFTER} -> {stack.models / DRAFTER_DIR}" in lines
        assert not any("skipped" in line or "prepared target" in line for line in lines)
        assert read_manifest(stack.models / DRAFTER_DIR) == stack.lock.get(DRAFTER).expected_manifest()
        monkeypatch.setenv("SPECULATION", "mtp")


def test_cli_prepare_with_speculation_off_skips_the_drafter_too(stack, monkeypatch, capsys, no_racy_window):
    args = _cli_env(stack, monkeypatch)
    monkeypatch.setenv("SPECULATION", "off")
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "qwen38: prepare: drafter skipped: SPECULATION=off serves without speculative decoding; "
        "set SPECULATION=dflash or unset SPECULATION to prepare it"
    )
    assert not (stack.models / DRAFTER_DIR).exists()
    assert (stack.models / PREPARED / MANIFEST_NAME).is_file()
