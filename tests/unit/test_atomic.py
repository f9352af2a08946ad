"""Atomic writes: a reader sees the old state or the complete new one, never a mix."""

from __future__ import annotations

import os

import pytest

from core.atomic import atomic_directory, atomic_file, atomic_write_text, remove_stale_staging


def test_a_failed_file_write_leaves_the_old_file_and_no_staging(tmp_path):
    dest = tmp_path / "f.txt"
    atomic_write_text(dest, "old")
    with pytest.raises(RuntimeError):
        with atomic_file(dest, "w") as handle:
            handle.write("half")
            raise RuntimeError("crash")
    assert dest.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_a_directory_is_replaced_whole_or_not_at_all(tmp_path):
    dest = tmp_path / "model"
    with atomic_directory(dest) as stage:
        (stage / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(dest) as stage:
            (stage / "b").write_text("2")
            raise RuntimeError("crash")
    assert sorted(p.name for p in dest.iterdir()) == ["a"]
    with atomic_directory(dest) as stage:
        (stage / "b").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["b"]
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_finished_directories_are_readable_by_other_users(tmp_path):
    with atomic_directory(tmp_path / "m") as stage:
        fd = os.open(stage / "w", os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
    assert (tmp_path / "m" / "w").stat().st_mode & 0o777 == 0o644


def test_stale_staging_from_a_killed_run_is_removed(tmp_path):
    (tmp_path / ".model.1234abcd.incomplete").mkdir()
    (tmp_path / ".f.txt.deadbeef.incomplete").write_text("x")
    (tmp_path / "keep").write_text("y")
    removed = remove_stale_staging(tmp_path)
    assert len(removed) == 2 and os.listdir(tmp_path) == ["keep"]
