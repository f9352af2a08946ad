"""`qwen38 bench fullscale|roofline`: the full-scale lab on the lent GPU, and its projections.

``fullscale STEP`` runs one step of `bench.fullscale_steps` (or, with ``run``, whatever
`bench.fullscale_run` says comes next) and prints the JSON the step wrote; ``roofline``
prints the projected decode ceilings of `bench.roofline`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from bench import fullscale, roofline
from bench import fullscale_steps as steps
from bench.fullscale import served_subset
from bench.fullscale_run import run
from core.errors import BenchError

STEPS = ("run", "rates", "patches", "bandwidth", "prebuild", "generate", "requantize", "adapter", "profiles", "start",
         "wait", "measure", "stop", "report", "sample")


def _workloads(args: argparse.Namespace) -> tuple[str, ...] | None:
    return tuple(w.strip() for w in args.workloads.split(",") if w.strip()) if args.workloads else None


def _cmd_fullscale(args: argparse.Namespace) -> int:
    root = Path(args.root)
    step = args.step
    if step == "rates":
        rates = steps.measure_rates()
        by_kind = steps.bytes_by_recipe(args.size)
        projections = {
            f"{cores} cores, disk {disk:.0f} MB/s": steps.generation_projection(
                by_kind, rates, cores, disk, rates["sha256"]
            )
            for cores in (args.cores,) for disk in args.disk_mb_s
        }
        result = {"rates_mb_s_per_core": rates, "bytes_by_recipe": by_kind, "load_average": os.getloadavg(),
                  "projection": projections}
    elif step == "run":
        result = run(root, budget_s=args.budget, size=args.size, sizes=args.sizes, base_port=args.port,
                     out=Path(args.out) if args.out else None, workers=args.workers, served=served_subset(args.served),
                     workloads=_workloads(args), first_alone=not args.side_by_side)
    elif step == "patches":
        result = steps.step_patches(root)
    elif step == "bandwidth":
        result = steps.step_bandwidth(root)
    elif step == "prebuild":
        result = steps.step_prebuild(root)
    elif step == "generate":
        result = steps.step_generate(root, args.size, args.workers, args.disk_bytes,
                                     steps.generated_variants(args.size, served_subset(args.served)))
    elif step == "requantize":
        result = steps.step_requantize(root)
    elif step == "adapter":
        result = steps.step_adapter(root)
    elif step == "profiles":
        result = steps.step_profiles(root, args.device_bytes)
    elif step == "report":
        result = steps.step_report(root, Path(args.out or root / "fullscale.json"))
    else:
        if not args.profile:
            raise BenchError(f"fullscale {step}: name the served profile (one of {', '.join(steps.SERVED)})")
        if step == "start":
            result = steps.step_start(root, args.profile, args.port)
        elif step == "wait":
            result = steps.step_wait(root, args.profile, args.timeout)
        elif step == "measure":
            result = steps.step_measure(root, args.profile, args.sizes, _workloads(args))
        elif step == "sample":
            steps.sample_memory(args.pid, root / "logs" / f"{args.profile}.smi")
            return 0
        else:
            result = steps.step_stop(root, args.profile)
    print(json.dumps(result, indent=1, default=str)[-6000:])
    return 0


def _cmd_roofline(args: argparse.Namespace) -> int:
    measured = {"H200 (measured)": args.measured_gb_s * 1e9} if args.measured_gb_s else None
    rows = roofline.table(measured=measured)
    parts = {name: asdict(s) for name, s in roofline.servings().items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"servings": parts, "rows": rows, "projection": True}, indent=1) + "\n")
    for name, s in parts.items():
        print(f"{name}: " + ", ".join(f"{k} {v / 1e9:.3f} GB" if isinstance(v, int) and v > 1e6 else f"{k} {v}"
                                      for k, v in s.items() if k not in ("profile",)))
    print(roofline.markdown(rows), end="")
    return 0


def register_fullscale(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fullscale",
        help="Qwen3.8-27B's own shapes on a GPU: generate, requantize, serve, measure (resumable steps)",
        description=fullscale.__doc__.split("\n\n")[0],
    )
    parser.add_argument("step", choices=STEPS, metavar="STEP", help=f"one of {', '.join(STEPS[:-1])}")
    parser.add_argument("profile", nargs="?", help="served profile (start/wait/measure/stop), e.g. single-full")
    parser.add_argument("--root", required=True, help="work directory (models, profiles, cache, logs, results)")
    parser.add_argument("--size", default="full", help="generator preset (default full; small for a dry run)")
    parser.add_argument("--workers", type=int, default=None, help="generator processes (default: every core)")
    parser.add_argument("--disk-bytes", type=int, default=4 << 30, help="generate: bytes of the disk speed test")
    parser.add_argument("--device-bytes", type=int, default=None, help="device memory (default: read from CUDA)")
    parser.add_argument("--port", type=int, default=18030, help="start: the port (run: the first of its ports)")
    parser.add_argument("--timeout", type=float, default=540.0, help="wait: seconds at most (one call's budget)")
    parser.add_argument("--sizes", choices=tuple(steps.MEASURE_SIZES), default="quick",
                        help="measure / run: workload sizes (quick fits a short lease; full: the articles')")
    parser.add_argument("--budget", type=float, default=540.0, help="run: seconds this call may take")
    parser.add_argument("--served", default=None,
                        help="run, generate: a comma list of the served copies to run / generate for "
                        f"(default all, in order: {', '.join(steps.SERVED)})")
    parser.add_argument("--workloads", default=None,
                        help="measure / run: a comma list of the workloads every copy measures "
                        f"(default each copy's own; of {', '.join(steps.MEASURE_SIZES['quick'])})")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run: start the first cold copies side by side too (a short lease; each start's time is "
                             "then measured beside the others', the workloads still one copy at a time)")
    parser.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="report / run: the JSON to write (docs/gpu/DATE-GPU-fullscale.json)")
    parser.add_argument("--cores", type=int, default=16, help="rates: cores of the machine projected to (default 16)")
    parser.add_argument("--disk-mb-s", type=float, nargs="+", default=[500.0, 1000.0, 2000.0],
                        help="rates: disk write speeds projected to (MB/s)")
    parser.set_defaults(func=_cmd_fullscale)


def register_roofline(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "roofline", help="projected decode ceilings from bytes per step and memory bandwidth (docs/performance.md)",
        description=roofline.__doc__.split("\n\n")[0],
    )
    parser.add_argument("--json", default=None, help="write the servings and the table as JSON here")
    parser.add_argument("--measured-gb-s", type=float, default=None,
                        help="add rows at this measured H200 bandwidth (GB/s; `bench fullscale bandwidth` measures it)")
    parser.set_defaults(func=_cmd_roofline)
