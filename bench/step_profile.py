"""Where a decode step's time goes: a torch-profiler trace of vLLM's engine -> a table by part.

`qwen38 bench steps` (bench/commands/server.py) records the trace through vLLM's own
/start_profile and /stop_profile (the server runs with TORCH_PROFILE_DIR set); everything here
is pure: read the chrome trace, cut it into steps, attribute every microsecond of each steady
decode step to exactly one part, and render the table (docs/step-profile.md).

Steps. vLLM's worker wraps each ``execute_model`` in a ``record_function`` scope named
``execute_context_C(c)_generation_G(g)`` (C prefilling requests with c tokens, G decoding with
g). A step is the time from the start of one such scope to the start of the next: the forward,
the sampling and drafting that follow it (``sample_tokens``), and the host's work until the next
forward (scheduling, output processing). A *steady decode* step has no prefill and exactly the
measured concurrency decoding; the last scope of a trace has no successor and is left out.

Attribution, CPU trace (the CPU build; no device). Every instant of the engine thread inside a
step belongs to its innermost event (op or scope). Its part is decided by the chain from that
event out to the step's scope, first rule that holds:

1. inside ``gpu_model_runner: draft``: ``drafter`` (its ops, attention and GEMMs included);
2. inside ``gpu_model_runner: sample``: ``sampling`` (sampler and rejection sampler);
3. the innermost op of the chain whose name matches a kernel family (`FAMILIES`, in order),
   GEMMs inside ``gpu_model_runner: postprocess`` (``compute_logits``) being ``lm_head``;
4. an op matching no family: ``other_ops``;
5. no op: a vLLM scope's own time is ``host_in_step`` until the last model-runner scope
   of the step ends, and time in no event at all is ``host_in_step`` before that end and
   ``host_between`` after it (the scheduler's scopes count there too).

Attribution, CUDA trace. Each GPU kernel (and memcpy/memset) is tied to the host call that
launched it by its ``correlation`` id (a CUDA graph's kernels share their ``cudaGraphLaunch``);
the launch's CPU chain gives rules 1-2 and 4, the kernel's own name the family of rule 3 (then
the launching ops'). A step's device window runs from its first kernel's start to the next
step's first kernel's start: kernel time by part (overlapping kernels: the earlier one owns the
overlap), ``device_idle`` for gaps between the step's first and last kernel, ``host_between``
(the device waiting on the host) from its last kernel's end to the next step's first kernel.

Either way, the parts of a step sum to the step's time by construction.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from core.errors import BenchError

# The parts, in table order, with the row's label.
PARTS: dict[str, str] = {
    "gemm_w4a16": "target GEMMs: W4A16 (Marlin / Machete / cutlass)",
    "gemm_other": "target GEMMs: other (dense, LoRA)",
    "gdn_conv": "GDN: causal conv update",
    "gdn_recurrent": "GDN: gated delta rule / fused recurrent",
    "gdn_gating": "GDN: gating",
    "gdn_other": "GDN: other ops of the GDN layer",
    "norm": "norms (RMSNorm, gated / L2 norm)",
    "attention": "attention (and KV-cache writes)",
    "lm_head": "lm_head (GEMMs of compute_logits)",
    "drafter": "drafter forward (all of vLLM's draft scope)",
    "sampling": "sampling and rejection",
    "other_ops": "other ops (elementwise, copies, indexing, ...)",
    "device_idle": "device idle inside the step (gaps between kernels)",
    "host_in_step": "host inside the step (Python between ops)",
    "host_between": "host between steps (scheduler, outputs)",
}

# Kernel / op families by name, first match wins (rule 3). Kernel names (CUDA) and op names
# (CPU: aten::*, _C::*, vllm::*) both pass through them.
FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (part, re.compile(pattern, re.I))
    for part, pattern in (
        ("gdn_recurrent", r"gated_delta|delta_rule|fused_recurrent|recurrent_gated"),
        ("gdn_gating", r"gdn_gating|fused_gating|sigmoid_gating"),
        ("gdn_conv", r"causal_conv1d|conv1d|conv2d|convolution"),
        ("gemm_w4a16", r"marlin|machete|w4a16|w4a8|cutlass.*(int4|s4|u4|mixed)|gptq|awq"),
        ("norm", r"rms_?norm|layer_?norm|l2_?norm|group_?norm|^aten::(pow|mean|rsqrt|native_layer_norm)$"),
        ("gdn_other", r"gdn|gated_delta_net|mamba"),
        ("attention", r"attention|attn|fmha|flash_fwd|flashinfer|paged|reshape_and_cache|kv_cache_update|split_kv"),
        ("sampling", r"sampl|rejection|argmax|topk|top_k|top_p|multinomial|gumbel|softmax"),
        (
            "gemm_other",
            r"gemm|gemv|cublas|cutlass|nvjet|xmma|wgmma|^aten::(mm|addmm|bmm|matmul|linear|einsum|baddbmm)$"
            r"|onednn_mm|dnnl|_C::.*mm$",
        ),
    )
)

STEP_SCOPE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
RUNNER_SCOPE = "gpu_model_runner: "
DRAFT_SCOPE = "gpu_model_runner: draft"
SAMPLE_SCOPE = "gpu_model_runner: sample"
LOGITS_SCOPE = "gpu_model_runner: postprocess"
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
OP_CATS = frozenset({"cpu_op"})


def family(name: str) -> str | None:
    """The kernel family of an op or kernel name (rule 3), None for none."""
    for part, pattern in FAMILIES:
        if pattern.search(name):
            return part
    return None


def load_trace(path: Path) -> dict[str, Any]:
    """A torch-profiler chrome trace (.json or .json.gz)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)


