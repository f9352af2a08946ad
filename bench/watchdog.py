"""`qwen38 bench watchdog`: what the watchdog costs the server it watches.

The watchdog (`entrypoint.watchdog`) does two things to a server: it reads ``/metrics``
every poll interval, and on a quiet server it sends the canary every canary interval. This
measures both on a running server:

- ``/metrics`` reads: wall time per read, bytes, and the API server's own CPU time per read
  (its ``process_cpu_seconds_total`` before and after ``--reads`` reads: the cost of
  rendering the answer, which is what a poll adds);
- canaries: wall time and tokens of ``--canaries`` canary requests, one after another with
  ``--pause`` between them (the engine's time is the wall time: it does nothing else then).

From them, the load at the default knobs: CPU share of one core the polls take
(CPU per read / `POLL_S`) and the share of the engine's idle time the canary takes
(canary seconds / WATCHDOG_CANARY_INTERVAL). Run it against a server whose own watchdog
canary is off (WATCHDOG_CANARY_INTERVAL=0), or its canaries count in the figures.
"""

from __future__ import annotations

import time
from typing import Any

from bench.stats import distribution
from core.errors import BenchError
from core.settings import Settings
from entrypoint.canary import ask_canary
from entrypoint.client import StackClient, parse_metrics
from entrypoint.watchdog import POLL_S

CPU_SECONDS = "process_cpu_seconds_total"


def _api_cpu(client: StackClient) -> float:
    response = client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text).total(CPU_SECONDS)


def measure_watchdog_cost(client: StackClient, model: str, reads: int, canaries: int, pause: float) -> dict[str, Any]:
    cpu_before = _api_cpu(client)
    times, sizes = [], []
    for _ in range(reads):
        start = time.perf_counter()
        response = client.get("/metrics")
        times.append(time.perf_counter() - start)
        response.raise_for_status()
        sizes.append(len(response.content))
    cpu_after = _api_cpu(client)
    # reads + 1: the closing read of the counter renders the answer too (its own cost counts).
    cpu_per_read = (cpu_after - cpu_before) / (reads + 1)
    answers = []
    for _ in range(canaries):
        time.sleep(pause)
        answers.append(ask_canary(client, model))
    if not answers:
        raise BenchError("--canaries must be at least 1")
    canary_seconds = distribution([a.seconds for a in answers])
    defaults = Settings.model_fields
    canary_interval = defaults["watchdog_canary_interval"].default
    return {
        "metrics_reads": {
            "n": reads,
            "seconds": distribution(times),
            "bytes": int(sum(sizes) / len(sizes)),
            "api_server_cpu_seconds_per_read": cpu_per_read,
        },
        "canaries": {
            "n": len(answers),
            "seconds": canary_seconds,
            "tokens": [a.tokens for a in answers][0],
        },
        "at_defaults": {
            "poll_s": POLL_S,
            "canary_interval_s": canary_interval,
            "api_server_cpu_share_of_one_core": cpu_per_read / POLL_S,
            "idle_engine_time_share": canary_seconds["p50"] / canary_interval,
        },
    }

