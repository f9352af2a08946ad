"""The arithmetic of the serving benchmarks: pure functions over what was measured.

Definitions (the same for every workload, see docs/benchmarks.md):

- output tok/s (aggregate): completion tokens of all requests / wall time from the first
  request sent to the last one finished (what `vllm bench serve` calls output throughput);
- decode tok/s (single stream): per request, (streamed tokens - 1) / (last token arrival -
  first token arrival): the decode speed one client sees, prefill excluded;
- TTFT: request sent -> first chunk carrying a token;
- inter-token latency: the gaps between token-carrying chunks, a chunk of n tokens (several
  tokens per step under speculative decoding) counting as n gaps of gap/n, so the mean ITL is
  exactly 1 / decode tok/s;
- acceptance length: 1 + accepted / drafts, and per position i: accepted_at_i / drafts, from
  deltas of vLLM's speculative counters over the run;
- prefix-cache hit rate: hits / queries (tokens) from deltas of vLLM's counters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from entrypoint.client import ACCEPTED_PER_POSITION, COUNTERS, Metrics

# ---- distributions -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float | int] | None:
    """n, mean, p50, p90, p99, min, max of ``values`` (None when there are none)."""
    if not values:
        return None
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


# ---- one request -------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What one streamed request produced, with times in seconds since the point started."""

    index: int
    job: int
    turn: int
    label: str
    max_tokens: int
    expected_prompt_tokens: int
    sent_s: float = 0.0
    done_s: float = 0.0
    # (seconds since sent, tokens in the chunk) for every chunk that carried tokens.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    stream_done: bool = False
    text: str = ""

    @property
    def streamed_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def latency_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def decode_s(self) -> float:
        return self.chunks[-1][0] - self.chunks[0][0] if self.chunks else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        after_first = self.streamed_tokens - 1
        return after_first / self.decode_s if after_first > 0 and self.decode_s > 0 else None

    def token_gaps(self) -> list[float]:
        """Per-token inter-token latencies (see the module docstring); len = tokens - 1."""
        if not self.chunks:
            return []
        gaps = [0.0] * (self.chunks[0][1] - 1)  # tokens that came with the first one
        previous = self.chunks[0][0]
        for at, n in self.chunks[1:]:
            if n:
                gaps += [(at - previous) / n] * n
                previous = at
        return gaps

    def to_json(self) -> dict[str, Any]:
        itl = self.token_gaps()
        return {
            "index": self.index,
            "job": self.job,
            "turn": self.turn,
            "label": self.label,
            "sent_s": round(self.sent_s, 6),
            "ttft_s": _round(self.ttft_s),
            "latency_s": round(self.latency_s, 6),
            "decode_tok_s": _round(self.decode_tok_s),
            "itl_p50_s": _round(percentile(itl, 50) if itl else None),
            "itl_p99_s": _round(percentile(itl, 99) if itl else None),
            "prompt_tokens": self.prompt_tokens,
            "expected_prompt_tokens": self.expected_prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "streamed_tokens": self.streamed_tokens,
            "max_tokens": self.max_tokens,
            "chunks": len(self.chunks),
            "max_tokens_per_chunk": max((n for _, n in self.chunks), default=0),
            "finish_reason": self.finish_reason,
        }


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


# ---- /metrics deltas ---------------------------------------------------------------------


@dataclass
class MetricDelta:
    """How much vLLM's counters moved over a window (summed over every label set)."""

    counters: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in COUNTERS})
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    def __add__(self, other: MetricDelta) -> MetricDelta:
        positions = set(self.accepted_per_position) | set(other.accepted_per_position)
        return MetricDelta(
            {k: self.counters.get(k, 0.0) + other.counters.get(k, 0.0) for k in COUNTERS},
            {p: self.accepted_per_position.get(p, 0.0) + other.accepted_per_position.get(p, 0.0) for p in positions},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: int(v) if float(v).is_integer() else v for k, v in self.counters.items()},
            "accepted_per_position": [int(self.accepted_per_position[p]) for p in sorted(self.accepted_per_position)],
        }


