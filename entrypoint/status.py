"""`qwen38 status`: the few figures that say how a running server is doing, in the terminal.

From the server's ``/metrics`` (with the key): output and prompt tok/s (counter deltas
between two reads ``--interval`` apart), requests running and waiting, KV-cache use,
prefix-cache hit rate, speculative acceptance, uptime (the API server's process start).
From ``/v1/models``: the ids. From ``/health``: the instance id, and with it the status file
of that very start where this machine has it (`entrypoint.ready`: the gate, the watchdog's
verdict, the last canary); another start's file is not shown as this server's.

`summarize` is pure (two snapshots in, one `ServerStatus` out) and `format_status` prints
it; ``--watch`` refreshes until Ctrl-C, ``--json`` prints the figures as data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from core.errors import MonitoringError
from entrypoint.client import COUNTERS, Metrics, StackClient, parse_metrics
from entrypoint.ready import read_status
from entrypoint.watchdog import KV_USAGE, RUNNING, WAITING

PROCESS_START = "process_start_time_seconds"


@dataclass
class ServerStatus:
    base_url: str
    instance: str | None
    healthy: bool  # /health answered 200
    model_ids: list[str]
    interval_s: float
    output_tok_s: float
    prompt_tok_s: float
    running: int
    waiting: int
    kv_usage: float  # 0..1
    prefix_hit_rate: float | None  # over the interval, else since start; None: nothing looked up
    acceptance_length: float | None  # 1 + accepted / drafts; None: no speculation
    acceptance_rate: float | None  # accepted / drafted tokens
    acceptance_window: str = ""  # "last 2.0 s" or "since start"
    uptime_s: float | None = None
    verdict: str = "unknown"  # ready | unhealthy: ... | gate failed: ... | unknown (no status file here)
    canary: dict[str, Any] | None = None
    canaries: int = 0
    canary_failures: int = 0
    warning: str | None = None
    notes: list[str] = field(default_factory=list)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _delta(before: Metrics, after: Metrics, key: str) -> float:
    name = COUNTERS[key]
    return after.total(name) - before.total(name)


def summarize(
    before: Metrics,
    after: Metrics,
    seconds: float,
    *,
    base_url: str,
    model_ids: list[str],
    instance: str | None,
    healthy: bool,
    status: dict[str, Any] | None,
    now: float,
) -> ServerStatus:
    """The figures of two /metrics snapshots ``seconds`` apart, and the start's status file."""
    hits, queries = _delta(before, after, "prefix_cache_hits"), _delta(before, after, "prefix_cache_queries")
    drafts, accepted = _delta(before, after, "drafts"), _delta(before, after, "accepted_tokens")
    drafted = _delta(before, after, "draft_tokens")
    window = f"last {seconds:.1f} s"
    if drafts <= 0:  # nothing drafted in the interval: the figures since the start
        drafts, accepted = after.total(COUNTERS["drafts"]), after.total(COUNTERS["accepted_tokens"])
        drafted = after.total(COUNTERS["draft_tokens"])
        window = "since start"
    if queries <= 0:
        hits, queries = after.total(COUNTERS["prefix_cache_hits"]), after.total(COUNTERS["prefix_cache_queries"])
    speculating = COUNTERS["drafts"] in after.samples
    started = after.samples.get(PROCESS_START)
    result = ServerStatus(
        base_url=base_url,
        instance=instance,
        healthy=healthy,
        model_ids=model_ids,
        interval_s=seconds,
        output_tok_s=_delta(before, after, "generation_tokens") / seconds if seconds > 0 else 0.0,
        prompt_tok_s=_delta(before, after, "prompt_tokens") / seconds if seconds > 0 else 0.0,
        running=int(after.total(RUNNING)),
        waiting=int(after.total(WAITING)),
        kv_usage=after.total(KV_USAGE),
        prefix_hit_rate=_ratio(hits, queries),
        acceptance_length=(1 + accepted / drafts) if speculating and drafts > 0 else None,
        acceptance_rate=_ratio(accepted, drafted) if speculating else None,
        acceptance_window=window if speculating else "",
        uptime_s=now - started[0][1] if started else None,
    )
    if status is None:
        result.notes.append("no status file of this start here (run on the server's machine for gate and canary)")
        return result
    watchdog = status.get("watchdog") or {}
    if status.get("ready"):
        result.verdict = "ready"
    elif watchdog:
        result.verdict = f"unhealthy: {status.get('error')}"
    else:
        result.verdict = f"not ready: {status.get('error')}"
    result.canary = watchdog.get("last_canary")
    result.canaries = int(watchdog.get("canaries", 0))
    result.canary_failures = int(watchdog.get("canary_failures", 0))
    result.warning = watchdog.get("warning")
    if not watchdog:
        result.notes.append("the watchdog has not reported (it starts once the gate passed)")
    return result


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h {minutes} min"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def format_status(status: ServerStatus, now: float) -> str:
    """The figures for people: one line each."""
    canary = "-"
    if status.canary:
        age = _duration(now - status.canary["at"]) + " ago"
        if status.canary.get("ok"):
            same = "same answer as the gate" if status.canary.get("same_as_gate") else "answer differs from the gate's"
            canary = f"ok in {status.canary['seconds']:.2f} s, {status.canary['tokens']} tokens, {age} ({same})"
        else:
            canary = f"FAILED {age}: {status.canary.get('error')}"
        canary += f"; {status.canaries} sent, {status.canary_failures} failed"
    if status.acceptance_length is None:
        acceptance = "- (no speculative decoding)"
    else:
        acceptance = (
            f"length {status.acceptance_length:.2f}, rate {_percent(status.acceptance_rate)} ({status.acceptance_window})"
        )
    rows = [
        ("server", f"{status.base_url} (instance {status.instance or 'unknown'}; /health "
                   f"{'200' if status.healthy else 'DOWN'})"),  # fmt: skip
        ("verdict", status.verdict),
        ("models", ", ".join(status.model_ids) or "-"),
        ("uptime", _duration(status.uptime_s) if status.uptime_s is not None else "-"),
        ("tok/s", f"{status.output_tok_s:.1f} out, {status.prompt_tok_s:.1f} prompt (last {status.interval_s:.1f} s)"),
        ("queue", f"{status.running} running, {status.waiting} waiting"),
        ("KV cache", f"{_percent(status.kv_usage)} used; prefix-cache hits {_percent(status.prefix_hit_rate)}"),
        ("acceptance", acceptance),
        ("canary", canary),
    ]
    if status.warning:
        rows.append(("warning", status.warning))
    lines = [f"{name:<11} {value}" for name, value in rows]
    lines += [f"{'note':<11} {note}" for note in status.notes]
    return "\n".join(lines)


