"""Progress of long steps, readable in a terminal and in `docker compose logs`; and which
of our own lines LOG_LEVEL lets through.

A step that takes minutes (a download, hashing 25 GB, a requantization) reports through one
`Progress`:

- in a terminal (its stream is a TTY): a tqdm bar, redrawn in place;
- anywhere else (a container's log, a pipe, a file): a plain line every `PLAIN_EVERY_S`
  seconds with what is done of the total, the percentage, the rate since the previous line
  and the time left at that rate; then one closing line with the total, the time it took
  and the mean rate, for every step that printed a line or took `FINAL_AFTER_S` or more.

`watching` follows a file something else writes (huggingface_hub's ``http_get`` into our
staging file, a copy): a thread reads its size every `WATCH_POLL_S` seconds, so nothing
depends on how the writer reports progress.

LOG_LEVEL (`say`, `informational`): at ``debug`` and ``info`` our informational lines print
(progress, the start-up heartbeat, "verified", "planned", "serving", "ready", what prepare
did); at ``warning`` and above they do not, while warnings and errors still print (errors
are `StackError` lines, printed by the CLI regardless). The level is the LOG_LEVEL setting
(environment or ``.env``), read once per value; `set_level` overrides it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from core.errors import StackError
from core.settings import load_settings

PLAIN_EVERY_S = 20.0  # without a terminal, a progress line this often
FINAL_AFTER_S = 2.0  # a step at least this long ends with a closing line
WATCH_POLL_S = 1.0  # how often `watching` reads the size of the file being written

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_override: str | None = None
_configured: tuple[tuple[str | None, str], str] | None = None  # ((LOG_LEVEL env, cwd), level)


# ---- LOG_LEVEL ------------------------------------------------------------------------


def set_level(level: str | None) -> None:
    """Use ``level`` for our lines from now on (None: the LOG_LEVEL setting again)."""
    global _override
    if level is not None and level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    _override = level.lower() if level is not None else None


def current_level() -> str:
    """The level our lines follow: `set_level`'s, else the LOG_LEVEL setting, else ``info``."""
    global _configured
    if _override is not None:
        return _override
    key = (os.environ.get("LOG_LEVEL"), os.getcwd())
    if _configured is None or _configured[0] != key:
        _configured = (key, _setting())
    return _configured[1]


def _setting() -> str:
    try:
        return str(load_settings().log_level).lower()
    except StackError:
        return "info"  # the command itself reports what is wrong with the settings


def enabled(level: str = "info") -> bool:
    return LEVELS[level] >= LEVELS.get(current_level(), LEVELS["info"])


def informational() -> bool:
    """Whether our informational lines print (LOG_LEVEL debug or info)."""
    return enabled("info")


def say(message: str, *, level: str = "info", file: TextIO | None = None) -> None:
    """Print one of our lines if LOG_LEVEL lets ``level`` through (stdout unless ``file``)."""
    if enabled(level):
        print(message, file=file if file is not None else sys.stdout, flush=True)


# ---- formatting -----------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """``42 s``, ``4 min 10 s``, ``1 h 5 min``."""
    whole = max(0, int(round(seconds)))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def format_amount(value: float, unit: str = "B") -> str:
    """Bytes in decimal units (``4.20 GB``, ``512.0 MB``); any other unit as a count (``12 modules``)."""
    if unit != "B":
        return f"{value:,.0f} {unit}s"
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= scale:
            return f"{value / scale:.2f} {name}" if scale >= 1e9 else f"{value / scale:.1f} {name}"
    return f"{value:.0f} B"


def format_part(done: float, total: float, unit: str = "B") -> str:
    """``1.20 GB of 4.00 GB``, ``12 of 64 modules``."""
    if unit != "B":
        return f"{done:,.0f} of {format_amount(total, unit)}"
    return f"{format_amount(done)} of {format_amount(total)}"


def format_rate(per_second: float, unit: str = "B") -> str:
    if unit == "B":
        return f"{format_amount(per_second)}/s"
    return f"{per_second:.2f} {unit}s/s" if per_second < 10 else f"{per_second:,.0f} {unit}s/s"


