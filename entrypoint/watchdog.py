"""The watchdog: after the readiness gate passed, keep proving the server works.

vLLM's ``/health`` answers 200 while its API server runs and the engine has not reported
itself dead: an engine core that stops stepping (a hung kernel, a deadlock, a paused
process) leaves it green, and so would the container's healthcheck. The watchdog runs in
the readiness gate's thread of `qwen38 serve`'s supervisor once the gate passed, reads
``/metrics`` (with the key) every few seconds, and checks:

- **stall**: requests running or waiting and no engine progress for WATCHDOG_STALL_TIMEOUT
  seconds. Progress is a generated token, a finished prefill, or a change of the KV-cache
  usage (a long prompt prefilling in chunks moves it at every chunk before its first token),
  so a long prefill is not a stall. Waiting counts too: a request too big for the pool while
  it runs preempts itself and then waits forever with nothing running (docs/plan.md, "A
  request must fit while it runs"; the planner refuses such contexts, the watchdog catches
  what gets past it).
- **canary**: every WATCHDOG_CANARY_INTERVAL seconds, the readiness gate's greedy canary
  again (`entrypoint.canary`); no answer with a token within WATCHDOG_CANARY_TIMEOUT is a
  failure. It is sent only after a whole poll interval in which nothing ran, waited or
  moved: a busy server proves itself with its own tokens (the stall check watches them),
  and the canary never competes with users' requests nor lands in their counter deltas.
- **acceptance** (where speculative decoding runs: vLLM counts drafts): the acceptance
  length, 1 + accepted / drafts, over each window of `ACCEPTANCE_WINDOW_DRAFTS` drafts; below WATCHDOG_ACCEPTANCE_FLOOR is a
  warning: one line and a field in the status, never unhealthy. Verification is lossless,
  so a drafter that is no longer accepted costs speed, not correctness, and a restart does
  not bring a mismatched drafter back.

A stall or a failed canary makes the server unhealthy: one line on stderr, and the status
file says ``ready: false`` with the reason, so `qwen38 ready --quick` (the container
healthcheck) fails. WATCHDOG_ACTION=stop (the default) then stops the engine and `qwen38
serve` exits 1: Docker's restart policies act on exits, never on an unhealthy check. With
``mark`` the server turns healthy again once the condition clears (tokens flow, a canary
answers), each change one line.

`StallCheck`, `AcceptanceWindow` and `Sample` are pure; `Watchdog.run` is the I/O loop.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from core.errors import ReadinessError
from core.settings import Settings
from entrypoint.canary import ask_canary
from entrypoint.client import COUNTERS, Metrics, StackClient

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
POLL_S = 5.0  # /metrics every 5 s at the defaults; shorter when a knob asks for faster checks
MIN_POLL_S = 0.5
METRICS_TIMEOUT_S = 10.0
ACCEPTANCE_WINDOW_DRAFTS = 200  # the watchdog judges acceptance over this many drafts at a time

STALL, CANARY, METRICS = "stall", "canary", "metrics"
# What the supervisor says it stops the engine for (the watchdog's own line has the details).
STOP_REASONS = {
    STALL: "the watchdog found the engine stalled",
    CANARY: "the watchdog's canary failed",
    METRICS: "the watchdog could not read /metrics",
}


@dataclass(frozen=True)
class WatchdogConfig:
    stall_timeout: float  # 0: off
    canary_interval: float  # 0: off
    canary_timeout: float
    acceptance_floor: float  # 0: off
    action: str  # "stop" | "mark"

    @classmethod
    def from_settings(cls, settings: Settings) -> WatchdogConfig:
        return cls(
            stall_timeout=settings.watchdog_stall_timeout,
            canary_interval=settings.watchdog_canary_interval,
            canary_timeout=settings.watchdog_canary_timeout,
            acceptance_floor=settings.watchdog_acceptance_floor,
            action=settings.watchdog_action,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.stall_timeout or self.canary_interval or self.acceptance_floor)

    @property
    def poll_s(self) -> float:
        """Seconds between two /metrics reads: a quarter of the shortest knob, at most 5 s."""
        quarter = [knob / 4 for knob in (self.stall_timeout, self.canary_interval) if knob > 0]
        return max(MIN_POLL_S, min([POLL_S, *quarter]))


# ---- the pure checks ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """What the watchdog reads from one /metrics answer (summed over model names)."""

    at: float  # time.monotonic() of the read
    running: float
    waiting: float
    generation_tokens: float
    prompt_tokens: float
    kv_usage: float
    drafts: float
    accepted: float

    @classmethod
    def from_metrics(cls, metrics: Metrics, at: float) -> Sample:
        return cls(
            at=at,
            running=metrics.total(RUNNING),
            waiting=metrics.total(WAITING),
            generation_tokens=metrics.total(COUNTERS["generation_tokens"]),
            prompt_tokens=metrics.total(COUNTERS["prompt_tokens"]),
            kv_usage=metrics.total(KV_USAGE),
            drafts=metrics.total(COUNTERS["drafts"]),
            accepted=metrics.total(COUNTERS["accepted_tokens"]),
        )

    def progress(self) -> tuple[float, float, float]:
        return (self.generation_tokens, self.prompt_tokens, self.kv_usage)

    def quiet_since(self, previous: Sample | None) -> bool:
        """Nothing ran, waited or moved between ``previous`` and this read."""
        return (
            previous is not None
            and self.running == self.waiting == previous.running == previous.waiting == 0
            and self.progress() == previous.progress()
        )


class StallCheck:
    """Requests running or waiting and no progress for ``timeout`` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._progress: tuple[float, float, float] | None = None
        self._progress_at = 0.0
        self._busy = False

    def observe(self, sample: Sample) -> float | None:
        """Seconds without progress while requests run or wait, once that reaches the timeout;
        else None.

        The clock starts at the first read that sees requests (after an idle one) or the last
        read that saw progress."""
        busy = sample.running > 0 or sample.waiting > 0
        started = busy and not self._busy
        self._busy = busy
        if self._progress is None or not busy or started or sample.progress() != self._progress:
            self._progress, self._progress_at = sample.progress(), sample.at
            return None
        stalled = sample.at - self._progress_at
        return stalled if self.timeout > 0 and stalled >= self.timeout else None


