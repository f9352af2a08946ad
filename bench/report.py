"""Benchmark results: the JSON document, the table people read, comparisons and plots.

The JSON document (schema ``qwen38-bench/1``) holds the workload, its parameters, the
server's identity, the software versions and the machine, the headline figures at the top
level (``output_tok_s``, ``decode_tok_s``, ``ttft_s``, ``itl_s``, ``acceptance_length``,
``prefix_cache_hit_rate``: null when not measured; ``preemptions``), one entry per point (concurrency or
depth) with its full summary, every request, and the consistency checks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.measurement import PointRun
from bench.stats import MetricDelta, consistency_checks, summarize
from bench.workloads import Point, Workload
from core.atomic import atomic_file
from core.errors import BenchError

SCHEMA = "qwen38-bench/1"


def copy_fidelity(answer: str, reference: str) -> float:
    """Share of the reference reproduced verbatim from its start (leading whitespace aside)."""
    answer = answer.lstrip()
    same = 0
    for a, b in zip(answer, reference):
        if a != b:
            break
        same += 1
    return same / len(reference) if reference else 0.0


def _headline(summary: dict[str, Any]) -> dict[str, Any]:
    def p50(key: str) -> float | None:
        dist = summary.get(key)
        return dist["p50"] if dist else None

    spec = summary.get("speculation")
    return {
        "output_tok_s": summary["output_tok_s"],
        "decode_tok_s": p50("decode_tok_s"),
        "ttft_s": p50("ttft_s"),
        "itl_s": p50("itl_s"),
        "acceptance_length": summary["acceptance_length"],
        "per_position_acceptance": spec["per_position_acceptance"] if spec else None,
        "prefix_cache_hit_rate": summary["prefix_cache"]["hit_rate"],
        "preemptions": summary["preemptions"],
    }


def build_document(
    workload: Workload,
    params: Any,
    points: Sequence[Point],
    runs: Sequence[PointRun],
    *,
    run_settings: dict[str, Any],
    server: dict[str, Any],
    machine: dict[str, Any],
    versions: dict[str, Any],
    started_at: str,
) -> dict[str, Any]:
    point_docs: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    total = MetricDelta()
    duration = 0.0
    records = []
    for number, (point, run) in enumerate(zip(points, runs)):
        summary = summarize(run.records, run.duration_s, run.delta)
        point_checks = consistency_checks(run.records, run.delta)
        fidelity = None
        for record in run.records:
            row = {"point": number, **record.to_json()}
            if point.reference_text is not None:
                row["copy_fidelity"] = copy_fidelity(record.text, point.reference_text)
            requests.append(row)
        if point.reference_text is not None:
            values = [copy_fidelity(r.text, point.reference_text) for r in run.records]
            fidelity = sum(values) / len(values)
        x = point.x
        if workload.x_axis == "context tokens" and summary["prompt_tokens"]["mean"] is not None:
            x = summary["prompt_tokens"]["mean"]
        point_docs.append(
            {
                "label": point.label,
                "x": x,
                "concurrency": point.concurrency,
                **_headline(summary),
                **({"copy_fidelity": fidelity} if fidelity is not None else {}),
                "summary": summary,
                "checks": [c.to_json() for c in point_checks],
            }
        )
        checks += [{"point": point.label, **c.to_json()} for c in point_checks]
        total = total + run.delta
        duration += run.duration_s
        records += run.records
    overall = summarize(records, duration, total)
    return {
        "schema": SCHEMA,
        "workload": workload.name,
        "description": workload.description,
        "x_axis": workload.x_axis,
        "parameters": {**dataclasses.asdict(params), **run_settings},
        "started_at": started_at,
        "server": server,
        "versions": versions,
        "machine": machine,
        **_headline(overall),
        "summary": overall,
        "points": point_docs,
        "requests": requests,
        "checks": checks,
        "consistent": all(c["ok"] for c in checks if c["fatal"]),
    }


def load_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchError(f"{path}: {exc.strerror}") from None
    except ValueError:
        raise BenchError(f"{path}: not JSON (expected a `qwen38 bench WORKLOAD --out` file)") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise BenchError(f"{path}: schema {found!r}, expected {SCHEMA!r} (a `qwen38 bench WORKLOAD --out` file)")
    return data


# ---- the table -------------------------------------------------------------------------


def _num(value: float | None, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def _dist(summary: dict[str, Any], key: str, stats: Sequence[str], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    dist = summary.get(key)
    if not dist:
        return "-"
    return "/".join(fmt.format(dist[s] * scale) for s in stats)


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows
    )


def table(doc: dict[str, Any]) -> str:
    server = doc["server"]
    params = ", ".join(f"{k}={v}" for k, v in doc["parameters"].items() if k != "cache_salt")
    lines = [
        f"qwen38 bench {doc['workload']}: {params}",
        (
            f"server {server['base_url']} model {server['model']} (vLLM {server.get('vllm_version') or '?'}); "
            f"client {doc['machine'].get('cpu', '?')}, {doc['machine'].get('cores')} cores"
        ),
    ]
    declared = (server.get("declared") or {}).get("identity")
    if declared:
        lines.append(f"identity {declared}")
    rows = [
        [
            "POINT",
            "REQ",
            "PROMPT",
            "OUT",
            "OUT TOK/S",
            "DECODE TOK/S p50",
            "TTFT s p50/p90/p99",
            "ITL ms p50/p90/p99",
            "PREFIX HIT",
            "ACCEPT LEN",
            "PREEMPT",
        ]
    ]
    for p in doc["points"]:
        s = p["summary"]
        rows.append(
            [
                p["label"],
                str(s["requests"]),
                _num(s["prompt_tokens"]["mean"], "{:.0f}"),
                str(s["completion_tokens"]),
                _num(s["output_tok_s"]),
                _dist(s, "decode_tok_s", ["p50"]),
                _dist(s, "ttft_s", ["p50", "p90", "p99"], fmt="{:.3f}"),
                _dist(s, "itl_s", ["p50", "p90", "p99"], scale=1000, fmt="{:.1f}"),
                _num(s["prefix_cache"]["hit_rate"], "{:.1%}"),
                _num(s["acceptance_length"]),
                _num(s.get("preemptions"), "{:.0f}"),  # absent from results written before it was counted
            ]
        )
    lines.append(_grid(rows))
    for p in doc["points"]:
        if p.get("per_position_acceptance"):
            per = " ".join(f"{v:.2f}" for v in p["per_position_acceptance"])
            lines.append(f"{p['label']}: per-position acceptance {per}")
        s = p["summary"]
        if s.get("ttft_s_with_cached_prefix") and s.get("ttft_s_without_cached_prefix"):
            lines.append(
                f"{p['label']}: TTFT p50 {s['ttft_s_without_cached_prefix']['p50']:.3f} s without a cached prefix "
                f"({s['ttft_s_without_cached_prefix']['n']} requests), {s['ttft_s_with_cached_prefix']['p50']:.3f} s "
                f"with one ({s['ttft_s_with_cached_prefix']['n']})"
            )
        if "copy_fidelity" in p:
            lines.append(f"{p['label']}: copy fidelity {p['copy_fidelity']:.1%} of the document reproduced verbatim")
    failed = [c for c in doc["checks"] if not c["ok"]]
    passed = len(doc["checks"]) - len(failed)
    lines.append(
        f"checks: {passed} passed, {len([c for c in failed if c['fatal']])} failed, "
        f"{len([c for c in failed if not c['fatal']])} notes"
    )
    for c in failed:
        lines.append(f"  {'FAIL' if c['fatal'] else 'note'} [{c['point']}] {c['name']}: {c['detail']}")
    return "\n".join(lines)


# ---- comparison ------------------------------------------------------------------------

_COMPARED = (
    ("output tok/s", lambda s: s["output_tok_s"]),
    ("decode tok/s p50", lambda s: (s["decode_tok_s"] or {}).get("p50")),
    ("TTFT s p50", lambda s: (s["ttft_s"] or {}).get("p50")),
    ("TTFT s p90", lambda s: (s["ttft_s"] or {}).get("p90")),
    ("ITL ms p50", lambda s: (s["itl_s"] or {}).get("p50", 0) * 1000 if s["itl_s"] else None),
    ("ITL ms p99", lambda s: (s["itl_s"] or {}).get("p99", 0) * 1000 if s["itl_s"] else None),
    ("acceptance length", lambda s: s["acceptance_length"]),
    ("prefix hit rate", lambda s: s["prefix_cache"]["hit_rate"]),
    ("preemptions", lambda s: s.get("preemptions")),  # absent from results written before it was counted
)


def _who(doc: dict[str, Any]) -> str:
    server = doc["server"]
    machine = doc["machine"]
    what = ", ".join(machine.get("gpus") or []) or machine.get("cpu") or "?"
    note = f"; {machine['note']}" if machine.get("note") else ""
    declared = (server.get("declared") or {}).get("identity")
    ident = f"; {declared}" if declared else ""
    return (
        f"{server['model']} at {server['base_url']} (vLLM {server.get('vllm_version') or '?'}) on {what}{note}{ident}"
    )


def compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], force: bool = False) -> str:
    if a["workload"] != b["workload"] and not force:
        raise BenchError(
            f"{names[0]} is workload {a['workload']}, {names[1]} is {b['workload']}: their figures do not compare "
            "(single-stream vs aggregate); pass --force to print them anyway"
        )
    lines = [f"A = {names[0]}: {_who(a)}", f"B = {names[1]}: {_who(b)}"]
    keys = sorted(set(a["parameters"]) | set(b["parameters"]))
    differ = [
        f"{k} {a['parameters'].get(k)} vs {b['parameters'].get(k)}"
        for k in keys
        if k != "cache_salt" and a["parameters"].get(k) != b["parameters"].get(k)
    ]
    if differ:
        lines.append("note: parameters differ: " + "; ".join(differ))
    for doc, name in ((a, names[0]), (b, names[1])):
        if not doc.get("consistent", False):
            lines.append(f"note: {name} failed consistency checks; its figures are not trustworthy")
    rows = [["", "METRIC", "A", "B", "B/A"]]

    def add(scope: str, sa: dict[str, Any], sb: dict[str, Any]) -> None:
        for label, get in _COMPARED:
            va, vb = get(sa), get(sb)
            if va is None and vb is None:
                continue
            ratio = f"{vb / va:.3f}" if va and vb is not None else "-"
            rows.append([scope, label, _num(va, "{:.3f}"), _num(vb, "{:.3f}"), ratio])

    add("overall", a["summary"], b["summary"])
    b_points = {p["label"]: p for p in b["points"]}
    if len(a["points"]) > 1 or len(b["points"]) > 1:
        for p in a["points"]:
            if p["label"] in b_points:
                add(p["label"], p["summary"], b_points[p["label"]]["summary"])
    lines.append(_grid(rows))
    lines.append("B/A > 1: B is higher (better for tok/s, acceptance and hit rate; worse for TTFT and ITL)")
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------


def _served_on(doc: dict[str, Any]) -> str:
    server, machine = doc["server"], doc["machine"]
    declared = (server.get("declared") or {}).get("identity") or ""
    parts = [p.split("#")[0] for p in declared.split(";") if p.startswith(("profile=", "target="))]
    if not parts:
        root = next((m.get("root") for m in server.get("models", []) if m.get("id") == server["model"]), None)
        parts = [f"root={Path(root).name}"] if root else []
    where = ", ".join(machine.get("gpus") or []) or f"{machine.get('cpu', '?')} x{machine.get('cores', '?')}"
    note = f" ({machine['note']})" if machine.get("note") else ""
    return "; ".join([*parts, f"vLLM {server.get('vllm_version') or '?'}", where + note])


def plot(docs: Sequence[dict[str, Any]], names: Sequence[str], out: Path) -> None:
    """Decode tok/s (per stream) and output tok/s (aggregate) vs concurrency or context depth."""
    axes_kinds = {d["x_axis"] for d in docs}
    if len(axes_kinds) > 1:
        raise BenchError(f"cannot plot results against different axes together: {sorted(axes_kinds)}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'qwen38-stack[bench]' (or matplotlib)") from None
    x_axis = axes_kinds.pop()
    fig, ax = plt.subplots(figsize=(8, 5))
    for doc, name in zip(docs, names):
        points = sorted(doc["points"], key=lambda p: p["x"])
        xs = [p["x"] for p in points]
        decode = [p["decode_tok_s"] for p in points]
        output = [p["output_tok_s"] for p in points]
        label = name if name == doc["workload"] else f"{name} ({doc['workload']})"
        (line,) = ax.plot(xs, decode, marker="o", label=f"{label}: decode tok/s per stream")
        if x_axis == "concurrency":
            ax.plot(
                xs, output, marker="s", linestyle="--", color=line.get_color(), label=f"{label}: output tok/s aggregate"
            )
        for p in points:
            if p.get("acceptance_length") and p["decode_tok_s"] is not None:
                ax.annotate(
                    f"AL {p['acceptance_length']:.2f}",
                    (p["x"], p["decode_tok_s"]),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=8,
                )
    ax.set_xlabel("concurrent requests" if x_axis == "concurrency" else "context tokens (prompt)")
    ax.set_ylabel("tokens / s")
    if x_axis == "concurrency":
        from matplotlib.ticker import FixedLocator, ScalarFormatter

        ax.set_xscale("log", base=2)
        ticks = sorted({p["x"] for d in docs for p in d["points"]})
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(FixedLocator([]))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    model = docs[0]["server"]["model"]
    vs = "concurrency" if x_axis == "concurrency" else "depth"
    # The served name alone can mislead (the cpu profile serves a tiny model under the real
    # name): the subtitle says what was served and on what.
    ax.set_title(f"qwen38 bench: {model}, decode speed vs {vs}\n{_served_on(docs[0])}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()

    with atomic_file(Path(out)) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
