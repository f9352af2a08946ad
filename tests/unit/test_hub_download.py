"""`qwen38 lock update` and `qwen38 prepare download` through the real huggingface_hub
client, against a local hub-style server (tests/hub_server.py)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from core.artifact_lock import UNPINNED, ArtifactLock, LockedArtifact, LockedFile, load_lock, write_lock
from core.errors import ArtifactError, DownloadError
from core.manifest import MANIFEST_NAME, read_manifest
from entrypoint.cli import main
from entrypoint.verify import VerifyFailed, verify_profile
from prepare.download import LOCK_FILE, STAGING_DIR, download_artifact, targets_for_profile
from tests.pinning_support import (  # noqa: F401 (hf_isolated, hub, no_racy_window are fixtures)
    hf_isolated,
    hub,
    make_profile,
    make_settings,
    no_racy_window,
    write_model_files,
)

REPO = "org/base"
COMMIT = "1" * 40
ROOT = Path(__file__).resolve().parents[2]
SHARD1 = "model-00001-of-00002.safetensors"


def _repo_files(tmp_path: Path, width: int = 64) -> dict[str, bytes]:
    files = write_model_files(tmp_path / "upstream", width=width)
    files["README.md"] = b"# a model card\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs\n"
    return files


def _served(files: dict[str, bytes]) -> dict[str, bytes]:
    return {p: b for p, b in files.items() if p not in ("README.md", ".gitattributes")}


@pytest.fixture
def env(tmp_path, hub):
    files = _repo_files(tmp_path)
    hub.add_commit(REPO, COMMIT, files)
    lock_path = tmp_path / "artifacts.lock.toml"
    write_lock(
        ArtifactLock(
            artifacts={
                "base": LockedArtifact(key="base", source="hub", repo=REPO, revision=UNPINNED, exclude=("*.md",)),
                "dirs": LockedArtifact(key="dirs", source="local"),
            }
        ),
        lock_path,
    )
    settings = make_settings(tmp_path)
    return types.SimpleNamespace(hub=hub, files=files, lock_path=lock_path, settings=settings, tmp=tmp_path)


def _lock_update(env, *extra: str) -> int:
    return main(["lock", "update", "base", "--endpoint", env.hub.hub_url, "--lock", str(env.lock_path), *extra])


def _pinned(env) -> LockedArtifact:
    assert _lock_update(env, "--revision", "main") == 0
    return load_lock(env.lock_path).get("base")


def _download(env, artifact=None, **kw):
    artifact = artifact or load_lock(env.lock_path).get("base")
    return download_artifact(
        artifact, env.settings.models_dir / "base", endpoint=env.hub.hub_url, lock_path=env.lock_path,
        say=lambda line: None, **kw,
    )


def _cdn_gets(hub) -> list[str | None]:
    return [r for m, p, r in hub.requests if m == "GET" and p.startswith("/cdn/")]


# ---- lock update ----------------------------------------------------------------------


def test_lock_update_pins_the_resolved_commit_and_every_file(env, capsys):
    artifact = _pinned(env)
    assert artifact.revision == COMMIT
    expected = {
        p: (len(b), hashlib.sha256(b).hexdigest()) for p, b in _served(env.files).items()
    }
    assert {f.path: (f.size, f.sha256) for f in artifact.files} == expected
    assert "4 files, 0.00 GB pinned (+4 added, -0 removed, 0 changed)" in capsys.readouterr().out
    # The listing came from the API route; LFS shards were never downloaded (their sha256 is
    # published), small git files were fetched to hash them.
    assert ("GET", f"/api/models/{REPO}/revision/main", None) in env.hub.requests
    assert _cdn_gets(env.hub) == []
    fetched = {p for m, p, _ in env.hub.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {f"/{REPO}/resolve/{COMMIT}/{p}" for p in ("config.json", "model.safetensors.index.json")}


def test_lock_update_without_revision_uses_the_pinned_one(env):
    _pinned(env)
    env.hub.requests.clear()
    assert _lock_update(env) == 0
    assert ("GET", f"/api/models/{REPO}/revision/{COMMIT}", None) in env.hub.requests


def test_lock_update_needs_a_revision_when_unpinned(env, capsys):
    assert _lock_update(env) == 2
    assert "has no revision to pin; pass `--revision COMMIT`" in capsys.readouterr().err


def test_lock_update_refuses_a_hub_answering_another_commit(env, capsys):
    env.hub.repos[REPO].served_sha[COMMIT] = "2" * 40
    assert _lock_update(env, "--revision", COMMIT) == 2
    assert f"the hub resolved the commit to {'2' * 40}; refusing" in capsys.readouterr().err


def test_lock_update_refuses_a_small_file_that_does_not_match_its_blob_id(env, capsys):
    env.hub.repos[REPO].listed_blob_id[(COMMIT, "config.json")] = "0" * 40
    assert _lock_update(env, "--revision", "main") == 2
    err = capsys.readouterr().err
    assert f"{REPO}@{COMMIT}/config.json: git blob id expected {'0' * 40}" in err
    assert load_lock(env.lock_path).get("base").files == UNPINNED  # nothing written


def test_lock_update_reports_an_unknown_revision(env, capsys):
    assert _lock_update(env, "--revision", "nope") == 2
    assert f"{REPO}@nope: revision not found on the hub" in capsys.readouterr().err


def test_lock_update_reaches_the_hub_through_hf_endpoint(env):
    run = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "lock", "update", "base", "--revision", "main",
         "--lock", str(env.lock_path)],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": env.hub.hub_url},
    )
    assert run.returncode == 0, run.stderr
    assert load_lock(env.lock_path).get("base").revision == COMMIT


def test_local_artifact_is_pinned_from_the_users_file(env):
    own = env.tmp / "directions.safetensors"
    own.write_bytes(b"\x01" * 3000)
    assert main(["lock", "update", "dirs", "--from", str(own), "--lock", str(env.lock_path)]) == 0
    files = load_lock(env.lock_path).get("dirs").files
    assert files == (LockedFile(path="directions.safetensors", size=3000,
                                sha256=hashlib.sha256(b"\x01" * 3000).hexdigest()),)


# ---- download -------------------------------------------------------------------------


def test_download_fetches_verifies_and_writes_the_lock_manifest(env, no_racy_window):
    artifact = _pinned(env)
    manifest = _download(env)
    dest = env.settings.models_dir / "base"
    for path, data in _served(env.files).items():
        assert (dest / path).read_bytes() == data
    assert not (dest / "README.md").exists()
    assert manifest == artifact.expected_manifest() == read_manifest(dest)
    assert not (dest / STAGING_DIR).exists()
    profile = make_profile({"target": {"dir": "base", "artifact": "base"}})
    report = verify_profile(profile, env.settings, lock_path=env.lock_path)
    assert report.dirs[0].identity == f"base@{COMMIT[:12]}"


def test_a_second_download_fetches_nothing(env):
    _pinned(env)
    _download(env)
    env.hub.requests.clear()
    _download(env)
    assert env.hub.requests == []


def test_a_hash_mismatch_names_repo_revision_file_and_installs_nothing(env):
    _pinned(env)
    env.hub.corrupt.add(SHARD1)
    with pytest.raises(DownloadError) as exc:
        _download(env)
    good = hashlib.sha256(env.files[SHARD1]).hexdigest()
    assert str(exc.value).startswith(f"{REPO}@{COMMIT}/{SHARD1}: sha256 expected {good} (")
    assert "nothing was installed" in str(exc.value)
    dest = env.settings.models_dir / "base"
    assert not (dest / SHARD1).exists()
    assert not (dest / MANIFEST_NAME).exists()
    assert not list((dest / STAGING_DIR).glob("*.part"))  # wrong bytes are not kept to resume


def test_a_hub_announcing_another_sha256_is_refused_before_downloading(env):
    _pinned(env)
    env.hub.repos[REPO].listed_sha256[(COMMIT, SHARD1)] = "e" * 64
    with pytest.raises(DownloadError, match=f"{SHARD1}: sha256 pinned [0-9a-f]{{64}}, the hub announces e{{64}}"):
        _download(env)
    cdn_paths = " ".join(p for _, p, _ in env.hub.requests if p.startswith("/cdn/"))
    assert hashlib.sha256(env.files[SHARD1]).hexdigest() not in cdn_paths


# huggingface_hub's http_get writes what it receives in 10 MiB chunks (DOWNLOAD_CHUNK_SIZE):
# an interruption keeps every whole chunk, so the resume tests use shards above 10 MiB.
CHUNK = 10 << 20


def test_an_interrupted_download_resumes_where_it_stopped(tmp_path, hub, no_racy_window):
    files = _repo_files(tmp_path, width=2048)  # 16 MiB shards
    hub.add_commit(REPO, COMMIT, files)
    lock_path = tmp_path / "artifacts.lock.toml"
    write_lock(ArtifactLock(artifacts={"base": LockedArtifact(key="base", source="hub", repo=REPO, revision=COMMIT,
                                                              exclude=("*.md",))}), lock_path)
    env = types.SimpleNamespace(hub=hub, lock_path=lock_path, settings=make_settings(tmp_path))
    assert _lock_update(env) == 0
    artifact = load_lock(lock_path).get("base")
    shard = next(f for f in artifact.files if f.path == SHARD1)
    hub.cut_after = CHUNK + (2 << 20)  # the connection drops 12 MiB in; retries get HTTP 500
    with pytest.raises(DownloadError) as exc:
        _download(env)
    dest = env.settings.models_dir / "base"
    staging = dest / STAGING_DIR / f"{shard.sha256}.part"
    assert str(exc.value).startswith(f"{REPO}@{COMMIT}/{SHARD1}: the hub answered HTTP 500")
    assert f"{CHUNK} bytes kept in {staging}, the next run resumes there" in str(exc.value)
    assert staging.stat().st_size == CHUNK
    # The partial file is never taken for a good one.
    assert not (dest / SHARD1).exists()
    with pytest.raises(VerifyFailed, match="missing \\(the directory was never completed"):
        verify_profile(make_profile({"target": {"dir": "base", "artifact": "base"}}), env.settings,
                       lock_path=lock_path)

    hub.failing = False
    hub.requests.clear()
    _download(env)
    assert _cdn_gets(hub)[0] == f"bytes={CHUNK}-"
    assert (dest / SHARD1).read_bytes() == files[SHARD1]
    assert read_manifest(dest) == artifact.expected_manifest()


def test_a_killed_download_process_resumes_with_a_range_request(tmp_path, hub):
    files = _repo_files(tmp_path, width=2560)  # 26 MB shards
    hub.add_commit(REPO, COMMIT, files)
    lock_path = tmp_path / "artifacts.lock.toml"
    write_lock(ArtifactLock(artifacts={"base": LockedArtifact(key="base", source="hub", repo=REPO, revision=COMMIT,
                                                              exclude=("*.md",))}), lock_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.hub_url, "MODELS_DIR": str(tmp_path / "models"),
           "CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    assert subprocess.run([sys.executable, "-m", "entrypoint.cli", "lock", "update", "base", "--lock", str(lock_path)],
                          cwd=tmp_path, env=env, capture_output=True).returncode == 0
    # No profile exists on this branch: make the default PROFILE=cpu known to the settings.
    shim = ("import sys, core.profiles as p; p.profile_names = lambda d=None: ['cpu']; "
            "from entrypoint.cli import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", shim, "prepare", "download", "base", "--lock", str(lock_path)]
    hub.throttle = 8 << 20
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    staging = tmp_path / "models" / "base" / STAGING_DIR
    deadline = time.time() + 60
    while time.time() < deadline:
        parts = list(staging.glob("*.part")) if staging.exists() else []
        if parts and parts[0].stat().st_size >= CHUNK:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = parts[0].stat().st_size
    assert kept % CHUNK == 0 and 0 < kept < len(files[SHARD1])
    hub.throttle = None
    hub.requests.clear()
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _cdn_gets(hub)[0] == f"bytes={kept}-"
    dest = tmp_path / "models" / "base"
    for path, data in _served(files).items():
        assert (dest / path).read_bytes() == data
    assert read_manifest(dest) == load_lock(lock_path).get("base").expected_manifest()


def test_an_altered_download_is_caught_by_verify_and_repaired_by_recheck(env, no_racy_window):
    _pinned(env)
    _download(env)
    dest = env.settings.models_dir / "base"
    profile = make_profile({"target": {"dir": "base", "artifact": "base"}})
    verify_profile(profile, env.settings, lock_path=env.lock_path)
    data = bytearray((dest / SHARD1).read_bytes())
    data[200] ^= 0x10
    (dest / SHARD1).write_bytes(data)
    with pytest.raises(VerifyFailed) as exc:
        verify_profile(profile, env.settings, lock_path=env.lock_path)
    assert str(exc.value).endswith("fetch it again with `qwen38 prepare download --profile test --recheck`")
    env.hub.requests.clear()
    _download(env)  # sizes match the manifest: nothing fetched without --recheck
    assert env.hub.requests == []
    _download(env, recheck=True)
    assert [p for m, p, _ in env.hub.requests if m == "GET"] == [f"/cdn/{hashlib.sha256(env.files[SHARD1]).hexdigest()}"]
    assert verify_profile(profile, env.settings, lock_path=env.lock_path).dirs[0].hashed == 1


def test_files_already_in_place_are_kept_and_wrong_ones_replaced(env):
    _pinned(env)
    dest = env.settings.models_dir / "base"
    dest.mkdir(parents=True)
    (dest / SHARD1).write_bytes(env.files[SHARD1])
    shard2 = "model-00002-of-00002.safetensors"
    bad = bytearray(env.files[shard2])
    bad[0] ^= 1
    (dest / shard2).write_bytes(bad)
    _download(env)
    fetched = " ".join(p for m, p, _ in env.hub.requests if m == "GET")
    assert hashlib.sha256(env.files[SHARD1]).hexdigest() not in fetched
    assert hashlib.sha256(env.files[shard2]).hexdigest() in fetched
    assert (dest / shard2).read_bytes() == env.files[shard2]


def test_stray_files_block_the_download_unless_pruned(env):
    _pinned(env)
    dest = env.settings.models_dir / "base"
    dest.mkdir(parents=True)
    (dest / "old-model.safetensors").write_bytes(b"old revision")
    with pytest.raises(DownloadError, match="holds files the lock does not list for base: old-model.safetensors"):
        _download(env)
    _download(env, prune=True)
    assert not (dest / "old-model.safetensors").exists()


def test_not_enough_disk_is_refused_before_fetching(env):
    artifact = _pinned(env)
    huge = artifact.model_copy(update={"files": (LockedFile(path="big.bin", size=10**16, sha256="b" * 64),)})
    env.hub.requests.clear()
    with pytest.raises(DownloadError, match=r"needs 10000000.00 GB more on disk, [0-9.]+ GB are free"):
        _download(env, huge)
    assert env.hub.requests == []


def test_an_unpinned_artifact_is_refused_before_any_request(env):
    with pytest.raises(ArtifactError, match="artifact base is not pinned \\(its revision is UNPINNED\\)"):
        _download(env)
    assert env.hub.requests == []


def test_two_downloads_into_one_directory_exclude_each_other(env):
    _pinned(env)
    dest = env.settings.models_dir / "base"
    dest.mkdir(parents=True)
    with open(dest / LOCK_FILE, "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(DownloadError, match="another `qwen38 prepare download` is writing here"):
            _download(env)


def test_a_local_artifact_is_imported_verified_or_refused(env):
    own = env.tmp / "r.safetensors"
    own.write_bytes(b"\x02" * 2000)
    assert main(["lock", "update", "dirs", "--from", str(own), "--lock", str(env.lock_path)]) == 0
    artifact = load_lock(env.lock_path).get("dirs")
    dest = env.settings.models_dir / "dirs"
    with pytest.raises(DownloadError, match="user-supplied artifact dirs; copy it there or pass --from PATH"):
        download_artifact(artifact, dest, lock_path=env.lock_path, say=lambda s: None)
    other = env.tmp / "other.safetensors"
    other.write_bytes(b"\x03" * 2000)
    with pytest.raises(DownloadError, match="dirs \\(local\\)/r.safetensors: sha256 expected"):
        download_artifact(artifact, dest, source=other, lock_path=env.lock_path, say=lambda s: None)
    manifest = download_artifact(artifact, dest, source=own, lock_path=env.lock_path, say=lambda s: None)
    assert (dest / "r.safetensors").read_bytes() == own.read_bytes()
    assert manifest.identity.source == "local" and manifest == artifact.expected_manifest()


def _profile_p(env, monkeypatch) -> None:
    """The artifact pinned, and profile `p` serving it from MODELS_DIR/served-base, as the CLI reads them."""
    from core import profiles

    _pinned(env)
    pdir = env.tmp / "profiles"
    pdir.mkdir()
    (pdir / "p.toml").write_text(
        'description = "t"\nplatform = "cpu"\nmachine = "any"\n[served]\nbase = "b"\n'
        '[models.target]\ndir = "served-base"\nartifact = "base"\n[engine]\nmax_model_len = 4096\nmax_num_seqs = 1\n'
    )
    monkeypatch.setenv("PROFILES_DIR", str(pdir))
    monkeypatch.setattr(profiles, "profile_names", lambda directory=pdir: ["p"])
    monkeypatch.chdir(env.tmp)
    monkeypatch.setenv("MODELS_DIR", str(env.settings.models_dir))
    monkeypatch.setenv("CACHE_DIR", str(env.settings.cache_dir))


def test_cli_download_by_profile_then_verify(env, monkeypatch, capsys, no_racy_window):
    _profile_p(env, monkeypatch)
    lock = ["--lock", str(env.lock_path)]
    assert main(["prepare", "download", "--profile", "p", "--endpoint", env.hub.hub_url, *lock]) == 0
    assert (env.settings.models_dir / "served-base" / SHARD1).read_bytes() == env.files[SHARD1]
    assert "base: " in capsys.readouterr().out
    assert main(["verify", "--profile", "p", *lock]) == 0
    assert f"target=base@{COMMIT[:12]}#" in capsys.readouterr().out


def test_profile_downloads_only_slots_that_are_artifacts_as_downloaded():
    profile = make_profile(
        {
            "target": {"dir": "t-int8", "artifact": "t", "transform": "requantize"},
            "drafter": {"dir": "d", "artifact": "d"},
            "adapter": {"dir": "a", "generated": "tiny"},
        }
    )
    assert [(t.artifact, t.dir) for t in targets_for_profile(profile)] == [("d", "d")]


# ---- what a person sees without a terminal, and what the first verify reads ---------------


def test_a_download_without_a_terminal_prints_progress_lines(tmp_path, hub, monkeypatch, capsys):
    """Through the real huggingface_hub client: the staging file's size is followed and a
    plain line comes every PLAIN_EVERY_S (shortened here) while stdout and stderr are pipes."""
    from core import progress

    files = _repo_files(tmp_path, width=2048)  # 16 MiB shards: http_get writes 10 MiB at a time
    hub.add_commit(REPO, COMMIT, files)
    lock_path = tmp_path / "artifacts.lock.toml"
    write_lock(ArtifactLock(artifacts={"base": LockedArtifact(key="base", source="hub", repo=REPO, revision=COMMIT,
                                                              exclude=("*.md",))}), lock_path)
    env = types.SimpleNamespace(hub=hub, lock_path=lock_path, settings=make_settings(tmp_path))
    assert _lock_update(env) == 0
    progress.set_level("info")
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.2)
    monkeypatch.setattr(progress, "WATCH_POLL_S", 0.05)
    hub.throttle = 16 << 20  # about a second per shard
    try:
        _download(env)
    finally:
        hub.throttle = None
        progress.set_level(None)
    captured = capsys.readouterr()
    assert not sys.stdout.isatty() and not sys.stderr.isatty()
    size = len(files[SHARD1])
    lines = captured.err.splitlines()
    during = [line for line in lines if line.startswith(f"qwen38: base: download {SHARD1}: ") and "left" in line]
    assert len(during) >= 2, captured.err
    shape = re.compile(
        rf"qwen38: base: download {SHARD1}: ([\d.]+ (?:B|kB|MB)) of {size / 1e6:.1f} MB \((\d+)%\), "
        r"[\d.]+ (?:B|kB|MB)/s, (?:\d+ s left|time left unknown)"
    )
    assert all(shape.fullmatch(line) for line in during), during
    assert any(int(shape.fullmatch(line).group(2)) > 0 for line in during), during  # it saw the file grow
    closing = re.compile(rf"qwen38: base: download {SHARD1}: {size / 1e6:.1f} MB in \d+ s \([\d.]+ MB/s\)")
    assert any(closing.fullmatch(line) for line in lines), captured.err


def test_the_first_verify_after_prepare_reads_no_byte(env, monkeypatch):
    """`qwen38 prepare download` leaves what it hashed in the stat cache under CACHE_DIR, with
    the real racy window: verify then trusts every file and hashes none."""
    import core.hashing
    from core.stat_cache import CACHE_FILE

    _profile_p(env, monkeypatch)
    assert main(["prepare", "download", "--profile", "p", "--endpoint", env.hub.hub_url,
                 "--lock", str(env.lock_path)]) == 0
    assert (env.settings.cache_dir / CACHE_FILE).is_file()

    reads = []
    real = core.hashing.sha256_file
    monkeypatch.setattr(core.hashing, "sha256_file", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    profile = make_profile({"target": {"dir": "served-base", "artifact": "base"}})
    report = verify_profile(profile, env.settings, lock_path=env.lock_path)
    assert reads == []
    assert (report.dirs[0].hashed, report.dirs[0].trusted) == (0, len(_served(env.files)))
    # The cache holds nothing verify would not have recorded itself: an altered file is still caught.
    shard = env.settings.models_dir / "served-base" / SHARD1
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(data)
    with pytest.raises(VerifyFailed, match=f"{SHARD1}: sha256 expected"):
        verify_profile(profile, env.settings, lock_path=env.lock_path)
    assert reads == [shard]