@dataclass
class Node:
    """One complete ('X') event of the engine thread, with its place in the nesting."""

    name: str
    cat: str
    start: float
    end: float
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    correlation: int | None = None

    def chain(self) -> list[Node]:
        """This event and its enclosing ones, innermost first."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out


@dataclass(frozen=True)
class Step:
    start: float
    end: float
    scope: str
    prefill_requests: int
    decode_requests: int
    decode_tokens: int


def _nest(events: Iterable[dict[str, Any]]) -> list[Node]:
    """The events of one thread as a forest (ts/dur in microseconds), roots in time order."""
    nodes = [
        Node(e["name"], e.get("cat", ""), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
             correlation=(e.get("args") or {}).get("correlation"))
        for e in events
    ]  # fmt: skip
    nodes.sort(key=lambda n: (n.start, -(n.end - n.start)))
    roots: list[Node] = []
    stack: list[Node] = []
    for node in nodes:
        while stack and stack[-1].end <= node.start:
            stack.pop()
        if stack:
            node.parent = stack[-1]
            stack[-1].children.append(node)
        else:
            roots.append(node)
        stack.append(node)
    return roots


def _walk(nodes: Iterable[Node]) -> Iterable[Node]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def engine_thread(trace: dict[str, Any]) -> tuple[Any, Any]:
    """(pid, tid) of the thread that runs the steps: the one holding the step scopes."""
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and STEP_SCOPE.match(e.get("name", "")):
            return e["pid"], e["tid"]
    raise ValueError("no execute_context_..._generation_... scope in the trace: was it recorded by vLLM's worker?")


def steps_of(roots: Sequence[Node]) -> list[Step]:
    """Every step of the trace (the last scope, without a successor, left out)."""
    scopes = sorted((n for n in _walk(roots) if n.cat == "user_annotation" and STEP_SCOPE.match(n.name)),
                    key=lambda n: n.start)  # fmt: skip
    out = []
    for scope, following in zip(scopes, scopes[1:]):
        m = STEP_SCOPE.match(scope.name)
        assert m is not None
        out.append(Step(scope.start, following.start, scope.name, int(m[1]), int(m[3]), int(m[4])))
    return out


def steady(steps: Sequence[Step], concurrency: int) -> list[Step]:
    """The steady decode steps: no prefill, ``concurrency`` requests decoding."""
    return [s for s in steps if s.prefill_requests == 0 and s.decode_requests == concurrency]


def _scoped_part(chain: Sequence[Node]) -> str | None:
    names = {n.name for n in chain if n.cat == "user_annotation"}
    if DRAFT_SCOPE in names:
        return "drafter"
    if SAMPLE_SCOPE in names:
        return "sampling"
    return None


def _op_part(chain: Sequence[Node], own_family: str | None = None) -> str | None:
    """Rules 3-4 for a chain of host events (innermost first); None: no op in it."""
    found = own_family
    has_op = own_family is not None
    for node in chain:
        if found is not None:
            break
        if node.cat in OP_CATS:
            has_op = True
            found = family(node.name)
    if found is None:
        return "other_ops" if has_op else None
    if found.startswith("gemm") and any(n.name == LOGITS_SCOPE for n in chain):
        return "lm_head"
    return found


def _host_part(chain: Sequence[Node]) -> str:
    """Rules 1-4 for an instant whose innermost host event is ``chain[0]``; "host": none holds (rule 5)."""
    return _scoped_part(chain) or _op_part(chain) or "host"


def _segments(node: Node, lo: float, hi: float) -> Iterable[tuple[float, float, Node]]:
    """(start, end, innermost event) covering ``node`` clipped to [lo, hi)."""
    cursor = max(node.start, lo)
    for child in node.children:
        if child.end <= lo or child.start >= hi:
            continue
        if child.start > cursor:
            yield cursor, min(child.start, hi), node
        yield from _segments(child, lo, hi)
        cursor = max(cursor, min(child.end, hi))
    end = min(node.end, hi)
    if end > cursor:
        yield cursor, end, node


def cpu_step_parts(roots: Sequence[Node], step: Step) -> dict[str, float]:
    """Microseconds of ``step`` by part, the CPU way (module docstring)."""
    parts = dict.fromkeys(PARTS, 0.0)
    inside = [r for r in roots if r.end > step.start and r.start < step.end]
    # The end of the step's model-runner work: the last runner scope (or the step scope) ending in it.
    work_end = step.start
    for node in _walk(inside):
        if node.cat == "user_annotation" and node.start < step.end and (
            node.name.startswith(RUNNER_SCOPE) or STEP_SCOPE.match(node.name)
        ):
            work_end = max(work_end, min(node.end, step.end))
    covered = 0.0
    for root in inside:
        for start, end, node in _segments(root, step.start, step.end):
            covered += end - start
            chain = node.chain()
            part = _host_part(chain)
            if part == "host":
                is_runner = any(n.name.startswith(RUNNER_SCOPE) or STEP_SCOPE.match(n.name) for n in chain)
                if is_runner:
                    parts["host_in_step"] += end - start
                else:
                    _split_at(parts, start, end, work_end)
            else:
                parts[part] += end - start
    # Time in no event at all: host time, inside the step until its work ends, between steps after.
    uncovered = _gaps(inside, step.start, step.end)
    for start, end in uncovered:
        _split_at(parts, start, end, work_end)
    return parts


def _split_at(parts: dict[str, float], start: float, end: float, work_end: float) -> None:
    parts["host_in_step"] += max(0.0, min(end, work_end) - start)
    parts["host_between"] += max(0.0, end - max(start, work_end))


def _gaps(roots: Sequence[Node], lo: float, hi: float) -> list[tuple[float, float]]:
    out = []
    cursor = lo
    for root in sorted(roots, key=lambda r: r.start):
        if root.start > cursor:
            out.append((cursor, min(root.start, hi)))
        cursor = max(cursor, root.end)
        if cursor >= hi:
            break
    if cursor < hi:
        out.append((cursor, hi))
    return [(a, b) for a, b in out if b > a]


def _launches(roots: Sequence[Node]) -> dict[int, Node]:
    launches = (n for n in _walk(roots) if n.cat in ("cuda_runtime", "cuda_driver"))
    return {n.correlation: n for n in launches if n.correlation is not None}


def cuda_step_parts(kernels: Sequence[tuple[float, float, str, str]],
                    window: tuple[float, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Microseconds of one device window by part, and its ``device_idle`` by the scope that launched
    the kernel ending each gap: ``kernels`` are the step's (start, end, part, launching scope)."""
    parts = dict.fromkeys(PARTS, 0.0)
    idle: dict[str, float] = {}
    lo, hi = window
    if not kernels:
        parts["host_between"] = hi - lo
        return parts, idle
    cursor = lo
    for start, end, part, scope in sorted(kernels):
        start, end = max(start, cursor), min(end, hi)
        if end <= start:
            continue
        if start > cursor:
            parts["device_idle"] += start - cursor
            idle[scope] = idle.get(scope, 0.0) + start - cursor
        parts[part] += end - start
        cursor = end
    # Idle before the step's last kernel ended: inside the step; after it: waiting on the host. A
    # kernel the step launched that starts only after the next step's first (another stream: seen
    # on the H100 trace of 2026-12-07) is past the window and counts nowhere, its wait neither.
    parts["host_between"] += max(0.0, hi - cursor)
    return parts, idle


