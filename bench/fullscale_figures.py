"""What the full-scale run's raw records say: pure functions over vLLM's log, the memory
sampler's lines and the serving benchmarks' documents (`qwen38 bench fullscale`).

- vLLM's start-up log gives the weights it loaded, its pool, its graph capture and its times;
- the sampler gives each process's device memory (nvidia-smi's compute apps) and the
  device's total; the peak is attributed to a server by its process ids, or - where this
  machine's nvidia-smi does not list our processes (a container's own pid namespace) - by
  the device total over a window in which no other server ran;
- the c1 / c8 / depth documents (schema ``qwen38-bench/1``) give per-step decode latency,
  tokens per step and prefill speed;
- the roofline (`bench.roofline`) sets each measured step beside the time its
  bytes need at the measured bandwidth.

Every projection these functions make carries ``"projection": true`` in its dict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from bench.roofline import ACCEPTANCE, Serving, roofline_fraction
from core.errors import BenchError

GIB = 1 << 30
MIB = 1 << 20

# ---------------------------------------------------------------------------------------
# vLLM's log: what it says about memory and time

_LOG_PATTERNS = {
    "model_loading_gib": r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x",
    "graph_capture": r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB",
    "cudagraph_estimate_gib": r"Estimated CUDA graph memory: ([\d.]+) GiB total",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s in total",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "kv_reserved_gib": r"reserved ([\d.]+) GiB memory for KV Cache as specified by kv_cache_memory_bytes",
    "initial_free_gib": r"Initial free memory ([\d.]+) GiB",
}
_OOM = re.compile(r"(?:CUDA out of memory|OutOfMemoryError)[^\n]*?Tried to allocate ([\d.]+) (GiB|MiB)")


def parse_engine_log(text: str) -> dict[str, Any]:
    """The figures vLLM 0.28.0 logs at start-up (the first of each; the target's model loading)."""
    out: dict[str, Any] = {}
    for key, pattern in _LOG_PATTERNS.items():
        found = re.findall(pattern, text)
        if not found:
            continue
        first = found[0]
        if key == "model_loading_gib":
            out[key] = float(first[0])
            out["model_loading_s"] = float(first[1])
            out["model_loading_all_gib"] = [float(f[0]) for f in found]
        elif key == "kv_cache_tokens":
            out[key] = int(first.replace(",", ""))
        elif key == "max_concurrency":
            out["max_concurrency"] = float(first[1])
        elif key == "graph_capture":
            out["graph_capture_s"] = int(first[0])
            out["graph_capture_gib"] = sum(float(f[1]) for f in found)
        else:
            out[key] = float(first)
    return out


def out_of_memory(text: str) -> dict[str, Any] | None:
    """The first CUDA out-of-memory in a log: how much the failing allocation asked for."""
    found = _OOM.search(text)
    if found is None:
        return None if "out of memory" not in text.lower() else {"tried_to_allocate_bytes": None}
    size = float(found.group(1)) * (GIB if found.group(2) == "GiB" else MIB)
    return {"tried_to_allocate_bytes": int(size), "line": found.group(0)[:300]}


# ---------------------------------------------------------------------------------------
# The memory sampler's record


@dataclass(frozen=True)
class Samples:
    """What the sampler saw: (time, pid, bytes) per compute process, (time, bytes) of the device."""

    apps: list[tuple[float, int, int]]
    device: list[tuple[float, int]]


def parse_samples(text: str) -> Samples:
    """Sampler lines ``<unix time> <pid> <MiB>`` (a compute process) and ``<unix time> gpu <MiB>``."""
    apps: list[tuple[float, int, int]] = []
    device: list[tuple[float, int]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        try:
            when, used = float(parts[0]), int(float(parts[2]) * MIB)
        except ValueError:
            continue
        if parts[1] == "gpu":
            device.append((when, used))
        elif parts[1].isdigit():
            apps.append((when, int(parts[1]), used))
    return Samples(apps, device)


def peak_of(samples: list[tuple[float, int, int]], pids: set[int]) -> int:
    """The largest sum, over one sampling instant, of the memory of ``pids``."""
    by_time: dict[float, int] = {}
    for when, pid, used in samples:
        if pid in pids:
            by_time[when] = by_time.get(when, 0) + used
    return max(by_time.values(), default=0)


def attributed_peak(samples: Samples, pids: set[int], *, baseline: int | None, exclusive: bool) -> dict[str, Any]:
    """The server's peak device memory and how it was attributed.

    By process: the sum over the server's process tree at one instant (nvidia-smi counts each
    process's CUDA context in it). Else, when no other server held memory while this one ran
    (``exclusive``), the device's peak minus what it held before the start (``baseline``).
    Else unknown: nothing here can tell this server's memory from another's.
    """
    if not samples.apps and not samples.device:
        return {"bytes": None, "method": "no memory samples (no nvidia-smi on this machine)"}
    by_process = peak_of(samples.apps, pids)
    if by_process:
        return {"bytes": by_process, "method": "process tree (nvidia-smi compute apps)"}
    if exclusive and samples.device and baseline is not None:
        return {"bytes": max(u for _, u in samples.device) - baseline,
                "method": "device total minus the memory in use before the start (no other server ran)"}
    return {"bytes": None, "method": "unattributed: our processes are not listed and another server ran beside it"}


# ---------------------------------------------------------------------------------------
# The footprint: measured parts, computed parts, and what is left


@dataclass(frozen=True)
class Footprint:
    """Device memory of one serving process, by part (bytes)."""

    peak_process: int  # the attributed peak, whole process tree
    weights: int  # vLLM's "Model loading took" (target + drafter)
    drafter: int  # the drafter's stored bytes (part of `weights`)
    kv_pool: int  # kv_cache_memory_bytes (attention pages + GDN state pages)
    gdn_state: int  # of the pool: the state of every slot the pool keeps resident
    # "Graph capturing finished ... took X GiB": vLLM's difference of the device's free memory,
    # None where another process allocated or freed memory meanwhile (then in the residual).
    cuda_graphs: int | None

    @property
    def residual(self) -> int:
        """Workspaces, activations at max_num_batched_tokens, CUDA context, allocator slack:
        what the peak holds beyond the parts vLLM names."""
        return self.peak_process - self.weights - self.kv_pool - (self.cuda_graphs or 0)

    def to_dict(self) -> dict[str, Any]:
        parts = {
            "peak_process": self.peak_process, "weights": self.weights, "of_weights_drafter": self.drafter,
            "kv_pool": self.kv_pool, "of_kv_pool_gdn_state": self.gdn_state, "cuda_graphs": self.cuda_graphs,
            "residual_workspace_activations_context": self.residual,
        }
        return {k: None if v is None else {"bytes": v, "gib": round(v / GIB, 3)} for k, v in parts.items()}


def footprint(log: dict[str, Any], peak_process: int, *, kv_pool: int, drafter: int, gdn_state: int,
              graphs_attributable: bool = True) -> Footprint:
    weights = int(sum(log.get("model_loading_all_gib", [log.get("model_loading_gib", 0.0)])) * GIB)
    graphs = int(log.get("graph_capture_gib", 0.0) * GIB) if graphs_attributable else None
    return Footprint(peak_process, weights, drafter, kv_pool, gdn_state, graphs)


def neighbours(samples: Samples, own: set[int], began: float, ended: float) -> dict[int, int]:
    """The other processes holding device memory between ``began`` and ``ended``: pid -> the
    most it held (what another server, or anything else on the GPU, ran beside this one)."""
    found: dict[int, int] = {}
    for when, pid, used in samples.apps:
        if began <= when <= ended and pid not in own:
            found[pid] = max(found.get(pid, 0), used)
    return found


def fit_verdict(peak: int | None, budget: int) -> dict[str, Any]:
    """Whether a peak stayed within a budget, and by how much either way."""
    if peak is None:
        return {"cap_held": None, "margin_bytes": None}
    return {"cap_held": peak <= budget, "margin_bytes": budget - peak, "margin_gib": round((budget - peak) / GIB, 3)}


# ---------------------------------------------------------------------------------------
# Speed: per-step decode latency, tokens per step, prefill


def step_latency_ms(decode_tok_s: float, tokens_per_step: float) -> float:
    """Per-step decode latency from a stream's decode speed and the tokens one step yields."""
    if decode_tok_s <= 0 or tokens_per_step <= 0:
        raise BenchError("decode speed and tokens per step must be positive")
    return 1000.0 * tokens_per_step / decode_tok_s


def prefill_tok_s(prompt_tokens: int, ttft_s: float) -> float:
    if ttft_s <= 0:
        raise BenchError(f"TTFT {ttft_s} s: expected a positive time")
    return prompt_tokens / ttft_s


def decode_figures(doc: dict[str, Any], speculative_tokens: int, max_num_seqs: int | None = None,
                   project: bool = True) -> dict[str, Any]:
    """The decode step of a c1 / c8 document's most concurrent point: latency, tokens per step,
    and - with speculation - the tok/s the articles' acceptance lengths would give at the same
    step time (a projection: the DFlash2 drafter proposes its K tokens in one pass, so the
    step time hardly depends on how many are accepted; random weights accept nearly none).
    ``batch``: the sequences one step decodes, at most the server's ``max_num_seqs``; ``project``:
    False for a method the published acceptance lengths are not of (MTP)."""
    points = doc.get("points") or []
    if not points:
        raise BenchError(f"bench {doc.get('workload')}: the document has no points")
    return point_decode_figures(doc, max(points, key=lambda p: p.get("concurrency", 1)), speculative_tokens,
                                max_num_seqs, project)


def point_decode_figures(doc: dict[str, Any], point: dict[str, Any], speculative_tokens: int,
                         max_num_seqs: int | None = None, project: bool = True) -> dict[str, Any]:
    """One point's decode step (see `decode_figures`)."""
    decode = point.get("decode_tok_s")
    if not decode:
        raise BenchError(f"bench {doc.get('workload')}: no decode speed at {point.get('label')} (no streamed tokens?)")
    tau = point.get("acceptance_length") or 1.0
    step_ms = step_latency_ms(decode, tau)
    output_tokens = doc.get("parameters", {}).get("output_tokens", 0)
    prompt = (point.get("summary", {}).get("prompt_tokens") or {}).get("mean") or 0
    out: dict[str, Any] = {
        "point": point.get("label"),
        "concurrency": point.get("concurrency", 1),
        "batch": min(point.get("concurrency", 1), max_num_seqs or point.get("concurrency", 1)),
        "decode_tok_s_per_stream_p50": decode,
        "output_tok_s": point.get("output_tok_s"),
        "tokens_per_step": tau,
        "step_ms": step_ms,
        "itl_ms_p50": point["itl_s"] * 1000 if point.get("itl_s") is not None else None,
        "mean_context_tokens": prompt + output_tokens / 2,
        "speculative_tokens": speculative_tokens,
    }
    if speculative_tokens and project:
        out["projected_tok_s_per_stream"] = {
            label: {"acceptance_length": a, "tok_s": 1000.0 * a / step_ms} for label, a in ACCEPTANCE.items()
        }
        out["projection"] = True
    return out


def users_figures(doc: dict[str, Any], speculative_tokens: int, max_num_seqs: int | None = None,
                  project: bool = True) -> list[dict[str, Any]]:
    """A `users` document, a row per concurrency: the decode step (`point_decode_figures`), the
    aggregate output tok/s, time to first token p50/p90/p99 and the requests vLLM preempted."""
    rows = []
    for point in doc.get("points") or []:
        row = point_decode_figures(doc, point, speculative_tokens, max_num_seqs, project)
        ttft = (point.get("summary") or {}).get("ttft_s") or {}
        row["ttft_s"] = {q: ttft.get(q) for q in ("p50", "p90", "p99")}
        row["preemptions"] = point.get("preemptions", (point.get("summary") or {}).get("preemptions"))
        rows.append(row)
    if not rows:
        raise BenchError(f"bench {doc.get('workload')}: the document has no points")
    return rows


def prefill_figures(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One depth document's points: prompt tokens / TTFT (which also holds the first decode step
    and the HTTP round trip: a lower bound on the prefill speed)."""
    rows = []
    for point in doc.get("points", []):
        summary = point.get("summary", {})
        tokens = (summary.get("prompt_tokens") or {}).get("mean")
        ttft = point.get("ttft_s")
        if tokens and ttft:
            rows.append({"label": point["label"], "prompt_tokens": int(tokens), "ttft_s": ttft,
                         "prefill_tok_s": prefill_tok_s(int(tokens), ttft)})
    return rows


def depth_decode_figures(doc: dict[str, Any], speculative_tokens: int) -> list[dict[str, Any]]:
    """One depth document's decode steps, a row per context: what a (verify) step costs with
    that much context behind it."""
    rows = []
    for point in doc.get("points", []):
        decode, tokens = point.get("decode_tok_s"), (point.get("summary", {}).get("prompt_tokens") or {}).get("mean")
        if not decode or not tokens:
            continue
        tau = point.get("acceptance_length") or 1.0
        rows.append({"label": point["label"], "context_tokens": int(tokens), "tokens_per_step": tau,
                     "step_ms": step_latency_ms(decode, tau), "speculative_tokens": speculative_tokens})
    return rows


def roofline_rows(s: Serving, bandwidth: float, decode: dict[str, dict[str, Any]], speculative: bool
                  ) -> dict[str, dict[str, float]]:
    """Each measured decode point beside the time its bytes need at ``bandwidth``."""
    return {
        name: roofline_fraction(s, bandwidth, int(d["mean_context_tokens"]), d.get("batch", d["concurrency"]),
                                speculative, d["step_ms"] / 1000)
        for name, d in decode.items()
    }


# ---------------------------------------------------------------------------------------
# The summary people read


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _alone(row: dict[str, Any]) -> str:
    """Whether the copy's speed figures had the GPU to themselves."""
    if "measured_alone" not in row:
        return "-"
    if row["measured_alone"]:
        return "yes"
    beside = row.get("gpu_neighbours_while_measured") or {}
    return f"no: {len(beside)} other GPU processes"


def summary_markdown(summary: dict[str, Any]) -> str:
    """The report's tables (docs/performance.md takes them as they are)."""
    lines = [f"Full-scale run: {summary.get('date', '?')}, {summary.get('gpu', '?')}", ""]
    bw = summary.get("bandwidth")
    if bw:
        lines += [f"Measured device bandwidth: {bw['gb_s']:.0f} GB/s ({bw['method']}).", ""]
    lines += ["| served | ready s | pool tokens (engine / plan / seed) | peak GiB | cap held | weights | KV pool | "
              "graphs | residual | C1 step ms (tok/step) | C8 step ms | prefill tok/s 1k / 10k / 64k | measured alone |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in summary.get("profiles", {}).items():
        fp = row.get("footprint") or {}
        decode = row.get("decode") or {}

        def part(key: str) -> str:  # a part the run could not attribute is None (e.g. graphs beside a start)
            return _gib((fp.get(key) or {}).get("bytes"))

        def step(key: str) -> str:
            d = decode.get(key)
            return "-" if not d else f"{d['step_ms']:.1f} ({d['tokens_per_step']:.2f})"

        prefill = " / ".join(f"{p['prefill_tok_s']:,.0f}" for p in row.get("prefill", [])) or "-"
        pool = row.get("pool") or {}
        lines.append(
            f"| {name} | {row.get('ready_s', '-')} | {pool.get('engine_tokens') or '-'} / {pool.get('plan_tokens') or '-'}"
            f" / {pool.get('seed_tokens') or '-'} | {_gib((row.get('peak') or {}).get('bytes'))} | "
            f"{row.get('cap_held', '-')} | {part('weights')} | {part('kv_pool')} | {part('cuda_graphs')} | "
            f"{part('residual_workspace_activations_context')} | {step('c1')} | "
            f"{step('c8')} | {prefill} | {_alone(row)} |"
        )
        if row.get("failed"):
            lines.append(f"| {name}: failed | {row['failed']} |" + " |" * 10)
    # The decode step at depth: the verify workload's contexts, then the deepest request's.
    verify = {name: [*row.get("verify", []), *(row.get("deep") or {}).get("decode", [])]
              for name, row in summary.get("profiles", {}).items() if row.get("verify") or row.get("deep")}
    if verify:
        lines += ["", "| served | decode step ms at context (tokens per step) |", "|---|---|"]
        lines += [f"| {name} | " + ", ".join(f"{r['context_tokens']:,}: {r['step_ms']:.1f} ({r['tokens_per_step']:.2f})"
                                             for r in rows) + " |" for name, rows in verify.items()]
    deepened = {name: [*row.get("verify_prefill", []), *(row.get("deep") or {}).get("prefill", [])]
                for name, row in summary.get("profiles", {}).items() if row.get("verify_prefill") or row.get("deep")}
    if deepened:
        lines += ["", "| served | prompt tokens: time to first token s (prefill tok/s) | peak GiB over the run |",
                  "|---|---|---|"]
        lines += [f"| {name} | " + ", ".join(f"{r['prompt_tokens']:,}: {r['ttft_s']:.1f} ({r['prefill_tok_s']:,.0f})"
                                             for r in rows)
                  + f" | {_gib((summary['profiles'][name].get('peak') or {}).get('bytes'))} |"
                  for name, rows in deepened.items()]
    users = {name: row["users"] for name, row in summary.get("profiles", {}).items() if row.get("users")}
    if users:
        lines += ["", "| served | users in flight | output tok/s | per request tok/s p50 | step ms (tokens per step) "
                  "| TTFT s p50 / p90 / p99 | preempted |", "|---|---|---|---|---|---|---|"]
        for name, rows in users.items():
            for r in rows:
                ttft = " / ".join("-" if r["ttft_s"].get(q) is None else f"{r['ttft_s'][q]:.2f}"
                                  for q in ("p50", "p90", "p99"))
                lines.append(f"| {name} | {r['concurrency']} | {r['output_tok_s'] or 0:,.0f} | "
                             f"{r['decode_tok_s_per_stream_p50']:.1f} | {r['step_ms']:.1f} ({r['tokens_per_step']:.2f}) | "
                             f"{ttft} | {r['preemptions'] if r['preemptions'] is not None else '-'} |")
    steps = {name: row["steps"] for name, row in summary.get("profiles", {}).items() if row.get("steps")}
    if steps:
        lines += ["", *step_parts_markdown(steps)]
    images = {name: row for name, row in summary.get("profiles", {}).items() if row.get("image") or row.get("vision")}
    if images:
        lines += ["", *image_markdown(images)]
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Images (VISION=true, issue 58): an image's time to first token, the tower's memory


def _ttft(point: dict[str, Any]) -> dict[str, float | None]:
    ttft = point["summary"].get("ttft_s") or {}
    return {q: ttft.get(q) for q in ("min", "p50", "max")}


def image_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """A `qwen38 bench image` document -> the image point's and the text-only point's time to first
    token (min / p50 / max over their requests, each request's image its own) and prompt tokens;
    the image's tokens (the prompts' difference) and what it adds to the first token at p50."""
    points = {("text" if p["label"] == "text only" else "image"): p for p in doc["points"]}
    if set(points) != {"image", "text"}:
        raise ValueError(f"an image document has an image point and a text-only point, not {sorted(points)}")
    rows = {kind: {"label": p["label"], "requests": p["summary"]["requests"],
                   "prompt_tokens": p["summary"]["prompt_tokens"]["mean"], "ttft_s": _ttft(p)}
            for kind, p in points.items()}
    image, text = rows["image"], rows["text"]
    out: dict[str, Any] = {"width": doc["parameters"]["width"], "height": doc["parameters"]["height"], **rows}
    if image["prompt_tokens"] is not None and text["prompt_tokens"] is not None:
        out["image_tokens"] = round(image["prompt_tokens"] - text["prompt_tokens"])
    if image["ttft_s"]["p50"] is not None and text["ttft_s"]["p50"] is not None:
        out["image_adds_ttft_s_p50"] = image["ttft_s"]["p50"] - text["ttft_s"]["p50"]
    return out


def tower_share(log: dict[str, Any], text_only_log: dict[str, Any] | None, tower_bytes: int | None) -> dict[str, Any]:
    """The tower's resident memory: the target's "Model loading took X GiB" with VISION=true less
    the same copy's text-only figure (vLLM loads no tower with `language_model_only`), beside the
    bytes of the checkpoint's tower tensors (all of them on the device with the tower there; with
    it in host memory the log's figure is the part the device keeps)."""
    with_tower = log.get("model_loading_gib")
    without = (text_only_log or {}).get("model_loading_gib")
    out: dict[str, Any] = {"tower_checkpoint_bytes": tower_bytes, "model_loading_gib": with_tower,
                           "text_only_model_loading_gib": without}
    if with_tower is not None and without is not None:
        out["tower_from_log_gib"] = round(with_tower - without, 3)
    return out


def image_markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """One row per copy served with VISION=true: the pool it was served with, the tower's memory,
    an image's and the text's time to first token."""

    def seconds(ttft: dict[str, Any]) -> str:
        return " / ".join("-" if ttft.get(q) is None else f"{ttft[q]:.3f}" for q in ("min", "p50", "max"))

    lines = ["| served with images | KV pool (max_model_len) | tower GiB: checkpoint / on the device, planned / "
             "loaded (log, with - without) | image | image tokens | TTFT s min / p50 / max | "
             "text alone: TTFT s min / p50 / max |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        vision, image = row.get("vision") or {}, row.get("image") or {}
        settings, share, planned = vision.get("settings") or {}, vision.get("tower") or {}, vision.get("planned") or {}
        on_device = planned.get("device_tower_bytes", planned.get("tower_bytes"))
        pool = settings.get("KV_CACHE_MEMORY_BYTES")
        length = settings.get("MAX_MODEL_LEN", "as profiled")
        pool_text = "-" if pool is None else f"{int(pool) / GIB:.2f} GiB ({length})"
        log = share.get("tower_from_log_gib")
        loaded = "-" if log is None else f"{log:.2f}"
        tower = f"{_gib(share.get('tower_checkpoint_bytes'))} / {_gib(on_device)} / {loaded}"
        size = f"{image['width']} x {image['height']}" if image else "-"
        lines.append(f"| {name} | {pool_text} | {tower} | {size} | {image.get('image_tokens', '-')} | "
                     f"{seconds((image.get('image') or {}).get('ttft_s') or {})} | "
                     f"{seconds((image.get('text') or {}).get('ttft_s') or {})} |")
    return lines


def step_parts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A `qwen38 bench steps` document -> per concurrency the mean steady step and its parts in
    ms (the rows sum to the step; docs/step-profile.md says what each part holds)."""
    return [{"concurrency": p["concurrency"], "kind": p["kind"], "steps": p["steps"],
             "step_ms": p["step_us"] / 1000, "tokens_verified_per_step": p["tokens_verified_per_step"],
             "rows": [{"part": r["part"], "label": r["label"], "ms": r["us_per_step"] / 1000, "share": r["share"]}
                      for r in p["rows"]]}
            for p in doc["points"]]  # fmt: skip


def step_parts_markdown(steps: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One table: a row per part, a column per (copy, concurrency), ms per steady step."""
    columns = [(name, point) for name, points in steps.items() for point in points]
    labels: dict[str, str] = {}
    for _, point in columns:
        for row in point["rows"]:
            labels.setdefault(row["part"], row["label"])
    by_part = [{row["part"]: row["ms"] for row in point["rows"]} for _, point in columns]
    lines = ["| ms per steady step | " + " | ".join(f"{name} C{p['concurrency']}" for name, p in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for part, label in labels.items():
        lines.append(f"| {label} | " + " | ".join("-" if part not in c else f"{c[part]:.3f}" for c in by_part) + " |")
    lines.append("| **step** (tokens verified) | " + " | ".join(
        f"**{p['step_ms']:.3f}** ({p['tokens_verified_per_step']:g})" for _, p in columns) + " |")
    return lines
