"""The readiness gate: a deployment is ready only when it proves it.

1. ``/health`` answers 200, from the server this start launched: its ``x-qwen38-instance``
   header carries this start's instance id (another server on the port is not ours);
2. ``/v1/models`` lists every id the profile serves, and with a key configured refuses a
   request without it (the key guard is in place);
3. a greedy canary request to the base answers with at least one token;
4. for LoRA profiles, the adapter's greedy answer differs from the base's (upstream vLLM
   has an open report of LoRA on this model family silently returning base output).

`qwen38 serve` runs it in a thread of its supervisor (`entrypoint.supervise`), records the
outcome in a status file (read by `qwen38 ready --quick`, the container healthcheck, which
checks the instance id again) and stops the engine when the gate fails: fail closed. Once
it passed, the same thread runs the watchdog (`entrypoint.watchdog`), which keeps the
status current: a stalled engine or a failed canary turns it to ``ready: false``.
`qwen38 ready` runs the gate against any deployment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx
from pydantic import SecretStr

from core.atomic import atomic_write_text
from core.errors import ReadinessError
from core.profiles import Profile
from core.progress import say
from core.settings import Settings
from entrypoint.canary import ask_canary
from entrypoint.client import StackClient
from entrypoint.engine_output import FIRST_PHASE, Heartbeat, StartPhase
from entrypoint.lifecycle import is_running, port_answers, process_start_time
from entrypoint.run_files import status_path


@dataclass
class ReadyReport:
    ready: bool
    base_url: str
    model_ids: list[str]
    seconds: float
    canary: str = ""
    adapter_canary: str | None = None
    identity: str | None = None
    error: str | None = None
    checks: list[str] = field(default_factory=list)
    instance: str | None = None  # the start's instance id (x-qwen38-instance)
    pid: int | None = None  # the supervisor that wrote it
    ready_at: float | None = None  # epoch seconds when the gate passed
    watchdog: dict | None = None  # `entrypoint.watchdog.WatchdogState` once the gate passed
    head: str | None = None  # a worker host's: the head HOST:PORT it follows (`entrypoint.worker_gate`)


def wait_for_health(
    client: StackClient,
    timeout: float,
    alive: Callable[[], bool] = lambda: True,
    on_wait: Callable[[float], None] | None = None,
) -> float:
    """Poll /health until it answers 200; seconds waited. Fails fast if the engine died.

    ``on_wait(seconds waited)`` runs at each poll (`qwen38 serve`'s start-up heartbeat)."""
    start = time.monotonic()
    delay = 0.25  # a local request: polling each second at most costs nothing and ends the wait promptly
    while not client.health():
        if on_wait is not None:
            on_wait(time.monotonic() - start)
        if not alive():
            raise ReadinessError("the engine exited before it became healthy (see its log above)")
        if time.monotonic() - start > timeout:
            raise ReadinessError(
                f"{client.base_url}/health did not answer 200 within {timeout:.0f} s (READY_TIMEOUT)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    return time.monotonic() - start


def run_gate(
    client: StackClient,
    base_id: str,
    adapter_id: str | None,
    timeout: float,
    alive: Callable[[], bool] = lambda: True,
    instance: str | None = None,
    on_wait: Callable[[float], None] | None = None,
) -> ReadyReport:
    """The four checks, in order; raises `ReadinessError` naming the first that fails.

    With ``instance``, the server answering must be the one started with that id;
    ``on_wait`` runs while /health does not answer yet (`wait_for_health`)."""
    start = time.monotonic()
    expected = [base_id] + ([adapter_id] if adapter_id else [])
    report = ReadyReport(ready=False, base_url=client.base_url, model_ids=expected, seconds=0.0)
    wait_for_health(client, timeout, alive, on_wait)
    if instance is not None:
        check_instance(client, instance)
        report.checks.append(f"health: 200 from instance {instance}")
    else:
        report.checks.append("health: 200")
    try:
        listed = client.model_ids()
    except httpx.HTTPStatusError as exc:
        raise ReadinessError(f"/v1/models answered {exc.response.status_code} (wrong API key?)") from None
    missing = [m for m in expected if m not in listed]
    if missing:
        raise ReadinessError(f"/v1/models lists {listed}; missing {missing}")
    report.checks.append(f"models: {', '.join(expected)}")
    if client.has_key:
        keyless = client.get("/v1/models", api_key=None).status_code
        if keyless != 401:
            raise ReadinessError(
                f"/v1/models answered {keyless} to a request without the API key: the key guard is not in place"
            )
        report.checks.append("key: a request without it gets 401")
    try:
        report.canary = ask_canary(client, base_id).text
        report.checks.append(f"canary: {base_id} answered")
        if adapter_id:
            report.adapter_canary = ask_canary(client, adapter_id).text
            if report.adapter_canary == report.canary:
                raise ReadinessError(
                    f"adapter {adapter_id} answered exactly like the base {base_id} at temperature 0: "
                    "the LoRA is not being applied (see vLLM #49354)"
                )
            report.checks.append(f"adapter: {adapter_id} differs from {base_id}")
    except httpx.HTTPStatusError as exc:
        raise ReadinessError(f"canary request failed: {exc}") from None
    report.ready = True
    report.seconds = time.monotonic() - start
    return report


def check_instance(client: StackClient, instance: str) -> None:
    """The server at ``client.base_url`` is the one started with ``instance``."""
    answered = client.instance()
    if answered != instance:
        raise ReadinessError(
            f"{client.base_url} is answered by another server (instance {answered or 'unknown'}, this start is "
            f"{instance}): is the port in use by another process?"
        )


def base_url_for(settings: Settings) -> str:
    host = settings.host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def write_status(settings: Settings, profile_name: str, report: ReadyReport) -> None:
    atomic_write_text(status_path(settings.cache_dir, profile_name), json.dumps(asdict(report), indent=2) + "\n")


def read_status(settings: Settings, profile_name: str) -> dict | None:
    try:
        return json.loads(status_path(settings.cache_dir, profile_name).read_text())
    except (OSError, ValueError):
        return None


class Watcher:
    """The engine's companion (a thread of `qwen38 serve`'s supervisor): runs the gate,
    reports, fails closed. While it waits for the first /health it prints a heartbeat with
    the start's phase (``phase``: what the engine's output says, `entrypoint.engine_output`)."""

    def __init__(
        self,
        profile: Profile,
        settings: Settings,
        api_key: SecretStr | None,
        identity: str | None = None,
        instance: str | None = None,
        began: float | None = None,
        phase: StartPhase | None = None,
    ):
        self.profile = profile
        self.phase = phase
        self.settings = settings
        self.api_key = api_key
        self.identity = identity
        self.instance = instance
        self.began = began  # time.monotonic() when `qwen38 serve` began, for the whole start's figure
        self.base_url = base_url_for(settings)

    def run(
        self,
        engine_pid: int,
        stop: Callable[..., None] | None = None,
        publish: Callable[[ReadyReport], None] | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> int:
        """Gate the engine ``engine_pid``; on failure ``stop()`` it (default: SIGTERM to it).

        Once the gate passed, watch it (`entrypoint.watchdog`) until it exits or ``stopping()``;
        a watchdog that acts calls ``stop(reason)``."""
        started = process_start_time(engine_pid)
        publish = publish or (lambda report: write_status(self.settings, self.profile.name, report))

        def alive() -> bool:
            # A pid alone may be reused once the engine exits; pid and start time are not.
            return is_running(engine_pid, started)

        def stop_engine(reason: str | None = None) -> None:
            if stop is None:
                os.kill(engine_pid, signal.SIGTERM)
            elif reason is None:
                stop()
            else:
                stop(reason)

        key = self.api_key.get_secret_value() if self.api_key else None
        phase = self.phase
        heartbeat = Heartbeat(lambda: phase.current if phase is not None else FIRST_PHASE, self.settings.ready_timeout)
        with StackClient(self.base_url, key) as client:
            try:
                report = run_gate(
                    client, self.profile.served.base, self.profile.served.adapter, self.settings.ready_timeout, alive,
                    instance=self.instance, on_wait=heartbeat,
                )
            except (ReadinessError, httpx.TransportError) as exc:
                error = str(exc)
                if phase is not None and phase.current != FIRST_PHASE:  # where a start that ran out of time was
                    error += f"; last phase in its output: {phase.current}"
                report = ReadyReport(False, self.base_url, self.profile.model_ids, 0.0, error=error)
                report.identity = self.identity
                publish(report)
                if alive():
                    print(f"qwen38: ready: {error}; stopping the engine (fail closed)", file=sys.stderr, flush=True)
                    stop_engine()
                return 1
        report.identity = self.identity
        report.ready_at = time.time()
        publish(report)
        key_note = self.settings.api_key_source() or "no API key (loopback only)"
        # The gate's seconds count from the engine's release (after verify and plan, which print
        # their own); the whole start is what a user waited.
        whole = "" if self.began is None else f" ({time.monotonic() - self.began:.1f} s since serve began)"
        say(
            f"qwen38: ready in {report.seconds:.1f} s{whole} at {self.base_url}/v1 "
            f"(models: {', '.join(report.model_ids)}; API key: {key_note})"
        )
        self._watch(report, key, publish, alive, stopping, stop_engine)
        return 0

    def _watch(
        self,
        report: ReadyReport,
        key: str | None,
        publish: Callable[[ReadyReport], None],
        alive: Callable[[], bool],
        stopping: Callable[[], bool],
        stop_engine: Callable[[str], None],
    ) -> None:
        """The watchdog after the gate: each change of its state rewrites the status."""
        # only the gate's thread watches: the healthcheck (`ready --quick`) does not load the watchdog
        from entrypoint.watchdog import Watchdog, WatchdogConfig, WatchdogState

        def publish_state(state: WatchdogState) -> None:
            report.watchdog = state.public()
            report.ready = state.healthy
            report.error = None if state.healthy else f"watchdog: {state.problem}"
            publish(report)

        config = WatchdogConfig.from_settings(self.settings)
        dog = Watchdog(config, self.base_url, key, self.profile.served.base, report.canary, publish_state)
        dog.run(alive, stopping, stop_engine)


# ---- the container healthcheck -----------------------------------------------------------


def healthcheck(profile: Profile, settings: Settings, base_url: str, secret: str | None) -> None:
    """`qwen38 ready --quick`, the container healthcheck: the gate passed once (the status file
    says so), and the server still answers, the very one that passed it. Raises `ReadinessError`."""
    path = status_path(settings.cache_dir, profile.name)
    try:
        status = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        raise ReadinessError(f"{path}: no readiness status yet (the gate has not finished)") from None
    if not status.get("ready"):
        if status.get("watchdog"):  # the gate passed; the watchdog found a problem since
            raise ReadinessError(f"unhealthy: {status.get('error')}")
        raise ReadinessError(f"readiness gate failed: {status.get('error')}")
    if status.get("head"):  # a worker host serves no API: its head must still answer
        address, _, port = status["head"].rpartition(":")
        if not port_answers(address, int(port)):
            raise ReadinessError(f"the head {status['head']} does not answer")
        return
    with StackClient(base_url, secret) as client:
        if not client.health():
            raise ReadinessError(f"{base_url}/health does not answer 200")
        if status.get("instance"):
            check_instance(client, status["instance"])  # still the server that passed the gate
