"""The stat-cache trust rules, on real files and real stat results."""

from __future__ import annotations

import os
import time

from core.stat_cache import RACY_WINDOW_NS, CacheEntry, FileStamp, StatCache, is_trusted

SHA = "a" * 64


def _entry(path, hashed_at_ns=None, sha=SHA):
    stamp = FileStamp.of(os.stat(path))
    return stamp, CacheEntry(stamp, sha, hashed_at_ns or time.time_ns() + 2 * RACY_WINDOW_NS)


def test_unchanged_stamp_with_the_expected_hash_is_trusted(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x")
    stamp, entry = _entry(p)
    assert is_trusted(entry, FileStamp.of(os.stat(p)), SHA)


def test_no_entry_or_another_expected_hash_is_not_trusted(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x")
    stamp, entry = _entry(p)
    assert not is_trusted(None, stamp, SHA)
    assert not is_trusted(entry, stamp, "b" * 64)


def test_any_write_changes_the_stamp(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"xy")
    stamp, entry = _entry(p)
    time.sleep(0.01)
    with open(p, "r+b") as f:  # same size, new content
        f.write(b"z")
    assert not is_trusted(entry, FileStamp.of(os.stat(p)), SHA)


def test_an_in_place_edit_with_mtime_put_back_is_caught_by_ctime(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"xy")
    before = os.stat(p)
    stamp, entry = _entry(p)
    time.sleep(0.01)
    with open(p, "r+b") as f:
        f.write(b"z")
    os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(p)
    assert (after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
        before.st_dev,
    )
    assert not is_trusted(entry, FileStamp.of(after), SHA)


def test_a_replaced_file_has_another_inode(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"xy")
    st = os.stat(p)
    stamp, entry = _entry(p)
    q = tmp_path / "g"
    q.write_bytes(b"xy")
    os.utime(q, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(q, p)
    assert not is_trusted(entry, FileStamp.of(os.stat(p)), SHA)


def test_an_entry_hashed_right_after_the_last_change_is_racy(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x")
    stamp = FileStamp.of(os.stat(p))
    racy = CacheEntry(stamp, SHA, hashed_at_ns=max(stamp.mtime_ns, stamp.ctime_ns) + RACY_WINDOW_NS // 2)
    settled = CacheEntry(stamp, SHA, hashed_at_ns=max(stamp.mtime_ns, stamp.ctime_ns) + RACY_WINDOW_NS + 1)
    assert racy.racy and not is_trusted(racy, stamp, SHA)
    assert not settled.racy and is_trusted(settled, stamp, SHA)


def test_entries_are_bound_to_the_manifest_digest_and_survive_a_reload(tmp_path):
    p = tmp_path / "d" / "f"
    p.parent.mkdir()
    p.write_bytes(b"x")
    stamp = FileStamp.of(os.stat(p))
    cache = StatCache(tmp_path / "cache" / "stat.json")
    cache.record(p.parent, "1" * 64, "f", stamp, SHA, 123)
    cache.save()
    again = StatCache.load(tmp_path / "cache" / "stat.json")
    assert again.entries_for(p.parent, "1" * 64)["f"] == CacheEntry(stamp, SHA, 123)
    assert again.entries_for(p.parent, "2" * 64) == {}
    # Keyed by the real path: a symlinked view of the same directory shares entries.
    (tmp_path / "link").symlink_to(p.parent)
    assert again.entries_for(tmp_path / "link", "1" * 64)


def test_a_corrupt_cache_file_means_no_trust_not_failure(tmp_path):
    path = tmp_path / "stat.json"
    path.write_text("{not json")
    assert StatCache.load(path).dirs == {}
    path.write_text('{"version": 99, "dirs": {}}')
    assert StatCache.load(path).dirs == {}


def test_save_writes_only_when_something_changed(tmp_path):
    path = tmp_path / "stat.json"
    cache = StatCache(path)
    cache.save()
    assert not path.exists()
    cache.record(tmp_path, "1" * 64, "f", FileStamp(1, 2, 3, 4, 5), SHA, 6)
    cache.save()
    mtime = path.stat().st_mtime_ns
    StatCache.load(path).save()
    assert path.stat().st_mtime_ns == mtime
