"""`qwen38 bench fullscale run`: whatever comes next, within one call's budget.

The lent GPU gives a call 10 minutes and a machine 30, and a cold start at full size takes
longer than a call (the 2026-12-01 probe: over 8.5 minutes). So the run is a sequence of
resumable steps whose state lives in ``ROOT/results`` and in the servers left running in
sessions of their own; each call reads that state, does what comes next while its budget
lasts, writes the report so far and returns. The GPU session issues the same command until
it answers ``done``.

What comes next (`next_action`, pure):

1. the preparation steps in order (patches, bandwidth, prebuild, generate, requantize,
   adapter, profiles), each only when its estimate fits the time left;
2. a measured server is stopped (its memory goes to the next);
3. a ready server is measured, but only while no other server is starting (a start's
   compiling, warm-up and graph capture would run beside the measured steps);
4. otherwise servers are started in `SERVED` order: the first alone (its cold start is timed
   alone, and it fills the shared compile caches: almost all of a cold start is Triton JIT and
   autotuning at the model's shapes, docs/gpu.md; `--side-by-side` starts it beside the rest,
   for a lease too short for one start after another), the others as many side by side as the
   device's memory takes (their budgets added up), `STAGGER_S` apart, unless a ready one
   waits to be measured;
   where nvidia-smi does not list this machine's process ids (a container), one at a time, so
   that the device's total is the server's own;
5. otherwise, with servers starting, wait; with nothing left, the report and ``done``.
"""

from __future__ import annotations

import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench import fullscale_steps as fs
from core.errors import BenchError

PREP = ("patches", "bandwidth", "prebuild", "generate", "requantize", "adapter", "profiles")
# Seconds a step needs left in the call before it starts (full size on the GPU machine, generously;
# the reduced presets of a dry run take seconds).
ESTIMATE_S = {"patches": 60, "bandwidth": 60, "prebuild": 180, "generate": 240, "requantize": 180, "adapter": 300,
              "profiles": 90, "start": 45}  # a VISION=true copy's start asks `qwen38 plan` first (~15 s)
REDUCED_ESTIMATE_S = {step: 30 for step in ESTIMATE_S}
MEASURE_S = {"full": 480, "quick": 240, "tiny": 120}
# Packing servers side by side: each one's CUDA context lies outside its allocator cap, and
# the device keeps a reserve besides.
CONTEXT_BYTES = 1 << 30
RESERVE_BYTES = 2 << 30
POLL_S = 10.0
# Side-by-side starts begin this far apart: on the 2026-12-07 lease, three of four servers
# started at one instant died importing torch (oneMKL: cannot load libtorch_cpu.so).
STAGGER_S = 45.0
Status = Literal["pending", "starting", "ready", "failed", "measured", "stopped", "skipped"]


@dataclass(frozen=True)
class Server:
    name: str
    status: Status
    budget: int  # bytes it may take (for packing side by side)
    measure: bool = True  # False: started only to time the start
    age_s: float | None = None  # seconds since it was started (None: not started)


@dataclass(frozen=True)
class RunState:
    prepared: tuple[str, ...]  # preparation steps done
    servers: tuple[Server, ...]  # in start order
    device_total: int | None
    pid_attribution: bool | None
    warmed: bool = False  # a server has been ready here before: the compile caches are warm


@dataclass(frozen=True)
class Action:
    kind: Literal["prep", "start", "measure", "stop", "wait", "end", "report"]
    name: str = ""
    why: str = ""