# ---- progress -------------------------------------------------------------------------


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress of one step over ``total`` units (bytes unless ``unit`` names another).

    ``update(n)`` adds ``n`` done, ``advance_to(n)`` sets what is done; both are
    thread-safe (hash_files calls from its threads). ``bar=False`` shows nothing in a
    terminal (where the work draws its own bar) and keeps the plain lines elsewhere;
    ``shown=False`` shows nothing at all. ``clock`` and ``every`` are for tests.
    """

    def __init__(
        self,
        what: str,
        total: int,
        *,
        unit: str = "B",
        initial: int = 0,
        bar: bool = True,
        shown: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        every: float | None = None,
    ) -> None:
        self.what = what
        self.total = max(0, int(total))
        self.unit = unit
        self.done = initial
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.every = PLAIN_EVERY_S if every is None else every
        self.lines = 0
        self._lock = threading.Lock()
        self._started = clock()
        self._initial = initial
        self._last = (self._started, initial)
        self._closed = False
        self._bar: Any = None
        if not shown or not informational():
            self.mode = "off"
        elif _is_terminal(self.stream):
            self.mode = "bar" if bar else "off"
        else:
            self.mode = "lines"
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, initial=initial, desc=what, unit=unit, unit_scale=True,
                unit_divisor=1000, leave=False, file=self.stream, dynamic_ncols=True,
            )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            self._advanced(n)

    def advance_to(self, done: int) -> None:
        with self._lock:
            step = done - self.done
            self.done = done
            self._advanced(step)

    def _advanced(self, step: int) -> None:
        if self._closed:
            return
        if self._bar is not None:
            if step >= 0:
                self._bar.update(step)
            else:  # the file was started over
                self._bar.n = self.done
                self._bar.refresh()
        elif self.mode == "lines":
            now = self.clock()
            if now - self._last[0] >= self.every:
                self._write(self.line(now))
                self._last = (now, self.done)

    def line(self, now: float) -> str:
        """The periodic line: done of total, percent, rate since the last line, time left."""
        since, before = self._last
        rate = (self.done - before) / (now - since) if now > since else 0.0
        left = self.total - self.done
        eta = f"{format_duration(left / rate)} left" if rate > 0 else "time left unknown"
        if rate <= 0 and left <= 0:
            eta = "done"
        return (
            f"qwen38: {self.what}: {format_part(self.done, self.total, self.unit)} ({self.percent():.0f}%), "
            f"{format_rate(max(rate, 0.0), self.unit)}, {eta}"
        )

    def percent(self) -> float:
        return 100.0 if self.total <= 0 else min(100.0, 100.0 * self.done / self.total)

    def final_line(self, now: float, *, failed: bool = False) -> str:
        took = now - self._started
        moved = self.done - self._initial
        rate = f"{format_rate(moved / took, self.unit)}" if took > 0 else "at once"
        if failed or self.done < self.total:
            return (
                f"qwen38: {self.what}: stopped at {format_part(self.done, self.total, self.unit)} "
                f"({self.percent():.0f}%) after {format_duration(took)}"
            )
        resumed = f", {format_amount(self._initial, self.unit)} were already there" if self._initial else ""
        return (
            f"qwen38: {self.what}: {format_amount(self.total, self.unit)} in {format_duration(took)} "
            f"({rate}{resumed})"
        )

    def close(self, *, failed: bool = False) -> None:
        """End the step: the bar goes; a closing line for a step that printed or took a while."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            if self.mode == "off":
                return
            now = self.clock()
            if self.lines or now - self._started >= FINAL_AFTER_S:
                self._write(self.final_line(now, failed=failed))

    def _write(self, text: str) -> None:
        self.lines += 1
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):
            pass  # a closed or broken stream never fails the work it reports on


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


@contextlib.contextmanager
def watching(path: Path | str, what: str, total: int, *, bar: bool = True, **kw: Any) -> Iterator[Progress]:
    """Report how ``path`` grows towards ``total`` bytes while the block writes it.

    A thread reads the file's size every `WATCH_POLL_S` seconds (bytes already there count
    as resumed); the closing line says how far it got when the block fails."""
    path = Path(path)
    progress = Progress(what, total, initial=_size(path), bar=bar, **kw)
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(WATCH_POLL_S):
            progress.advance_to(_size(path))

    thread = threading.Thread(target=follow, name="progress-watch", daemon=True)
    if progress.mode != "off":
        thread.start()
    failed = True
    try:
        yield progress
        failed = False
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        progress.advance_to(_size(path))
        progress.close(failed=failed)


def hashing(paths: list[Path], what: str, **kw: Any) -> Progress:
    """A `Progress` over the sizes of ``paths``, for `core.hashing.hash_files`'s ``progress``."""
    return Progress(what, sum(_size(p) for p in paths), **kw)
