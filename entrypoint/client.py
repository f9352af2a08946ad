"""A small HTTP client for a running deployment (httpx): the readiness gate, the
validators and the benchmarks all talk to the server through it.

It knows the endpoints vLLM 0.28.0 serves (OpenAI chat/completions/responses, Anthropic
messages, /v1/models, /health, /metrics) and parses Prometheus text for metric deltas.
The API key travels as ``Authorization: Bearer`` (the stack's guard also takes Anthropic's
``x-api-key``, `entrypoint.auth`); it is never logged or repr'd.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from entrypoint.asgi import INSTANCE_HEADER

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0)

# vLLM's counters that the watchdog, `qwen38 status` and the benchmarks read (short name ->
# metric name).
COUNTERS = {
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    # Requests the scheduler took off the GPU for want of KV pages (vLLM 0.28.0
    # v1/metrics/loggers.py: the counter "vllm:num_preemptions").
    "preemptions": "vllm:num_preemptions_total",
}
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class _UseDefault:
    """Marker: use the client's own key (``None`` means: send no key at all)."""


_USE_DEFAULT = _UseDefault()


@dataclass(frozen=True)
class Metrics:
    """A /metrics snapshot: sample name -> list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float:
        """Sum of every sample of ``name`` whose labels include ``labels``."""
        return sum(
            value
            for sample_labels, value in self.samples.get(name, [])
            if all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for sample_labels, value in self.samples.get(name, []):
            key = sample_labels.get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + value
        return out


def parse_metrics(text: str) -> Metrics:
    """Prometheus text exposition -> `Metrics`, keyed by sample name (``x_total``, ``x_bucket``...),
    label values unescaped. Parsed by prometheus_client's own parser; a malformed line is skipped
    (the rest of the scrape still counts)."""
    from prometheus_client.parser import text_string_to_metric_families  # ~0.2 s to import: only when parsing

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}

    def add(families: Iterable[Any]) -> None:
        for family in families:
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))

    try:
        add(list(text_string_to_metric_families(text)))
    except ValueError:  # one bad line spoils the whole parse: parse line by line, skipping the bad ones
        samples.clear()
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                add(list(text_string_to_metric_families(line + "\n")))
            except ValueError:
                continue
    return Metrics(samples)


@dataclass
class StreamResult:
    """What a streamed request produced: the events, and when each data event arrived."""

    events: list[Any]
    arrival_s: list[float]
    done: bool


class StackClient:
    """Talks to one deployment. ``api_key`` may be None (then no Authorization header)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: httpx.Timeout = DEFAULT_TIMEOUT):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def __repr__(self) -> str:  # never shows the key
        return f"StackClient({self.base_url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StackClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def has_key(self) -> bool:
        return bool(self._api_key)

    def headers(self, api_key: str | None | _UseDefault = _USE_DEFAULT) -> dict[str, str]:
        key = self._api_key if isinstance(api_key, _UseDefault) else api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ---- plain endpoints ----------------------------------------------------------------

    def get(self, path: str, *, api_key: str | None | _UseDefault = _USE_DEFAULT) -> httpx.Response:
        return self._http.get(path, headers=self.headers(api_key))

    def post(self, path: str, body: dict[str, Any], *, api_key: str | None | _UseDefault = _USE_DEFAULT) -> httpx.Response:
        return self._http.post(path, json=body, headers=self.headers(api_key))

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def instance(self) -> str | None:
        """The ``x-qwen38-instance`` id the server answers /health with (None: none, or down)."""

        try:
            return self._http.get("/health", timeout=5.0).headers.get(INSTANCE_HEADER)
        except httpx.TransportError:
            return None

    def model_ids(self) -> list[str]:
        response = self.get("/v1/models")
        response.raise_for_status()
        return [entry["id"] for entry in response.json()["data"]]

    def metrics(self) -> Metrics:
        response = self.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.post(path, body)
        if response.status_code != 200:
            raise httpx.HTTPStatusError(
                f"{path} answered {response.status_code}: {response.text[:300]}",
                request=response.request,
                response=response,
            )
        return response.json()

    # ---- streaming ----------------------------------------------------------------------

    def stream(self, path: str, body: dict[str, Any]) -> StreamResult:
        """POST with ``stream: true`` and collect server-sent events with arrival times."""
        import time

        events: list[Any] = []
        arrivals: list[float] = []
        done = False
        start = time.perf_counter()
        with self._http.stream("POST", path, json={**body, "stream": True}, headers=self.headers()) as response:
            if response.status_code != 200:
                response.read()
                raise httpx.HTTPStatusError(
                    f"{path} (stream) answered {response.status_code}: {response.text[:300]}",
                    request=response.request,
                    response=response,
                )
            for data in _sse_data(response.iter_lines()):
                if data == "[DONE]":
                    done = True
                    continue
                arrivals.append(time.perf_counter() - start)
                events.append(json.loads(data))
        return StreamResult(events=events, arrival_s=arrivals, done=done)


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()