@dataclass(frozen=True)
class Acceptance:
    length: float  # 1 + accepted / drafts over the window
    drafts: int


class AcceptanceWindow:
    """The acceptance length over consecutive windows of ``drafts`` drafts."""

    def __init__(self, drafts: int = ACCEPTANCE_WINDOW_DRAFTS) -> None:
        self.drafts = drafts
        self._start: Sample | None = None

    def observe(self, sample: Sample) -> Acceptance | None:
        """The acceptance of the window this sample completes; None until one is complete."""
        start = self._start
        if start is None or sample.drafts < start.drafts:  # first read, or counters restarted
            self._start = sample
            return None
        drafts = sample.drafts - start.drafts
        if drafts < self.drafts:
            return None
        self._start = sample
        return Acceptance(length=1 + (sample.accepted - start.accepted) / drafts, drafts=int(drafts))


# ---- what the status file records ------------------------------------------------------------


@dataclass
class WatchdogState:
    """The watchdog's part of the status file (``watchdog`` in `entrypoint.ready.ReadyReport`)."""

    healthy: bool = True
    problem: str | None = None
    problem_kind: str | None = None
    since: float | None = None  # epoch seconds of the problem (or of the recovery)
    polls: int = 0
    canaries: int = 0
    canary_failures: int = 0
    last_canary: dict[str, Any] | None = None  # at (epoch), ok, seconds, tokens, same_as_gate, error
    acceptance: dict[str, Any] | None = None  # length, drafts, at, low
    warning: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return asdict(self)


def say(message: str) -> None:
    print(f"qwen38: watchdog: {message}", file=sys.stderr, flush=True)


