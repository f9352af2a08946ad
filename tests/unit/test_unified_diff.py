"""The exact unified-diff applier behind `qwen38 patches`."""

from __future__ import annotations

import difflib

import pytest

from entrypoint.unified_diff import DiffFormatError, HunkFailed, apply_file_diff, parse_patch

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 41))


def make_patch(old: str, new: str, path: str = "pkg/mod.py", header: str = "Purpose: test\n\n") -> str:
    diff = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=3
    )
    return header + "".join(diff)


def test_header_is_kept_apart_from_the_diffs():
    patch = parse_patch(make_patch(ORIGINAL, ORIGINAL.replace("line 5\n", "line five\n")))
    assert patch.header == "Purpose: test\n\n"
    assert [f.path for f in patch.files] == ["pkg/mod.py"]


def test_apply_then_reverse_gives_back_the_original():
    new = ORIGINAL.replace("line 5\n", "line five\nextra\n").replace("line 30\n", "")
    diff = parse_patch(make_patch(ORIGINAL, new)).files[0]
    assert apply_file_diff(ORIGINAL, diff) == new
    assert apply_file_diff(new, diff, reverse=True) == ORIGINAL


def test_hunk_moved_by_unrelated_lines_still_applies_exactly_once():
    new = ORIGINAL.replace("line 20\n", "line twenty\n")
    diff = parse_patch(make_patch(ORIGINAL, new)).files[0]
    shifted = "inserted 1\ninserted 2\n" + ORIGINAL
    assert apply_file_diff(shifted, diff) == "inserted 1\ninserted 2\n" + new


def test_changed_context_fails_naming_the_hunk():
    new = ORIGINAL.replace("line 5\n", "line five\n").replace("line 30\n", "line thirty\n")
    diff = parse_patch(make_patch(ORIGINAL, new)).files[0]
    drifted = ORIGINAL.replace("line 31\n", "line 31 changed upstream\n")
    with pytest.raises(HunkFailed) as failure:
        apply_file_diff(drifted, diff)
    assert failure.value.hunk == 2
    assert "pkg/mod.py: hunk #2" in str(failure.value)


def test_ambiguous_context_is_refused_rather_than_guessed():
    text = "a\nb\nc\nd\n" * 2
    diff = parse_patch(make_patch("a\nb\nc\nd\n", "a\nb\nX\nd\n")).files[0]
    moved = "zzz\n" + text  # the named line no longer matches, and two places would
    with pytest.raises(HunkFailed, match="ambiguous"):
        apply_file_diff(moved, diff)


def test_already_applied_patch_does_not_apply_again():
    new = ORIGINAL.replace("line 5\n", "line five\n")
    diff = parse_patch(make_patch(ORIGINAL, new)).files[0]
    with pytest.raises(HunkFailed):
        apply_file_diff(new, diff)


def test_missing_newline_at_end_of_file_round_trips():
    old = "first\nlast"
    new = "first\nsecond\nlast"
    diff = parse_patch(make_patch(old, new)).files[0]
    assert apply_file_diff(old, diff) == new
    assert apply_file_diff(new, diff, reverse=True) == old


def test_new_file_is_created_and_reversed_to_absent():
    text = "x = 1\n"
    patch = "h\n--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1 @@\n+x = 1\n"
    diff = parse_patch(patch).files[0]
    assert diff.creates
    assert apply_file_diff(None, diff) == text
    assert apply_file_diff(text, diff, reverse=True) is None


def test_paths_without_p1_prefix_are_rejected():
    with pytest.raises(DiffFormatError, match="a/ or b/"):
        parse_patch("--- pkg/mod.py\n+++ pkg/mod.py\n@@ -1 +1 @@\n-a\n+b\n")


def test_truncated_hunk_is_a_format_error():
    with pytest.raises(DiffFormatError, match="ends inside"):
        parse_patch("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n a\n-b\n")
