"""`qwen38 bench verify`'s first-start figures, at a size a unit test affords: the real
`qwen38 prepare download` in a new process, then the first verify without and with the stat
cache it left."""

from __future__ import annotations

from bench.verify import bench_first


def test_the_first_verify_after_prepare_hashes_nothing_and_a_fresh_one_everything(tmp_path):
    result = bench_first(tmp_path, 4 << 20, 4, jobs=2, drop="fadvise")
    before, after = result["first_verify_fresh_cache"], result["first_verify_after_prepare"]
    assert (before["hashed_files"], before["hashed_bytes"]) == (4, 4 << 20)
    assert (after["hashed_files"], after["trusted_files"]) == (0, 4)
    assert result["command"].startswith("qwen38 prepare download bench-first --from ")
    assert not (tmp_path / "first-source").exists() and not (tmp_path / "first-models").exists()  # the bytes go
