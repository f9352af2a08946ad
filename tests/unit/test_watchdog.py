"""The watchdog's checks as pure functions over /metrics reads (entrypoint.watchdog); the
loop itself runs against the real server in tests/integration/test_watchdog.py."""

from __future__ import annotations

import pytest

from core.settings import Settings
from entrypoint.client import parse_metrics
from entrypoint.watchdog import ACCEPTANCE_WINDOW_DRAFTS, AcceptanceWindow, Sample, StallCheck, WatchdogConfig


def sample(at: float, running=0, waiting=0, generated=0, prompt=0, kv=0.0, drafts=0, accepted=0) -> Sample:
    return Sample(at, running, waiting, generated, prompt, kv, drafts, accepted)


def test_requests_running_without_progress_become_a_stall_only_after_the_timeout():
    check = StallCheck(timeout=10)
    assert check.observe(sample(0, running=1, generated=5)) is None
    assert check.observe(sample(9.9, running=1, generated=5)) is None
    assert check.observe(sample(10.0, running=1, generated=5)) == pytest.approx(10.0)
    assert check.observe(sample(25, running=1, generated=5)) == pytest.approx(25.0)


@pytest.mark.parametrize(
    "moved",
    [{"generated": 6}, {"prompt": 100}, {"kv": 0.01}],
    ids=["a token generated", "a prefill finished", "a prefill chunk moved the KV cache"],
)
def test_any_engine_progress_restarts_the_stall_clock(moved):
    check = StallCheck(timeout=10)
    check.observe(sample(0, running=1, generated=5))
    assert check.observe(sample(8, running=1, **{"generated": 5, **moved})) is None
    assert check.observe(sample(17, running=1, **{"generated": 5, **moved})) is None  # 9 s since the progress
    assert check.observe(sample(18, running=1, **{"generated": 5, **moved})) == pytest.approx(10.0)


def test_a_request_left_waiting_with_nothing_running_is_a_stall_too():
    """A request too big for the pool while it runs preempts itself and then waits forever,
    nothing running (docs/plan.md); a queue that moves is not a stall."""
    check = StallCheck(timeout=10)
    assert check.observe(sample(0, running=1, waiting=1, generated=5, kv=0.5)) is None
    assert check.observe(sample(4, running=0, waiting=1, generated=5, kv=0.8)) is None  # it preempted itself
    assert check.observe(sample(13.9, running=0, waiting=1, generated=5, kv=0.8)) is None
    assert check.observe(sample(14, running=0, waiting=1, generated=5, kv=0.8)) == pytest.approx(10.0)
    moving = StallCheck(timeout=10)
    for t in range(0, 60, 5):  # waiting behind busy slots while tokens flow
        assert moving.observe(sample(t, running=4, waiting=2, generated=5 + t)) is None


def test_an_idle_server_is_never_stalled():
    check = StallCheck(timeout=10)
    for t in range(0, 100, 5):
        assert check.observe(sample(t, running=0, generated=5)) is None
    # a request that starts after a long idle time gets its whole timeout
    assert check.observe(sample(100, running=1, generated=5)) is None
    assert check.observe(sample(109, running=1, generated=5)) is None


def test_a_zero_timeout_turns_the_stall_check_off():
    check = StallCheck(timeout=0)
    check.observe(sample(0, running=1))
    assert check.observe(sample(10_000, running=1)) is None


def test_acceptance_is_judged_once_per_window_of_drafts():
    window = AcceptanceWindow(drafts=100)
    assert window.observe(sample(0, drafts=10, accepted=30)) is None  # the first read opens the window
    assert window.observe(sample(1, drafts=109, accepted=60)) is None  # 99 drafts: not yet
    judged = window.observe(sample(2, drafts=110, accepted=80))
    assert judged is not None and judged.drafts == 100 and judged.length == pytest.approx(1.5)
    assert window.observe(sample(3, drafts=150, accepted=80)) is None  # a new window began at 110
    collapsed = window.observe(sample(4, drafts=210, accepted=81))
    assert collapsed is not None and collapsed.length == pytest.approx(1.01)


def test_acceptance_window_starts_again_when_the_counters_do():
    window = AcceptanceWindow(drafts=100)
    window.observe(sample(0, drafts=500, accepted=900))
    assert window.observe(sample(1, drafts=20, accepted=10)) is None  # a new engine: counters from 0
    judged = window.observe(sample(2, drafts=120, accepted=310))
    assert judged is not None and judged.length == pytest.approx(4.0)


def test_quiet_means_nothing_ran_waited_or_moved_since_the_previous_read():
    idle = sample(0, generated=5, prompt=9)
    assert sample(5, generated=5, prompt=9).quiet_since(idle)
    assert not sample(5, generated=5, prompt=9).quiet_since(None)  # one read proves nothing
    assert not sample(5, generated=6, prompt=9).quiet_since(idle)  # a request came and went
    assert not sample(5, running=1, generated=5, prompt=9).quiet_since(idle)
    assert not sample(5, waiting=1, generated=5, prompt=9).quiet_since(idle)


def test_a_sample_reads_the_names_vllm_exports():
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:generation_tokens_total{engine="0",model_name="m"} 24.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.79e+09
vllm:prompt_tokens_total{engine="0",model_name="m"} 66.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 22.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0
"""
    read = Sample.from_metrics(parse_metrics(text), at=3.0)
    assert read == Sample(3.0, 2, 1, 24, 66, 0.25, 22, 7)


def test_polls_come_four_times_per_shortest_knob_and_at_least_every_five_seconds():
    defaults = WatchdogConfig.from_settings(Settings(_env_file=None))
    assert (defaults.stall_timeout, defaults.canary_interval, defaults.action) == (120, 60, "stop")
    assert defaults.poll_s == 5.0 and defaults.enabled
    fast = WatchdogConfig.from_settings(
        Settings(_env_file=None, watchdog_stall_timeout=6, watchdog_canary_interval=3)
    )
    assert fast.poll_s == 0.75
    off = WatchdogConfig.from_settings(
        Settings(_env_file=None, watchdog_stall_timeout=0, watchdog_canary_interval=0, watchdog_acceptance_floor=0)
    )
    assert not off.enabled


def test_the_acceptance_window_is_long_enough_to_mean_something():
    # A window of a few drafts would warn on one unlucky request.
    assert ACCEPTANCE_WINDOW_DRAFTS >= 100


def test_a_watchdog_knob_out_of_range_is_one_settings_error():
    from core.errors import SettingsError
    from core.settings import load_settings

    with pytest.raises(SettingsError, match="WATCHDOG_ACTION="):
        load_settings(env_file=None, watchdog_action="reboot")
    with pytest.raises(SettingsError, match="WATCHDOG_STALL_TIMEOUT="):
        load_settings(env_file=None, watchdog_stall_timeout=-1)
