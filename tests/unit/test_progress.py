"""`core.progress`: what a person following `docker compose logs` sees of a long step (a
line every PLAIN_EVERY_S, with a fake clock: no test sleeps), what a terminal gets, and what
LOG_LEVEL lets through."""

from __future__ import annotations

import io
import re

import pytest

from core import progress
from core.progress import Progress, format_duration, say, watching


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def info_level():
    progress.set_level("info")
    yield
    progress.set_level(None)


def test_without_a_terminal_a_line_every_interval_with_amount_percent_rate_and_time_left():
    clock, out = Clock(), io.StringIO()
    step = Progress("base: download model-00001.safetensors", 4_000_000_000, stream=out, clock=clock)
    for _ in range(59):  # 50 MB a second for 59 s: two lines, at 20 s and 40 s
        clock.now += 1
        step.update(50_000_000)
    assert out.getvalue().splitlines() == [
        "qwen38: base: download model-00001.safetensors: 1.00 GB of 4.00 GB (25%), 50.0 MB/s, 1 min 0 s left",
        "qwen38: base: download model-00001.safetensors: 2.00 GB of 4.00 GB (50%), 50.0 MB/s, 40 s left",
    ]
    clock.now += 1
    step.update(1_050_000_000)  # a burst: the rate shown is the one since the previous line
    lines = out.getvalue().splitlines()
    assert lines[2] == "qwen38: base: download model-00001.safetensors: 4.00 GB of 4.00 GB (100%), 100.0 MB/s, 0 s left"
    step.close()  # the closing line gives the mean rate
    assert out.getvalue().splitlines()[3] == (
        "qwen38: base: download model-00001.safetensors: 4.00 GB in 1 min 0 s (66.7 MB/s)"
    )


def test_the_interval_is_the_default_20_s_and_no_line_comes_before_it():
    assert progress.PLAIN_EVERY_S == 20.0
    clock, out = Clock(), io.StringIO()
    step = Progress("sha256 x", 100, stream=out, clock=clock)
    clock.now += 19.9
    step.update(10)
    assert out.getvalue() == ""
    clock.now += 0.1
    step.update(10)
    assert out.getvalue() == "qwen38: sha256 x: 20 B of 100 B (20%), 1 B/s, 1 min 20 s left\n"


def test_a_short_step_prints_nothing_a_longer_one_only_its_closing_line():
    clock, out = Clock(), io.StringIO()
    with Progress("sha256 config.json", 1000, stream=out, clock=clock) as step:
        clock.now += 1.9
        step.update(1000)
    assert out.getvalue() == ""
    with Progress("sha256 model.safetensors", 3_200_000_000, stream=out, clock=clock) as step:
        clock.now += 8
        step.update(3_200_000_000)
    assert out.getvalue() == "qwen38: sha256 model.safetensors: 3.20 GB in 8 s (400.0 MB/s)\n"


def test_a_step_that_fails_says_where_it_stopped():
    clock, out = Clock(), io.StringIO()
    with pytest.raises(OSError), Progress("base: download a.safetensors", 10_000_000, stream=out, clock=clock) as step:
        clock.now += 30
        step.update(2_500_000)
        raise OSError("connection reset")
    assert out.getvalue().splitlines()[-1] == (
        "qwen38: base: download a.safetensors: stopped at 2.5 MB of 10.0 MB (25%) after 30 s"
    )


def test_a_stalled_transfer_still_reports_and_says_the_time_left_is_unknown():
    clock, out = Clock(), io.StringIO()
    step = Progress("base: download a", 1_000_000, stream=out, clock=clock)
    clock.now += 25
    step.advance_to(0)
    assert out.getvalue() == "qwen38: base: download a: 0 B of 1.0 MB (0%), 0 B/s, time left unknown\n"


def test_counts_other_than_bytes():
    clock, out = Clock(), io.StringIO()
    step = Progress("adapter: modules converted", 64, unit="module", stream=out, clock=clock)
    clock.now += 20
    step.update(16)
    assert out.getvalue() == (
        "qwen38: adapter: modules converted: 16 of 64 modules (25%), 0.80 modules/s, 1 min 0 s left\n"
    )


def test_in_a_terminal_a_bar_and_no_plain_lines():
    clock, out = Clock(), Terminal()
    step = Progress("sha256 model.safetensors", 100, stream=out, clock=clock)
    assert step.mode == "bar"
    clock.now += 60
    step.update(50)
    assert "sha256 model.safetensors" in out.getvalue() and "qwen38:" not in out.getvalue()
    quiet = Progress("base: download x", 100, stream=Terminal(), clock=clock, bar=False)
    assert quiet.mode == "off"  # the hub draws its own bar there


def test_watching_counts_bytes_already_there_as_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "WATCH_POLL_S", 3600.0)  # the thread never ticks: only the closing read
    staged = tmp_path / "x.part"
    staged.write_bytes(b"a" * 400)
    clock, out = Clock(), io.StringIO()
    with watching(staged, "base: download x", 1000, stream=out, clock=clock):
        with open(staged, "ab") as handle:
            handle.write(b"b" * 600)
        clock.now += 3
    assert out.getvalue() == "qwen38: base: download x: 1.0 kB in 3 s (200 B/s, 400 B were already there)\n"


def test_durations_read_as_a_person_writes_them():
    assert [format_duration(s) for s in (0.4, 42, 250, 1550, 3900)] == [
        "0 s", "42 s", "4 min 10 s", "25 min 50 s", "1 h 5 min",
    ]


# ---- LOG_LEVEL ------------------------------------------------------------------------


def test_at_warning_our_informational_lines_and_progress_are_left_out_warnings_print(capsys):
    progress.set_level("warning")
    clock, out = Clock(), io.StringIO()
    step = Progress("sha256 x", 100, stream=out, clock=clock)
    clock.now += 60
    step.update(100)
    step.close()
    assert step.mode == "off" and out.getvalue() == ""
    say("qwen38: verified cpu in 0.10 s")
    say("qwen38: prepare: cannot write the stat cache", level="warning")
    assert capsys.readouterr().out == "qwen38: prepare: cannot write the stat cache\n"
    progress.set_level("error")
    say("qwen38: a warning", level="warning")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("level", ["debug", "info"])
def test_at_debug_and_info_they_print(level, capsys):
    progress.set_level(level)
    say("qwen38: ready in 1.0 s")
    assert capsys.readouterr().out == "qwen38: ready in 1.0 s\n"


def test_the_level_is_the_log_level_setting(monkeypatch, tmp_path):
    progress.set_level(None)
    monkeypatch.chdir(tmp_path)  # no .env here
    monkeypatch.setenv("LOG_LEVEL", "warning")
    assert progress.current_level() == "warning" and not progress.informational()
    monkeypatch.setenv("LOG_LEVEL", "debug")
    assert progress.current_level() == "debug" and progress.informational()
    monkeypatch.delenv("LOG_LEVEL")
    (tmp_path / ".env").write_text("LOG_LEVEL=error\n")  # a .env in the working directory counts too
    assert progress.current_level() == "error"


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match=re.escape("unknown log level 'loud'")):
        progress.set_level("loud")
