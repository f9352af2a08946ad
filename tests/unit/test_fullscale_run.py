"""What `qwen38 bench fullscale run` does next, from the run's state and the time left."""

from __future__ import annotations

from bench import fullscale_steps as fs
from bench.fullscale_run import MEASURE_S, PREP, Action, RunState, Server, next_action

H200 = 150_000_000_000  # 139.8 GiB
CAP = fs.HEADLESS_3090_BYTES


def state(*servers: Server, prepared=PREP, attribution=True, total=H200, warmed=True) -> RunState:
    return RunState(tuple(prepared), servers, total, attribution, warmed)


def server(name: str, status: str, budget: int = CAP, measure: bool = True) -> Server:
    return Server(name, status, budget, measure)  # type: ignore[arg-type]


def test_preparation_comes_first_in_order_and_only_when_its_estimate_fits():
    assert next_action(state(prepared=()), 540) == Action("prep", "patches")
    assert next_action(state(prepared=PREP[:2]), 540) == Action("prep", "prebuild")
    assert next_action(state(prepared=PREP[:3]), 540) == Action("prep", "generate")
    ended = next_action(state(prepared=PREP[:3]), 100)
    assert ended.kind == "end" and ended.name == "generate" and "100 s left" in ended.why


def test_the_first_cold_start_runs_alone():
    servers = [server("single-full", "starting"), server("long-full", "pending")]
    got = next_action(state(*servers, warmed=False), 540)
    assert got.kind == "wait" and "cold start runs alone" in got.why
    assert next_action(state(*servers, warmed=True), 540) == Action("start", "long-full")
    # A short lease's choice: side by side from the first start (still `STAGGER_S` apart).
    assert next_action(state(*servers, warmed=False), 540, first_alone=False) == Action("start", "long-full")


def test_servers_start_side_by_side_while_their_budgets_fit_the_device():
    pending = [server("single-full", "pending"), server("long-full", "pending"),
               server("spark-lora-full", "pending", 64 << 30), server("single-nospec-full", "pending")]
    assert next_action(state(*pending), 540) == Action("start", "single-full")
    two_up = [server("single-full", "starting"), server("long-full", "starting"), *pending[2:]]
    assert next_action(state(*two_up), 540) == Action("start", "spark-lora-full")
    three_up = [*two_up[:2], server("spark-lora-full", "starting", 64 << 30), pending[3]]
    # 3 x 23.7 + 64 GiB + a context each + the reserve > 139.8 GiB: the fourth waits
    assert next_action(state(*three_up), 540) == Action("wait", "single-full")


def test_side_by_side_starts_are_staggered():
    """Four servers started at one instant on the 2026-12-07 lease: three died importing torch."""
    from bench.fullscale_run import STAGGER_S

    young = Server("single-full", "starting", CAP, True, STAGGER_S - 1)
    got = next_action(state(young, server("long-full", "pending")), 540)
    assert got == Action("wait", "single-full", f"starts are {STAGGER_S:.0f} s apart")
    older = Server("single-full", "starting", CAP, True, STAGGER_S + 1)
    assert next_action(state(older, server("long-full", "pending")), 540) == Action("start", "long-full")


def test_a_ready_server_is_measured_only_while_nothing_else_is_starting():
    one_ready = [server("single-full", "ready"), server("long-full", "starting")]
    assert next_action(state(*one_ready), 540).kind == "wait"
    both = [server("single-full", "ready"), server("long-full", "ready"), server("single-nospec-full", "pending")]
    assert next_action(state(*both), 540) == Action("measure", "single-full")  # not a new start first
    late = next_action(state(*both), MEASURE_S["quick"] - 1)
    assert late.kind == "end" and late.name == "single-full"


def test_a_measured_server_is_stopped_and_a_timing_only_restart_is_stopped_once_ready():
    measured = [server("single-full", "measured"), server("long-full", "ready")]
    assert next_action(state(*measured), 540) == Action("stop", "single-full")
    warm = [server("single-full", "stopped"), server("single-warm-full", "ready", measure=False)]
    assert next_action(state(*warm), 540) == Action("stop", "single-warm-full")


def test_without_our_pids_in_nvidia_smi_one_server_runs_at_a_time():
    servers = [server("single-full", "starting"), server("long-full", "pending")]
    got = next_action(state(*servers, attribution=False), 540)
    assert got.kind == "wait" and "one server at a time" in got.why
    alone = [server("single-full", "stopped"), server("long-full", "pending")]
    assert next_action(state(*alone, attribution=False), 540) == Action("start", "long-full")


def test_a_call_ends_while_servers_start_and_the_run_reports_when_nothing_is_left():
    starting = [server("single-full", "starting")]
    assert next_action(state(*starting), 10).kind == "end"
    finished = [server("single-full", "stopped"), server("long-full", "failed"), server("x", "skipped")]
    assert next_action(state(*finished), 540) == Action("report")