def next_action(state: RunState, remaining_s: float, sizes: str = "quick",
                estimates: dict[str, float] = ESTIMATE_S, first_alone: bool = True) -> Action:
    """What to do now, with ``remaining_s`` seconds left in this call (see the module docstring).
    ``first_alone=False``: the first cold starts side by side too (a short lease: each start's
    time is then measured beside the others', the steps still one copy at a time)."""
    for step in PREP:
        if step not in state.prepared:
            if remaining_s < estimates[step]:
                return Action("end", step, f"{step} needs ~{estimates[step]} s, {remaining_s:.0f} s left")
            return Action("prep", step)
    by_status: dict[str, list[Server]] = {}
    for server in state.servers:
        by_status.setdefault(server.status, []).append(server)
    starting, ready = by_status.get("starting", []), by_status.get("ready", [])
    done_measuring = [s for s in state.servers if s.status == "measured" or (s.status == "ready" and not s.measure)]
    if done_measuring:
        return Action("stop", done_measuring[0].name)
    if ready and not starting:
        if remaining_s < MEASURE_S[sizes]:
            return Action("end", ready[0].name, f"measuring needs ~{MEASURE_S[sizes]} s, {remaining_s:.0f} s left")
        return Action("measure", ready[0].name)
    pending = by_status.get("pending", [])
    if pending and not ready and remaining_s >= estimates["start"]:
        alive = starting + ready
        if state.pid_attribution is False and alive:
            return Action("wait", alive[0].name, "one server at a time: nvidia-smi does not list our processes")
        if first_alone and not state.warmed and alive:
            return Action("wait", alive[0].name, "the first cold start runs alone")
        used = sum(s.budget + CONTEXT_BYTES for s in alive)
        total = state.device_total or 0
        youngest = min((s.age_s for s in starting if s.age_s is not None), default=None)
        if youngest is not None and youngest < STAGGER_S:
            return Action("wait", starting[0].name, f"starts are {STAGGER_S:.0f} s apart")
        for candidate in pending:
            if not alive or used + candidate.budget + CONTEXT_BYTES + RESERVE_BYTES <= total:
                return Action("start", candidate.name)
    if starting:
        if remaining_s < POLL_S + 5:
            return Action("end", starting[0].name, "still starting; the next call waits for it")
        return Action("wait", starting[0].name)
    if pending:
        return Action("end", pending[0].name, "not enough time left in this call to start it")
    return Action("report")


# ---------------------------------------------------------------------------------------
# State from the files (I/O)


def read_state(root: Path, served: dict[str, fs.Served] | None = None, skip_prep: tuple[str, ...] = ()) -> RunState:
    """The run's state from ``root``'s results (``skip_prep``: steps counted as done, for a dry run)."""
    served = served or fs.SERVED
    prepared = tuple(step for step in PREP if step in skip_prep or _prepared(root, step, served))
    bandwidth = fs.read_result(root, "bandwidth") or {}
    profiles = fs.read_result(root, "profiles") or {}
    total = profiles.get("device_total_bytes") or bandwidth.get("device_total_bytes")
    statuses: dict[str, Status] = {}
    servers = []
    for name, s in served.items():
        status: Status
        age = None
        if fs.read_result(root, f"{name}.failed"):
            status = "failed"
        elif fs.read_result(root, f"{name}.stop"):
            status = "stopped"
        elif (fs.read_result(root, f"{name}.measure") or {}).get("done"):
            status = "measured"
        elif started := fs.read_result(root, f"{name}.start"):
            status = fs.poll_ready(root, name)  # type: ignore[assignment]
            age = time.time() - started["started"]
        else:
            status = "pending"
        if status == "pending" and s.after_failure_of and not _failed_to_fit(root, s.after_failure_of, statuses):
            status = "skipped"
        statuses[name] = status
        budget = s.budget if s.budget is not None else fs.UNCAPPED_BYTES
        servers.append(Server(name, status, budget, s.measure, age))
    warmed = any(fs.read_result(root, f"{name}.ready") for name in fs.SERVED.keys() | served.keys())
    return RunState(prepared, tuple(servers), total, bandwidth.get("pid_attribution"), warmed)


def _prepared(root: Path, step: str, served: dict[str, fs.Served]) -> bool:
    """Whether preparation ``step`` is done for ``served``: the adapter is not needed without a
    `spark-lora` copy, and artifacts generated for a smaller set do not serve a larger one."""
    if step == "adapter" and not fs.spark_served(served):
        return True
    result = fs.read_result(root, step) or {}
    if step == "generate" and result.get("only") is not None and fs.spark_served(served):
        return False  # generated for the 3090 profiles only: the Spark's artifacts are still to write
    return bool(result.get("done"))


def _failed_to_fit(root: Path, name: str, statuses: dict[str, Status]) -> bool:
    """Whether ``name`` failed for want of memory (or its peak passed its budget): then its
    uncapped copy says by how much."""
    if statuses.get(name) not in ("failed", "stopped", "measured"):
        return False
    failed = fs.read_result(root, f"{name}.failed")
    if failed:
        return failed.get("out_of_memory") is not None
    measure = fs.read_result(root, f"{name}.measure") or {}
    return measure.get("cap_held") is False


