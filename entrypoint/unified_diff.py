"""Unified diffs: parse a patch file and apply it to text, exactly.

The patches of ``patches/`` target one pinned vLLM, so a hunk either matches its
context exactly or the tree is not the one the patch was written for: there is no
fuzz. A hunk is looked for at the line its header names (shifted by what earlier
hunks added or removed) and, failing that, anywhere in the file where its old
lines occur exactly once. Applying a diff in reverse gives back the text it was
made from, which is how a patched tree is traced back to pristine.

Pure functions over strings; the files are read and written by `entrypoint.patches`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEV_NULL = "/dev/null"
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class DiffFormatError(ValueError):
    """The patch text is not a unified diff this module understands."""


class HunkFailed(ValueError):
    """A hunk's old lines are not in the text (or not exactly once)."""

    def __init__(self, path: str, hunk: int, line: int, reason: str) -> None:
        super().__init__(f"{path}: hunk #{hunk} (line {line}) {reason}")
        self.path = path
        self.hunk = hunk
        self.line = line
        self.reason = reason


@dataclass(frozen=True)
class Hunk:
    old_start: int
    new_start: int
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]

    def reversed(self) -> Hunk:
        return Hunk(self.new_start, self.old_start, self.new_lines, self.old_lines)


@dataclass(frozen=True)
class FileDiff:
    """The changes to one file; ``old_path`` or ``new_path`` is /dev/null for a
    created or deleted file. Paths have their a/ b/ prefix removed."""

    old_path: str
    new_path: str
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path if self.new_path != DEV_NULL else self.old_path

    @property
    def creates(self) -> bool:
        return self.old_path == DEV_NULL

    @property
    def deletes(self) -> bool:
        return self.new_path == DEV_NULL

    def reversed(self) -> FileDiff:
        return FileDiff(self.new_path, self.old_path, tuple(h.reversed() for h in self.hunks))


@dataclass(frozen=True)
class Patch:
    """A patch file: free text before the first diff (the header), then diffs."""

    header: str
    files: tuple[FileDiff, ...] = field(default_factory=tuple)


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    if path == DEV_NULL:
        return path
    if path.startswith(("a/", "b/")):
        return path[2:]
    raise DiffFormatError(f"path {path!r} has no a/ or b/ prefix (patches use -p1 paths)")


def parse_patch(text: str) -> Patch:
    """Parse a patch file's text into its header and per-file hunks."""
    lines = text.splitlines(keepends=True)
    index = 0
    while index < len(lines) and not lines[index].startswith("--- "):
        index += 1
    header = "".join(lines[:index])
    files: list[FileDiff] = []
    while index < len(lines):
        line = lines[index]
        if not line.startswith("--- "):
            if line.strip() and not line.startswith("diff "):
                raise DiffFormatError(f"line {index + 1}: expected '--- a/PATH', found {line.rstrip()!r}")
            index += 1
            continue
        if index + 1 >= len(lines) or not lines[index + 1].startswith("+++ "):
            raise DiffFormatError(f"line {index + 2}: expected '+++ b/PATH' after '---'")
        old_path = _strip_prefix(line[4:])
        new_path = _strip_prefix(lines[index + 1][4:])
        index += 2
        hunks: list[Hunk] = []
        while index < len(lines) and lines[index].startswith("@@"):
            hunk, index = _parse_hunk(lines, index)
            hunks.append(hunk)
        if not hunks:
            raise DiffFormatError(f"{new_path}: a file diff without hunks")
        files.append(FileDiff(old_path, new_path, tuple(hunks)))
    return Patch(header=header, files=tuple(files))


def _parse_hunk(lines: list[str], index: int) -> tuple[Hunk, int]:
    match = _HUNK_HEADER.match(lines[index])
    if match is None:
        raise DiffFormatError(f"line {index + 1}: bad hunk header {lines[index].rstrip()!r}")
    old_start, old_count = int(match[1]), int(match[2] if match[2] is not None else 1)
    new_start, new_count = int(match[3]), int(match[4] if match[4] is not None else 1)
    old: list[str] = []
    new: list[str] = []
    index += 1
    last_tag = ""
    while index < len(lines):
        line = lines[index]
        tag = line[:1]
        if tag == "\\":
            # "\ No newline at end of file" applies to the line just before it.
            if last_tag in (" ", "-"):
                _drop_final_newline(old)
            if last_tag in (" ", "+"):
                _drop_final_newline(new)
            index += 1
            continue
        if len(old) >= old_count and len(new) >= new_count:
            break
        if tag == " " or line in ("\n", "\r\n"):
            body = line[1:] if tag == " " else line
            old.append(body)
            new.append(body)
            last_tag = " "
        elif tag == "-":
            old.append(line[1:])
            last_tag = "-"
        elif tag == "+":
            new.append(line[1:])
            last_tag = "+"
        else:
            raise DiffFormatError(f"line {index + 1}: unexpected {line.rstrip()!r} inside a hunk")
        index += 1
    if len(old) != old_count or len(new) != new_count:
        raise DiffFormatError(f"hunk at old line {old_start}: the patch ends inside the hunk")
    return Hunk(old_start, new_start, tuple(old), tuple(new)), index


def _drop_final_newline(lines: list[str]) -> None:
    if lines and lines[-1].endswith("\n"):
        lines[-1] = lines[-1][:-1]


def apply_file_diff(text: str | None, diff: FileDiff, *, reverse: bool = False) -> str | None:
    """Apply one file's hunks to ``text`` (None: the file does not exist).

    Returns the new text, or None when the diff deletes the file. Raises
    `HunkFailed` naming the first hunk whose old lines are not found exactly once.
    """
    if reverse:
        diff = diff.reversed()
    if diff.creates:
        if text is not None:
            raise HunkFailed(diff.path, 1, 0, "creates a file that already exists")
        text = ""
    elif text is None:
        raise HunkFailed(diff.path, 1, 0, "changes a file that does not exist")
    lines = text.splitlines(keepends=True)
    offset = 0
    for number, hunk in enumerate(diff.hunks, start=1):
        # "-l,0" inserts after line l; otherwise the hunk starts at line l.
        named = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        at = _locate(lines, hunk.old_lines, named + offset)
        if at is None:
            raise HunkFailed(diff.path, number, hunk.old_start, _why_not_found(lines, hunk.old_lines))
        lines[at : at + len(hunk.old_lines)] = list(hunk.new_lines)
        offset = at - named + len(hunk.new_lines) - len(hunk.old_lines)
    if diff.deletes:
        if lines:
            raise HunkFailed(diff.path, len(diff.hunks), 0, "deletes a file that is not empty afterwards")
        return None
    return "".join(lines)


def _locate(lines: list[str], old: tuple[str, ...], expected: int) -> int | None:
    size = len(old)
    if not size:
        return expected if 0 <= expected <= len(lines) else None
    if 0 <= expected <= len(lines) - size and tuple(lines[expected : expected + size]) == old:
        return expected
    first = old[0]
    found = [
        start
        for start in range(len(lines) - size + 1)
        if lines[start] == first and tuple(lines[start : start + size]) == old
    ]
    return found[0] if len(found) == 1 else None


def _why_not_found(lines: list[str], old: tuple[str, ...]) -> str:
    size = len(old)
    count = sum(1 for start in range(len(lines) - size + 1) if tuple(lines[start : start + size]) == old)
    if count > 1:
        return f"matches {count} places; the context is ambiguous"
    return "does not match: its context lines are not in the file"