def metric_delta(before: Metrics, after: Metrics) -> MetricDelta:
    counters = {key: after.total(name) - before.total(name) for key, name in COUNTERS.items()}
    start = before.by_label(ACCEPTED_PER_POSITION, "position")
    end = after.by_label(ACCEPTED_PER_POSITION, "position")
    per_position = {int(p): v - start.get(p, 0.0) for p, v in end.items()}
    return MetricDelta(counters, per_position)


def speculation(delta: MetricDelta) -> dict[str, Any] | None:
    """Acceptance figures, or None when no draft was verified in the window."""
    c = delta.counters
    drafts = c["drafts"]
    if drafts <= 0:
        return None
    positions = [delta.accepted_per_position[p] for p in sorted(delta.accepted_per_position)]
    return {
        "drafts": int(drafts),
        "draft_tokens": int(c["draft_tokens"]),
        "accepted_tokens": int(c["accepted_tokens"]),
        "num_speculative_tokens": len(positions) or None,
        "acceptance_length": 1 + c["accepted_tokens"] / drafts,
        "draft_acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else None,
        "per_position_acceptance": [v / drafts for v in positions],
    }


def prefix_cache(delta: MetricDelta) -> dict[str, Any]:
    queries, hits = delta.counters["prefix_cache_queries"], delta.counters["prefix_cache_hits"]
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries > 0 else None}


# ---- a point (one concurrency / one depth) -----------------------------------------------


def summarize(records: Sequence[RequestRecord], duration_s: float, delta: MetricDelta) -> dict[str, Any]:
    """The figures of one measured window."""
    completion = sum(r.completion_tokens or 0 for r in records)
    prompt = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    decode = [r.decode_tok_s for r in records if r.decode_tok_s is not None]
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    itl = [gap for r in records for gap in r.token_gaps()]
    tpot = [r.decode_s / (r.streamed_tokens - 1) for r in records if r.streamed_tokens > 1]
    cached = [r.cached_tokens for r in records if r.cached_tokens is not None]
    uncached_ttft = [r.ttft_s for r in records if r.ttft_s is not None and r.cached_tokens == 0]
    cached_ttft = [r.ttft_s for r in records if r.ttft_s is not None and (r.cached_tokens or 0) > 0]
    spec = speculation(delta)
    prefix = prefix_cache(delta)
    return {
        "requests": len(records),
        "duration_s": duration_s,
        "prompt_tokens": {
            "total": sum(prompt),
            "mean": sum(prompt) / len(prompt) if prompt else None,
            "min": min(prompt, default=None),
            "max": max(prompt, default=None),
        },
        "completion_tokens": completion,
        "output_tok_s": completion / duration_s if duration_s > 0 else None,
        "total_tok_s": (completion + sum(prompt)) / duration_s if duration_s > 0 else None,
        "decode_tok_s": distribution(decode),
        "ttft_s": distribution(ttft),
        "ttft_s_without_cached_prefix": distribution(uncached_ttft),
        "ttft_s_with_cached_prefix": distribution(cached_ttft),
        "itl_s": distribution(itl),
        "tpot_s": distribution(tpot),
        "latency_s": distribution([r.latency_s for r in records]),
        "cached_tokens": sum(cached) if cached else None,
        "prefix_cache": prefix,
        "speculation": spec,
        "acceptance_length": spec["acceptance_length"] if spec else None,
        "preemptions": int(delta.counters["preemptions"]),
        "metrics_delta": delta.to_json(),
    }


# ---- self-consistency --------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One consistency check; a failed ``fatal`` check makes the run's figures untrustworthy."""

    name: str
    ok: bool
    detail: str
    fatal: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "fatal": self.fatal}


def _mismatches(records: Sequence[RequestRecord], pairs) -> list[str]:
    return [f"request {r.index}: {a} vs {b}" for r in records for a, b in [pairs(r)] if a != b]


def _all_equal(name: str, records: Sequence[RequestRecord], pairs, what: str) -> Check:
    bad = _mismatches(records, pairs)
    if bad:
        return Check(name, False, f"{len(bad)} of {len(records)} differ: " + "; ".join(bad[:3]))
    return Check(name, True, f"{len(records)} of {len(records)} requests: {what}")