# ---- I/O edge ---------------------------------------------------------------------------------


def read_server(client: StackClient) -> tuple[Metrics, bool, str | None]:
    """/metrics (with the key), whether /health answers, and the instance id."""
    response = client.get("/metrics")
    if response.status_code in (401, 403):
        raise MonitoringError(f"{client.base_url}/metrics answered {response.status_code}: wrong or missing API key")
    response.raise_for_status()

    return parse_metrics(response.text), client.health(), client.instance()


def collect(client: StackClient, interval: float, settings, profile_name: str, previous=None) -> tuple[ServerStatus, Any]:
    """One status: the previous read (or a fresh one ``interval`` ago) and a new one."""

    if previous is None:
        before, _, _ = read_server(client)
        started = time.monotonic()
        time.sleep(interval)
    else:
        before, started = previous
    after, healthy, instance = read_server(client)
    taken = time.monotonic()
    try:
        ids = client.model_ids()
    except httpx.HTTPError:
        ids = []
    status = read_status(settings, profile_name)
    if status is not None and (instance is None or status.get("instance") != instance):
        status = None  # another start's file: not this server's verdict
    summary = summarize(
        before, after, taken - started, base_url=client.base_url, model_ids=ids, instance=instance,
        healthy=healthy, status=status, now=time.time(),
    )  # fmt: skip
    return summary, (after, taken)