class Watchdog:
    """The loop: poll /metrics, run the checks, send the canary, publish changes."""

    def __init__(
        self,
        config: WatchdogConfig,
        base_url: str,
        api_key: str | None,
        model: str,
        gate_answer: str,
        publish: Callable[[WatchdogState], None],
        log: Callable[[str], None] = say,
    ) -> None:
        self.config = config
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self.gate_answer = gate_answer
        self.publish = publish
        self.log = log
        self.state = WatchdogState(
            settings={
                "stall_timeout": config.stall_timeout,
                "canary_interval": config.canary_interval,
                "canary_timeout": config.canary_timeout,
                "acceptance_floor": config.acceptance_floor,
                "action": config.action,
                "poll_s": config.poll_s,
            }
        )
        self.stall = StallCheck(config.stall_timeout)
        self.window = AcceptanceWindow()
        self._wake = threading.Event()

    def wake(self) -> None:
        """End the current wait early (tests; a stop)."""
        self._wake.set()

    # ---- state changes ---------------------------------------------------------------

    def _unhealthy(self, kind: str, problem: str, stop: Callable[[str], None] | None) -> bool:
        """Record a problem; True when the loop must end (the engine is being stopped)."""
        if not self.state.healthy:
            return False  # one line per episode: the first problem stands until it clears
        act = "stopping the engine" if self.config.action == "stop" else "marked unhealthy"
        self.log(f"{problem}; {act} (WATCHDOG_ACTION={self.config.action})")
        self.state.healthy, self.state.problem, self.state.problem_kind = False, problem, kind
        self.state.since = time.time()
        self.publish(self.state)
        if self.config.action == "stop" and stop is not None:
            stop(STOP_REASONS[kind])
            return True
        return False

    def _recovered(self, kind: str, how: str) -> None:
        if self.state.healthy or self.state.problem_kind != kind:
            return
        self.log(f"recovered: {how} (was: {self.state.problem})")
        self.state.healthy, self.state.problem, self.state.problem_kind = True, None, None
        self.state.since = time.time()
        self.publish(self.state)

    # ---- the checks --------------------------------------------------------------------

    def _canary(self, client: StackClient) -> tuple[bool, str]:
        """Send the canary; (True, what it answered) or (False, the problem, for people)."""
        at = time.time()
        self.state.canaries += 1
        try:
            answer = ask_canary(client, self.model)
        except (ReadinessError, httpx.HTTPError) as exc:
            self.state.canary_failures += 1
            if isinstance(exc, httpx.TimeoutException):
                error = f"no answer from {self.model} within {self.config.canary_timeout:g} s (WATCHDOG_CANARY_TIMEOUT)"
            else:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self.state.last_canary = {"at": at, "ok": False, "error": error}
            return False, error
        self.state.last_canary = {
            "at": at,
            "ok": True,
            "seconds": round(answer.seconds, 4),
            "tokens": answer.tokens,
            "same_as_gate": answer.text == self.gate_answer,
        }
        return True, f"a canary answered {answer.tokens} tokens in {answer.seconds:.2f} s"

    def _acceptance(self, sample: Sample) -> None:
        measured = self.window.observe(sample)
        if measured is None or not self.config.acceptance_floor:
            return
        low = measured.length < self.config.acceptance_floor
        self.state.acceptance = {"length": round(measured.length, 4), "drafts": measured.drafts, "at": time.time(), "low": low}
        if low and self.state.warning is None:
            self.state.warning = (
                f"speculative acceptance collapsed: acceptance length {measured.length:.2f} over the last "
                f"{measured.drafts} drafts, below WATCHDOG_ACCEPTANCE_FLOOR={self.config.acceptance_floor:g}; output "
                "is still exact, but the drafter costs more than it saves (is it the drafter this target was "
                "trained with?)"
            )
            self.log(self.state.warning)
            self.publish(self.state)
        elif not low and self.state.warning is not None:
            self.log(f"acceptance recovered: length {measured.length:.2f} over the last {measured.drafts} drafts")
            self.state.warning = None
            self.publish(self.state)

    # ---- the loop ----------------------------------------------------------------------

    def run(
        self,
        alive: Callable[[], bool],
        stopping: Callable[[], bool] = lambda: False,
        stop: Callable[[str], None] | None = None,
    ) -> None:
        """Watch until the engine is gone or a stop began (or, with ``stop``, until it asks for one)."""
        config = self.config
        if not config.enabled:
            return
        self.publish(self.state)
        metrics_timeout = httpx.Timeout(METRICS_TIMEOUT_S, connect=5.0)
        canary_timeout = httpx.Timeout(config.canary_timeout, connect=min(5.0, config.canary_timeout))
        last_read = last_canary = time.monotonic()  # the gate just sent one
        previous: Sample | None = None
        with (
            StackClient(self.base_url, self.api_key, timeout=metrics_timeout) as client,
            StackClient(self.base_url, self.api_key, timeout=canary_timeout) as canary_client,
        ):
            while True:
                self._wake.wait(config.poll_s)
                self._wake.clear()
                if stopping() or not alive():
                    return
                now = time.monotonic()
                try:
                    sample = Sample.from_metrics(client.metrics(), now)
                except httpx.HTTPError as exc:
                    silent = now - last_read
                    if config.stall_timeout and silent >= config.stall_timeout:
                        problem = f"/metrics has not answered for {silent:.0f} s ({type(exc).__name__})"
                        if self._unhealthy(METRICS, problem, stop):
                            return
                    continue
                if stopping() or not alive():
                    return  # a failed read during the stop is the stop, not a problem
                last_read = now
                self.state.polls += 1
                self._recovered(METRICS, "/metrics answers again")

                stalled = self.stall.observe(sample)
                if stalled is not None:
                    problem = (
                        f"engine stalled: {sample.running:.0f} request(s) running"
                        + (f", {sample.waiting:.0f} waiting" if sample.waiting else "")
                        + f" and no token generated or prefilled for {stalled:.0f} s "
                        f"(WATCHDOG_STALL_TIMEOUT={config.stall_timeout:g})"
                    )
                    if self._unhealthy(STALL, problem, stop):
                        return
                else:
                    self._recovered(STALL, "the engine makes progress again")
                self._acceptance(sample)

                due = config.canary_interval and now - last_canary >= config.canary_interval
                if due and sample.quiet_since(previous):
                    last_canary = time.monotonic()
                    ok, how = self._canary(canary_client)
                    if stopping() or not alive():
                        return
                    if ok:
                        self._recovered(CANARY, how)
                        self.publish(self.state)
                    elif self._unhealthy(CANARY, f"canary failed: {how}", stop):
                        return
                    previous = None  # the canary itself moved the counters
                    continue
                previous = sample
