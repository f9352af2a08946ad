"""Measuring a running server: streamed requests with arrival times, concurrency, /metrics windows.

Every request is a streamed chat completion with ``return_token_ids`` (vLLM sends the ids
of each chunk, so tokens are counted exactly even when one chunk carries several accepted
draft tokens) and ``stream_options.include_usage`` (the server's own count, to check
against). A point's requests run as jobs: each job's requests in order, ``concurrency``
jobs at a time; vLLM's counters are read just before and just after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.stats import COUNTERS, MetricDelta, RequestRecord, metric_delta
from core.errors import BenchError
from entrypoint.client import Metrics, StackClient

CHAT = "/v1/chat/completions"


class ServerTokenizer:
    """The server's tokenizer through /tokenize and /detokenize (sizing is the server's)."""

    def __init__(self, client: StackClient, model: str) -> None:
        self.client = client
        self.model = model

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, {"model": self.model, **body})
        if response.status_code != 200:
            raise BenchError(
                f"{self.client.base_url}{path} answered {response.status_code}: {response.text[:200]} "
                "(the benchmarks size prompts with the server's tokenizer: a vLLM server exposes /tokenize)"
            )
        return response.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]

    def count_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        body: dict[str, Any] = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
        if tools:
            body["tools"] = tools
        return int(self._post("/tokenize", body)["count"])


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the chat body (without streaming flags) and what to expect."""

    body: dict[str, Any]
    expected_prompt_tokens: int
    max_tokens: int
    label: str = ""


@dataclass
class PointRun:
    records: list[RequestRecord]
    duration_s: float
    delta: MetricDelta
    started_at: float = 0.0
    notes: list[str] = field(default_factory=list)


def stream_request(client: StackClient, spec: RequestSpec, record: RequestRecord, origin: float) -> None:
    """Send one streamed chat request and fill ``record`` (times relative to ``origin``)."""
    body = {**spec.body, "stream_options": {"include_usage": True}, "return_token_ids": True}
    record.sent_s = time.perf_counter() - origin
    try:
        result = client.stream(CHAT, body)
    except httpx.HTTPStatusError as exc:
        raise BenchError(f"request {record.index} ({record.label}): {exc}") from None
    record.done_s = time.perf_counter() - origin
    record.stream_done = result.done
    pieces: list[str] = []
    for at, event in zip(result.arrival_s, result.events):
        if "error" in event and not event.get("choices"):
            raise BenchError(f"request {record.index} ({record.label}): the stream reported {event['error']}")
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids")
            if ids:
                record.chunks.append((at, len(ids)))
            pieces.append((choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                record.cached_tokens = int(details["cached_tokens"])
    record.text = "".join(pieces)
    if record.completion_tokens and not record.chunks:
        raise BenchError(
            f"request {record.index}: the stream carried no token_ids (the server ignores return_token_ids; "
            "the benchmarks need vLLM's token ids to count streamed tokens)"
        )


def settled_metrics(client: StackClient, before: Metrics, expected_generation: int, timeout: float = 5.0) -> Metrics:
    """Read /metrics until the generation counter has caught up (counters trail responses)."""
    name = COUNTERS["generation_tokens"]
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        now = client.metrics()
        moved = now.total(name) - before.total(name)
        if moved >= expected_generation and previous is not None and now.samples == previous.samples:
            return now
        if time.monotonic() > deadline:
            return now
        previous = now
        time.sleep(0.05)


def run_point(client: StackClient, jobs: Sequence[Sequence[RequestSpec]], concurrency: int) -> PointRun:
    """Run ``jobs`` (each a sequence of requests sent one after another), ``concurrency`` at a time."""
    records: list[list[RequestRecord]] = []
    index = 0
    for j, job in enumerate(jobs):
        row = []
        for t, spec in enumerate(job):
            row.append(
                RequestRecord(
                    index=index,
                    job=j,
                    turn=t,
                    label=spec.label,
                    max_tokens=spec.max_tokens,
                    expected_prompt_tokens=spec.expected_prompt_tokens,
                )
            )
            index += 1
        records.append(row)
    failed = threading.Event()
    errors: list[BaseException] = []

    def run_job(j: int) -> None:
        for spec, record in zip(jobs[j], records[j]):
            if failed.is_set():
                return
            try:
                stream_request(client, spec, record, origin)
            except (BenchError, httpx.HTTPError) as exc:
                errors.append(exc)
                failed.set()
                return

    before = client.metrics()
    origin = time.perf_counter()
    wall = time.time()
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="bench") as pool:
        try:
            list(pool.map(run_job, range(len(jobs))))
        except KeyboardInterrupt:
            failed.set()  # jobs stop after their request in flight
            raise
    duration = time.perf_counter() - origin
    if errors:
        first = errors[0]
        if isinstance(first, BenchError):
            raise first
        if isinstance(first, httpx.TimeoutException):
            raise BenchError(
                f"a benchmark request failed: the server sent nothing within the request timeout ({first}); "
                "a long prompt's prefill can take longer: raise --request-timeout (seconds)"
            )
        raise BenchError(f"a benchmark request failed: {first}")
    flat = [r for row in records for r in row]
    after = settled_metrics(client, before, sum(r.completion_tokens or 0 for r in flat))
    return PointRun(flat, duration, metric_delta(before, after), started_at=wall)


def warm_up(client: StackClient, specs: Sequence[RequestSpec]) -> None:
    """Unmeasured requests first: the first request after a start pays one-off costs."""
    for i, spec in enumerate(specs):
        record = RequestRecord(
            index=-1 - i,
            job=0,
            turn=0,
            label="warm-up",
            max_tokens=spec.max_tokens,
            expected_prompt_tokens=spec.expected_prompt_tokens,
        )
        stream_request(client, spec, record, time.perf_counter())