def consistency_checks(records: Sequence[RequestRecord], delta: MetricDelta, *, ignore_eos: bool = True) -> list[Check]:
    """Do the numbers agree with each other? (stream vs usage vs /tokenize vs /metrics)"""
    checks = [
        Check(
            "every stream ended with [DONE] and a usage chunk",
            all(r.stream_done and r.completion_tokens is not None for r in records),
            f"{sum(r.stream_done for r in records)} of {len(records)} complete",
        ),
        _all_equal(
            "streamed token ids = usage.completion_tokens",
            records,
            lambda r: (r.streamed_tokens, r.completion_tokens),
            "equal",
        ),
        _all_equal(
            "usage.prompt_tokens = /tokenize of the request",
            records,
            lambda r: (r.prompt_tokens, r.expected_prompt_tokens),
            "equal",
        ),
    ]
    if ignore_eos:
        checks.append(
            _all_equal(
                "usage.completion_tokens = max_tokens (EOS ignored)",
                records,
                lambda r: (r.completion_tokens, r.max_tokens),
                "equal",
            )
        )
    completion = sum(r.completion_tokens or 0 for r in records)
    prompt = sum(r.prompt_tokens or 0 for r in records)
    c = delta.counters
    other_traffic = " (other traffic on the server during the run? then /metrics figures include it)"
    checks.append(
        Check(
            "/metrics generation tokens = sum of usage.completion_tokens",
            c["generation_tokens"] == completion,
            f"{c['generation_tokens']:.0f} vs {completion}"
            + ("" if c["generation_tokens"] == completion else other_traffic),
        )
    )
    checks.append(
        Check(
            "/metrics prompt tokens = sum of usage.prompt_tokens",
            c["prompt_tokens"] == prompt,
            f"{c['prompt_tokens']:.0f} vs {prompt}" + ("" if c["prompt_tokens"] == prompt else other_traffic),
        )
    )
    if c["drafts"] > 0:
        positions = [delta.accepted_per_position[p] for p in sorted(delta.accepted_per_position)]
        k = len(positions)
        checks.append(
            Check(
                "accepted tokens <= draft tokens",
                c["accepted_tokens"] <= c["draft_tokens"],
                f"{c['accepted_tokens']:.0f} <= {c['draft_tokens']:.0f}",
            )
        )
        checks.append(
            Check(
                "sum of per-position accepted = accepted tokens",
                sum(positions) == c["accepted_tokens"],
                f"{sum(positions):.0f} vs {c['accepted_tokens']:.0f} over {k} positions",
            )
        )
        checks.append(
            Check(
                "per-position accepted never rises with the position",
                all(a >= b for a, b in itertools.pairwise(positions)),
                " ".join(f"{v:.0f}" for v in positions),
            )
        )
        checks.append(
            Check(
                "draft tokens <= drafts x K",
                k > 0 and c["draft_tokens"] <= c["drafts"] * k,
                f"{c['draft_tokens']:.0f} <= {c['drafts']:.0f} x {k}",
            )
        )
        # A fixed-depth drafter (DFlash, MTP) proposes K every step; fewer means some drafts
        # were cut (vLLM drops draft tokens it cannot use): worth seeing, not wrong.
        checks.append(
            Check(
                "draft tokens = drafts x K (fixed-depth drafter)",
                c["draft_tokens"] == c["drafts"] * k,
                f"{c['draft_tokens']:.0f} vs {c['drafts']:.0f} x {k}",
                fatal=False,
            )
        )
        # Each verify step yields 1 + its accepted tokens, and each request's first token
        # comes from its prefill: equal when every decode step verified a draft (tokens
        # accepted past max_tokens and steps without a draft make it differ).
        steps = len(records) + c["drafts"] + c["accepted_tokens"]
        checks.append(
            Check(
                "generation tokens = requests + drafts + accepted (every decode step drafted)",
                c["generation_tokens"] == steps,
                f"{c['generation_tokens']:.0f} vs {len(records)} + {c['drafts']:.0f} + {c['accepted_tokens']:.0f}",
                fatal=False,
            )
        )
    cached = [r.cached_tokens for r in records if r.cached_tokens is not None]
    if cached and c["prefix_cache_queries"] > 0:
        checks.append(
            Check(
                "sum of usage cached_tokens = /metrics prefix-cache hits",
                sum(cached) == c["prefix_cache_hits"],
                f"{sum(cached)} vs {c['prefix_cache_hits']:.0f}",
                fatal=False,
            )
        )
    return checks
