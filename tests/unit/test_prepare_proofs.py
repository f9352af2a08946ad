"""What prepare leaves in verify's stat cache (`core.proofs` + `core.stat_cache.leave_proofs`):
exactly the files whose bytes it proved, under verify's own rules, so the first verify reads
none of them and still catches any change."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from core import proofs
from core.atomic import atomic_directory
from core.hashing import sha256_file
from core.identity import GeneratedIdentity
from core.manifest import LinkedFile, read_manifest, write_manifest
from core.stat_cache import RACY_WINDOW_NS, FileStamp, StatCache, is_trusted, leave_proofs
from prepare.derived import place_file
from tests.pinning_support import age

IDENTITY = GeneratedIdentity(generator="test", generator_version="1")


class Time:
    """time.time_ns that a fake sleep moves on: the racy window passes without waiting."""

    def __init__(self) -> None:
        self.offset = 0
        self.slept: list[float] = []

    def clock(self) -> int:
        return time.time_ns() + self.offset

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.offset += int(seconds * 1e9)


def _leave(ledger, cache=None):
    clock = Time()
    cache = cache if cache is not None else StatCache(None)
    recorded = leave_proofs(cache, ledger, clock=clock.clock, sleep=clock.sleep)
    return cache, recorded, clock


def _trusted(cache: StatCache, directory: Path) -> set[str]:
    manifest = read_manifest(directory)
    entries = cache.entries_for(directory, manifest.digest)
    return {
        f.path for f in manifest.files
        if is_trusted(entries.get(f.path), FileStamp.of(os.stat(directory / f.path)), f.sha256)
    }


def _staged_download(dest: Path, files: dict[str, bytes]) -> None:
    """What `prepare download` does: write into a staging directory, hash there, rename, manifest."""
    staging = dest / ".qwen38-staging"
    staging.mkdir(parents=True)
    digests = {}
    for name, data in files.items():
        part = staging / f"{name}.part"
        part.write_bytes(data)
        with proofs.written_here(staging):
            digests[name] = sha256_file(part)
        os.replace(part, dest / name)
    staging.rmdir()
    write_manifest(dest, IDENTITY, files=digests)


def test_a_download_hashed_in_staging_is_left_trusted_after_the_racy_window(tmp_path):
    dest = tmp_path / "base"
    with proofs.recording() as ledger:
        _staged_download(dest, {"a.safetensors": b"a" * 5000, "config.json": b"{}"})
    cache, recorded, clock = _leave(ledger)
    assert recorded == 2
    assert _trusted(cache, dest) == {"a.safetensors", "config.json"}
    # The files changed a moment ago: it waited (once, at most the window) instead of recording racy entries.
    assert len(clock.slept) == 1 and 0 < clock.slept[0] <= RACY_WINDOW_NS / 1e9 + 0.01


def test_nothing_is_noted_while_no_command_records(tmp_path):
    (tmp_path / "x").write_bytes(b"x")
    sha256_file(tmp_path / "x")
    assert proofs.active() is None
    with proofs.recording() as ledger:
        pass
    assert ledger.proofs == {} and ledger.directories() == {}


def test_a_file_changed_after_it_was_hashed_is_not_left(tmp_path):
    dest = tmp_path / "base"
    with proofs.recording() as ledger:
        _staged_download(dest, {"a.safetensors": b"a" * 5000, "b.safetensors": b"b" * 5000})
        with open(dest / "b.safetensors", "r+b") as handle:  # an edit after the proof, same size
            handle.write(b"B")
    cache, recorded, _ = _leave(ledger)
    assert _trusted(cache, dest) == {"a.safetensors"} and recorded == 1


def test_a_file_found_in_place_follows_verifys_racy_rule(tmp_path):
    """A file prepare did not write itself counts only when its last change came a racy window
    before the read began: another write in the same timestamp tick could go unseen otherwise."""
    dest = tmp_path / "base"
    dest.mkdir()
    for name in ("settled.bin", "fresh.bin"):
        (dest / name).write_bytes(name.encode() * 100)
    with proofs.recording() as ledger:
        fresh = sha256_file(dest / "fresh.bin")  # read right after it was written
        st = os.stat(dest / "settled.bin")
        # As read by a run that began a window after the file's last change:
        ledger.note(dest / "settled.bin", st, sha256_file(dest / "settled.bin"), st.st_ctime_ns + RACY_WINDOW_NS + 1)
        write_manifest(dest, IDENTITY, files={"settled.bin": ledger.proofs_of(st)[0].sha256, "fresh.bin": fresh})
    cache, recorded, _ = _leave(ledger)
    assert _trusted(cache, dest) == {"settled.bin"} and recorded == 1


def test_a_proof_of_other_bytes_than_the_manifest_lists_is_not_left(tmp_path):
    dest = tmp_path / "base"
    with proofs.recording() as ledger:
        _staged_download(dest, {"a.bin": b"a" * 100})
        write_manifest(dest, IDENTITY, files={"a.bin": "0" * 64})  # a manifest that lies
    _, recorded, _ = _leave(ledger)
    assert recorded == 0


def test_a_chmod_of_a_file_found_in_place_is_a_change_that_is_not_ours(tmp_path):
    dest = tmp_path / "base"
    dest.mkdir()
    path = dest / "a.bin"
    path.write_bytes(b"a" * 100)
    with proofs.recording() as ledger:
        st = os.stat(path)
        ledger.note(path, st, sha256_file(path), st.st_ctime_ns + RACY_WINDOW_NS + 1)
        write_manifest(dest, IDENTITY, files={"a.bin": ledger.proofs_of(st)[0].sha256})
        os.chmod(path, 0o600)  # ctime moves; a restored mtime after an edit would look the same
    _, recorded, _ = _leave(ledger)
    assert recorded == 0


def test_a_derived_directory_is_left_under_its_final_path_with_its_hard_links(tmp_path):
    """The untouched input files a derived step hard-links are not hashed again, yet left trusted
    (their bytes were proven at download); the files it writes are proven as it hashes them."""
    base = tmp_path / "base"
    out = tmp_path / "prepared"
    with proofs.recording() as ledger:
        _staged_download(base, {"shard-1.bin": b"1" * 4000, "shard-2.bin": b"2" * 4000})
        with atomic_directory(out) as stage:
            place_file(base / "shard-1.bin", stage / "shard-1.bin")
            (stage / "shard-2.bin").write_bytes(b"q" * 1000)  # rewritten
            known = read_manifest(base).by_path()["shard-1.bin"].sha256
            write_manifest(stage, IDENTITY, linked={"shard-1.bin": LinkedFile(base / "shard-1.bin", 4000, known)})
    cache, recorded, _ = _leave(ledger)
    assert recorded == 4
    assert _trusted(cache, out) == {"shard-1.bin", "shard-2.bin"}
    assert _trusted(cache, base) == {"shard-1.bin", "shard-2.bin"}  # the link's new ctime is ours


def test_an_input_verified_by_an_earlier_run_speaks_for_its_hard_link(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "shard.bin").write_bytes(b"s" * 3000)
    age(base / "shard.bin")
    digest = sha256_file(base / "shard.bin")
    write_manifest(base, IDENTITY, files={"shard.bin": digest})
    # What an earlier verify (or prepare) recorded, long enough after the file's last change.
    cache = StatCache(None)
    st = os.stat(base / "shard.bin")
    cache.record(base, read_manifest(base).digest, "shard.bin", FileStamp.of(st), digest,
                 st.st_ctime_ns + RACY_WINDOW_NS + 1)
    out = tmp_path / "prepared"
    with proofs.recording() as ledger:
        with atomic_directory(out) as stage:
            assert place_file(base / "shard.bin", stage / "shard.bin") == "hardlink"
            write_manifest(stage, IDENTITY, linked={"shard.bin": LinkedFile(base / "shard.bin", 3000, digest)})
    assert ledger.proofs == {}  # nothing was read
    cache, recorded, _ = _leave(ledger, cache)
    assert recorded == 1 and _trusted(cache, out) == {"shard.bin"}


def test_recording_is_one_at_a_time():
    with proofs.recording():
        with pytest.raises(RuntimeError, match="already recording"):
            with proofs.recording():
                pass
