"""The gate of a worker host: a multi-host profile's node rank 1.. is up while its head is.

A worker host runs its share of the GPUs headless (vLLM ``--headless``): no API server, so
nothing to ask a canary. Readiness is the head's: the head's own gate (`entrypoint.ready`)
proves the pair answers, through both hosts. What the worker can prove itself is that its
head is there: the head's torch.distributed rendezvous port (HEAD_ADDRESS:HEAD_PORT, the
store rank 0 keeps open while the engine lives) accepts a connection.

`WorkerGate.run` (a thread of `qwen38 serve`'s supervisor, like the head's gate) waits up to
READY_TIMEOUT for that port, then records ``ready`` with the head's address in the status
file (`qwen38 ready --quick` checks the port again: the worker's container healthcheck), and
keeps watching. vLLM 0.28.0's headless worker does not notice a head that went away (seen
here: it idles on after the head's engine has exited), and a head that starts again waits
for a worker that never rejoins; so once the port stops answering for `LOST_AFTER_S`, the
gate stops the worker's engine (its tensor-parallel workers, stuck in a collective with the
departed head, killed at once) and `qwen38 serve` exits non-zero: compose's
``restart: unless-stopped`` starts it again, and it joins the next head. A head restarts in
more than that (a container start plus a vLLM import before its rendezvous opens), so the
worker is gone before the new head waits for it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from core.errors import ReadinessError
from core.profiles import Profile
from core.settings import Settings
from entrypoint.lifecycle import is_running, port_answers, process_start_time
from entrypoint.ready import ReadyReport, base_url_for
from entrypoint.resolved_engine import ResolvedEngine

POLL_S = 2.0
LOST_AFTER_S = 6.0  # three polls in a row without an answer


def head_of(resolved: ResolvedEngine) -> tuple[str, int]:
    par = resolved.parallel
    if par is None or not par.headless or par.head_address is None or par.head_port is None:
        raise ReadinessError(f"profile {resolved.profile}: this host is not a worker of a multi-host profile")
    return par.head_address, par.head_port


class WorkerGate:
    """The worker host's companion in `qwen38 serve`'s supervisor: waits for the head, then
    watches it, and stops the engine when it has gone."""

    def __init__(
        self,
        profile: Profile,
        settings: Settings,
        resolved: ResolvedEngine,
        identity: str | None = None,
        answers: Callable[[str, int], bool] = port_answers,
        poll_s: float = POLL_S,
        lost_after_s: float = LOST_AFTER_S,
    ) -> None:
        self.profile = profile
        self.settings = settings
        self.address, self.port = head_of(resolved)
        self.identity = identity
        self.answers = answers
        self.poll_s = poll_s
        self.lost_after_s = lost_after_s

    @property
    def head(self) -> str:
        return f"{self.address}:{self.port}"

    def _report(self, ready: bool, seconds: float, error: str | None = None) -> ReadyReport:
        report = ReadyReport(ready, base_url_for(self.settings), self.profile.model_ids, seconds, error=error)
        report.identity = self.identity
        report.head = self.head
        if ready:
            report.checks = [f"head {self.head} answers (torch.distributed rendezvous of node rank 0)"]
            report.ready_at = time.time()
        return report

    def run(
        self,
        engine_pid: int,
        stop: Callable[..., None] | None = None,
        publish: Callable[[ReadyReport], None] | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> int:
        started = process_start_time(engine_pid)
        publish = publish or (lambda report: None)
        stop = stop or (lambda reason=None, workers_wedged=False: None)

        def alive() -> bool:
            return is_running(engine_pid, started)

        begin = time.monotonic()
        while not self.answers(self.address, self.port):
            waited = time.monotonic() - begin
            if stopping() or not alive():
                return 1
            if waited > self.settings.ready_timeout:
                timeout = self.settings.ready_timeout
                error = f"the head {self.head} did not answer within {timeout:.0f} s (READY_TIMEOUT)"
                publish(self._report(False, waited, error))
                print(f"qwen38: ready: {error}; stopping the engine (fail closed)", file=sys.stderr, flush=True)
                stop(error)
                return 1
            time.sleep(self.poll_s)
        publish(self._report(True, time.monotonic() - begin))
        print(f"qwen38: worker ready: the head {self.head} answers; the head's gate proves the pair", flush=True)
        return self._watch(alive, stopping, stop, publish)

    def _watch(self, alive, stopping, stop, publish) -> int:
        silent_since: float | None = None
        while not stopping() and alive():
            if self.answers(self.address, self.port):
                silent_since = None
            else:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since >= self.lost_after_s:
                    error = f"the head {self.head} stopped answering for {self.lost_after_s:.0f} s"
                    publish(self._report(False, 0.0, error))
                    print(f"qwen38: {error}: stopping this worker, to join the next head", file=sys.stderr, flush=True)
                    stop(error, workers_wedged=True)  # they wait in a collective with the departed head
                    return 1
            time.sleep(self.poll_s)
        return 0