def analyse(trace: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """One trace -> the mean step by part (microseconds, and shares), with the steps it used."""
    pid, tid = engine_thread(trace)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    host = [e for e in events if e.get("pid") == pid and e.get("tid") == tid and e.get("cat") in HOST_CATS]
    roots = _nest(host)
    chosen = steady(steps_of(roots), concurrency)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    per_step: list[dict[str, float]] = []
    windows: list[float] = []
    counted: list[dict[str, int]] = []  # CUDA: what the host launched in each step (the fixed costs' count)
    idle_scopes: list[dict[str, float]] = []  # CUDA: each step's idle gaps by the scope that ended them
    if device:
        kind = "cuda"
        launches = _launches(roots)
        runtime = [e for e in host if e.get("cat") in ("cuda_runtime", "cuda_driver")]  # read once, not per step
        by_step: list[list[tuple[float, float, str, str]]] = [[] for _ in chosen]  # (start, end, part, scope)
        for e in device:
            launch = launches.get((e.get("args") or {}).get("correlation"))
            if launch is None:
                continue
            index = next((i for i, s in enumerate(chosen) if s.start <= launch.start < s.end), None)
            if index is None:
                continue
            chain = launch.chain()
            own = family(e["name"]) if e.get("cat") == "kernel" else None
            part = _scoped_part(chain) or _op_part(chain, own) or "other_ops"
            start = float(e["ts"])
            by_step[index].append((start, start + float(e.get("dur", 0.0)), part, _launch_scope(chain)))
        firsts = [min((k[0] for k in ks), default=None) for ks in by_step]
        for i, ks in enumerate(by_step):
            nxt = firsts[i + 1] if i + 1 < len(firsts) else None
            if not ks or nxt is None or firsts[i] is None:
                continue  # the last chosen step has no next first kernel in the selection
            window = (firsts[i], nxt)
            parts, idle = cuda_step_parts(ks, window)
            per_step.append(parts)
            idle_scopes.append(idle)
            windows.append(window[1] - window[0])
            counted.append(_launch_counts(runtime, chosen[i], len(ks)))
    else:
        kind = "cpu"
        for step in chosen:
            per_step.append(cpu_step_parts(roots, step))
            windows.append(step.end - step.start)
    if not per_step:
        raise ValueError(
            f"no steady decode step at concurrency {concurrency} in the trace "
            f"({len(steps_of(roots))} steps: {sorted({s.scope for s in steps_of(roots)})[:6]})"
        )
    n = len(per_step)
    mean = {part: sum(p[part] for p in per_step) / n for part in PARTS}
    step_us = sum(windows) / n
    # A CPU trace has no device to idle; on a GPU the host's time shows as the device waiting.
    hidden = "device_idle" if kind == "cpu" else "host_in_step"
    shown = [part for part in PARTS if part != hidden]
    rows = [
        {"part": part, "label": PARTS[part], "us_per_step": round(mean[part], 3),
         "share": round(mean[part] / step_us, 5) if step_us else 0.0}
        for part in shown
    ]  # fmt: skip
    decode_tokens = sum(s.decode_tokens for s in chosen[:n]) / n
    return {
        "concurrency": concurrency,
        "kind": kind,
        "steps": n,
        "step_us": round(step_us, 3),
        "parts_sum_us": round(sum(mean[part] for part in shown), 3),
        "tokens_verified_per_step": decode_tokens,
        "rows": rows,
        "device_events": len(device),
        "host_events": len(host),
        # Per steady step (CUDA traces): device events run, and the host's launch calls by kind.
        "launches_per_step": {k: round(sum(c[k] for c in counted) / len(counted), 2) for k in LAUNCHES} if counted
        else None,
        # The device's idle time inside a step (CUDA), by the vLLM scope on the host that launched the
        # kernel ending each gap: where the host was while the device waited (µs per step).
        "idle_by_scope_us": {scope: round(sum(d.get(scope, 0.0) for d in idle_scopes) / len(idle_scopes), 3)
                             for scope in sorted({k for d in idle_scopes for k in d})} if idle_scopes else None,
    }


def _launch_scope(chain: Sequence[Node]) -> str:
    """The innermost vLLM scope around a launch (``gpu_model_runner: ...``, ``schedule: ...``), or
    "(no vLLM scope)"."""
    return next((n.name for n in chain if n.cat == "user_annotation" and not STEP_SCOPE.match(n.name)),
                "(no vLLM scope)")


# The host calls that put work on the device: each eager kernel is one launch, a CUDA graph one
# launch for all of its kernels; memcpy / memset calls are launches too.
LAUNCHES = {"device_events": (), "cudaGraphLaunch": ("cudaGraphLaunch",),
            "kernel_launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
            "memcpy_memset": ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaMemset")}


def _launch_counts(runtime: Sequence[dict[str, Any]], step: Step, device_events: int) -> dict[str, int]:
    """What the host launched inside ``step``: ``runtime`` are its CUDA runtime and driver calls."""
    names = [e["name"] for e in runtime if step.start <= e["ts"] < step.end]
    out = {kind: sum(n in calls for n in names) for kind, calls in LAUNCHES.items()}
    out["device_events"] = device_events
    return out


def trace_versions(trace: dict[str, Any]) -> dict[str, Any]:
    """What the trace itself says: vLLM's version (vLLM stamps it), the GPUs (Kineto's)."""
    version = trace.get("vllm_version")
    gpus = [d.get("name") for d in trace.get("deviceProperties") or [] if isinstance(d, dict)]
    return {"vllm": version, "gpus": gpus}


def markdown(doc: dict[str, Any]) -> str:
    """The report as markdown: a header with the provenance, one table per concurrency."""
    v = doc["versions"]
    lines = [
        "# Step profile",
        "",
        f"- command: `{doc['command']}`",
        f"- vLLM {v.get('vllm')}, torch {v.get('torch') or '(not in the trace)'}, device: {v.get('device')}",
        f"- trace kind: {', '.join(sorted({p['kind'] for p in doc['points']}))} "
        "(cpu: CPU ops of the engine thread; cuda: GPU kernels)",
        "",
    ]
    for point in doc["points"]:
        lines += [
            f"## Concurrency {point['concurrency']}: {point['steps']} steady decode steps, "
            f"{point['step_us'] / 1000:.3f} ms per step "
            f"({point['tokens_verified_per_step']:g} tokens verified per step)",
            "",
            "| part | ms per step | share |",
            "|---|---:|---:|",
        ]
        for row in point["rows"]:
            lines.append(f"| {row['label']} | {row['us_per_step'] / 1000:.3f} | {100 * row['share']:.1f} % |")
        lines += [f"| **sum of parts** | **{point['parts_sum_us'] / 1000:.3f}** | "
                  f"**{100 * point['parts_sum_us'] / point['step_us']:.1f} %** |", ""]  # fmt: skip
        launches = point.get("launches_per_step")
        if launches:
            lines += [f"Per step: {launches['device_events']:g} device events (kernels, copies, memsets) from "
                      f"{launches['cudaGraphLaunch']:g} CUDA-graph launches, {launches['kernel_launches']:g} eager "
                      f"kernel launches and {launches['memcpy_memset']:g} memcpy / memset calls.", ""]
        idle = point.get("idle_by_scope_us")
        if idle:
            ranked = sorted(idle.items(), key=lambda kv: -kv[1])
            lines += ["Device idle inside the step, by the host scope that launched the kernel ending each gap: "
                      + ", ".join(f"{scope} {us / 1000:.3f} ms" for scope, us in ranked) + ".", ""]
    lines += ["Rules: docs/step-profile.md.", ""]
    return "\n".join(lines)


# ---- recording against a running server (HTTP; the command's) ---------------------------------

# vLLM names a worker's trace `{worker}.{ns}.pt.trace.json.gz`: the CPU worker `{instance}-rank-0`,
# the GPU worker `dp0_pp0_tp0_dcp0_ep0_rank0` (or `rank0` before its groups exist: the H100 of
# 2026-12-07). The API server's `*.async_llm.*` and a graph capture's `graph_capture_rank_0` are not it.
TRACE_GLOBS = ("*-rank-0.*.pt.trace.json*", "*rank0.*.pt.trace.json*")
PROMPT = "Write a long story about a lighthouse keeper who counts the ships that pass at night."


def trace_files(trace_dir: Path) -> set[Path]:
    """The worker traces (rank 0) in vLLM's profiler directory; the API server's own
    (``*.async_llm.*``) hold no steps."""
    return {path for pattern in TRACE_GLOBS for path in trace_dir.glob(pattern)}


def wait_for_trace(trace_dir: Path, before: set[Path], timeout: float, poll: float = 1.0) -> Path:
    """The worker trace that appeared since ``before``, once its size stops changing."""
    import time

    deadline = time.monotonic() + timeout
    last: tuple[Path, int] | None = None
    while time.monotonic() < deadline:
        new = sorted(trace_files(trace_dir) - before, key=lambda p: p.stat().st_mtime)
        if new:
            size = new[-1].stat().st_size
            if last == (new[-1], size) and size > 0:
                return new[-1]
            last = (new[-1], size)
        time.sleep(poll)
    raise BenchError(f"no new worker trace ({' or '.join(TRACE_GLOBS)}) in {trace_dir} after {timeout:.0f} s "
                     "(--trace-timeout; the server writes it under its TORCH_PROFILE_DIR)")


def decode_streams(client: Any, model: str, concurrency: int, steps: int) -> list[int]:
    """``concurrency`` streams side by side, each decoding ``steps`` tokens greedily past EOS;
    the completion tokens of each."""
    from concurrent.futures import ThreadPoolExecutor

    body = {
        "model": model, "prompt": PROMPT, "max_tokens": steps, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip

    def one(_: int) -> int:
        result = client.stream("/v1/completions", body)
        usage = [e["usage"] for e in result.events if e.get("usage")]
        return usage[-1]["completion_tokens"] if usage else 0

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(concurrency)))


def _server_vllm_version(client: Any) -> str | None:
    try:
        response = client.get("/version")
        return response.json().get("version") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_steps(client: Any, *, model: str, trace_dir: Path, concurrencies: Sequence[int], steps: int,
              warmup_steps: int, trace_timeout: float, command: str, machine: dict[str, Any]) -> dict[str, Any]:
    """Per concurrency: warm up, /start_profile, ``steps`` tokens per stream, /stop_profile, the
    trace analysed (`analyse`). The document `markdown` and `qwen38 bench steps --out` write."""
    points, traces = [], []
    for concurrency in concurrencies:
        decode_streams(client, model, concurrency, warmup_steps)
        before = trace_files(trace_dir)
        response = client.post("/start_profile", {})
        if response.status_code != 200:
            raise BenchError(
                f"/start_profile answered {response.status_code}: serve with TORCH_PROFILE_DIR set "
                "(vLLM adds the profiler's routes only then)"
            )
        tokens = decode_streams(client, model, concurrency, steps)
        response = client.post("/stop_profile", {})
        if response.status_code != 200:
            raise BenchError(f"/stop_profile answered {response.status_code}: {response.text[:200]}")
        path = wait_for_trace(trace_dir, before, trace_timeout)
        print(f"concurrency {concurrency}: {sum(tokens)} tokens; trace {path} ({path.stat().st_size} bytes)")
        trace = load_trace(path)
        point = analyse(trace, concurrency)
        point["trace"] = str(path)
        point["completion_tokens"] = tokens
        points.append(point)
        traces.append(trace_versions(trace))
    # vLLM stamps its version into the first trace of a server only: else its /version.
    vllm_version = next((t["vllm"] for t in traces if t["vllm"]), None) or _server_vllm_version(client)
    return _document(command, model, steps, points, traces, machine, vllm_version, metadata.version("torch"))


def from_traces(paths: Sequence[Path], concurrencies: Sequence[int], *, command: str,
                machine: dict[str, Any]) -> dict[str, Any]:
    """The same document from traces recorded elsewhere (brought back from a lease), the i-th
    trace read at the i-th concurrency. The torch version is not in a trace: None."""
    if len(paths) != len(concurrencies):
        raise BenchError(f"{len(paths)} traces for {len(concurrencies)} concurrencies "
                         "(--concurrency names each trace's, in order)")
    points, traces = [], []
    for path, concurrency in zip(paths, concurrencies):
        if not path.is_file():
            raise BenchError(f"--from-trace {path}: no such file")
        trace = load_trace(path)
        try:
            point = analyse(trace, concurrency)
        except ValueError as exc:
            raise BenchError(f"--from-trace {path}: {exc}") from None
        point["trace"] = str(path)
        points.append(point)
        traces.append(trace_versions(trace))
    vllm_version = next((t["vllm"] for t in traces if t["vllm"]), None)
    return _document(command, None, None, points, traces, machine, vllm_version, None)


def _document(command: str, model: str | None, steps: int | None, points: list[dict[str, Any]],
              traces: list[dict[str, Any]], machine: dict[str, Any], vllm_version: str | None,
              torch_version: str | None) -> dict[str, Any]:
    gpus = sorted({g for t in traces for g in t["gpus"] if g})
    return {
        "bench": "steps",
        "command": command,
        "model": model,
        "steps": steps,
        "versions": {
            "vllm": vllm_version,
            "torch": torch_version,
            "device": ", ".join(gpus) if gpus else f"CPU: {machine['cpu']} ({machine['cores']} cores)",
        },
        "machine": machine,
        "points": points,
    }