@dataclass
class Log:
    """What a call did, appended to ``results/run.json``."""

    root: Path
    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, action: Action, seconds: float, outcome: str) -> None:
        self.entries.append({"at": round(time.time(), 1), "action": action.kind, "name": action.name,
                             "why": action.why, "seconds": round(seconds, 1), "outcome": outcome})

    def save(self) -> None:
        previous = (fs.read_result(self.root, "run") or {}).get("calls", [])
        fs._write(self.root, "run", {"calls": [*previous, self.entries]})


def run(root: Path, *, budget_s: float, size: str = "full", sizes: str = "quick", base_port: int = 18030,
        out: Path | None = None, workers: int | None = None, served: dict[str, fs.Served] | None = None,
        total_bytes: int | None = None, skip_prep: tuple[str, ...] = (),
        workloads: tuple[str, ...] | None = None, first_alone: bool = True) -> dict[str, Any]:
    """Do what comes next until ``budget_s`` is spent or nothing is left; then write the report
    (to ``out``: a JSON file, or a directory that gets fullscale.json, .md and the logs' tails).
    ``workloads``: what every copy measures (None: each copy's own choice)."""
    served = served or fs.SERVED
    fs.check_workloads(workloads)
    deadline = time.monotonic() + budget_s
    log = Log(root)
    ports = {name: base_port + i for i, name in enumerate(served)}
    action = Action("end")
    while True:
        state = read_state(root, served, skip_prep)
        remaining = deadline - time.monotonic()
        action = next_action(state, remaining, sizes, ESTIMATE_S if size == "full" else REDUCED_ESTIMATE_S,
                             first_alone)
        if action.kind in ("end", "report"):
            break
        began = time.monotonic()
        outcome = "ok"
        try:
            if action.kind == "prep":
                _prep(root, action.name, size, workers, total_bytes, served)
            elif action.kind == "start":
                fs.step_start(root, action.name, ports[action.name], served[action.name])
            elif action.kind == "measure":
                fs.step_measure(root, action.name, sizes, workloads, served[action.name])
            elif action.kind == "stop":
                fs.step_stop(root, action.name)
            else:
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
                outcome = "waited"
        except BenchError as exc:
            outcome = f"error: {exc}"
            if action.kind == "prep":  # a failed preparation step stops the run: the rest needs it
                log.add(action, time.monotonic() - began, outcome)
                log.save()
                raise
            # Recorded as failed, so that the next look does not try it again and again.
            fs.record_failure(root, action.name, f"{action.kind} failed: {exc}")
        if action.kind != "wait":
            log.add(action, time.monotonic() - began, outcome)
    log.add(action, 0.0, "this call ends" if action.kind == "end" else "done")
    log.save()
    result: dict[str, Any] = {"done": action.kind == "report", "stopped_at": action.kind, "next": action.name,
                              "why": action.why,
                              "servers": {s.name: s.status for s in read_state(root, served, skip_prep).servers}}
    directory = out if out is not None and out.suffix != ".json" else None
    report = (directory / "fullscale.json") if directory else (out or root / "fullscale.json")
    if directory is not None:  # the logs first: they come back even where the report fails
        result["logs"] = str(pack_logs(root, directory / "logs.tar.xz"))
    result["report"] = fs.step_report(root, report, served)
    return result


def pack_logs(root: Path, dest: Path, tail_bytes: int = 2 << 20) -> Path:
    """The last ``tail_bytes`` of every server's log and sampler record, xz-compressed."""
    import io

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:xz") as tar:
        for path in sorted((root / "logs").glob("*")):
            data = path.read_bytes()[-tail_bytes:]
            info = tarfile.TarInfo(f"logs/{path.name}")
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return dest


def _prep(root: Path, step: str, size: str, workers: int | None, total_bytes: int | None,
          served: dict[str, fs.Served]) -> None:
    if step == "patches":
        fs.step_patches(root)
    elif step == "bandwidth":
        fs.step_bandwidth(root)
    elif step == "prebuild":
        fs.step_prebuild(root)
    elif step == "generate":  # the disk's speed from 4 GiB at full size, a token amount for a dry run
        fs.step_generate(root, size, workers, (4 << 30) if size == "full" else (64 << 20),
                         fs.generated_variants(size, served))
    elif step == "requantize":
        fs.step_requantize(root)
    elif step == "adapter":
        fs.step_adapter(root)
    elif step == "profiles":  # every served copy, so that a later call may choose others
        fs.step_profiles(root, total_bytes, {**fs.SERVED, **served})


