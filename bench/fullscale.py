"""`qwen38 bench fullscale`: Qwen3.8-27B's own shapes on the lent GPU, step by step.

The lent machine lives 30 minutes and a call 10, so the work is cut into steps that each
write their JSON under ``ROOT/results`` as soon as they know something, and that a later
call resumes (docs/performance.md, "Running it"). ``run`` does whatever is next within one
call's budget and is simply issued again until it says ``done``:

    qwen38 bench fullscale run --root R --budget 540 --out $OUT   # again and again, then it reports

or the steps one by one:

    qwen38 bench fullscale rates      --root R           # per-core draw rates here -> projected generate time
    qwen38 bench fullscale patches    --root R           # the series applied to the importable vLLM, proven
    qwen38 bench fullscale bandwidth  --root R           # device copy bandwidth; does nvidia-smi list our pids
    qwen38 bench fullscale prebuild   --root R           # FlashInfer's sampling kernels, as the images build them
    qwen38 bench fullscale generate   --root R           # full-size artifacts (qwen38 generate --size full)
    qwen38 bench fullscale requantize --root R           # int8 embed/lm_head: RSS vs largest tensor, MB/s vs disk
    qwen38 bench fullscale adapter    --root R           # the spark-lora adapter from the NVFP4 target
    qwen38 bench fullscale profiles   --root R           # PROFILES_DIR: the real profiles, slots -> generated
    qwen38 bench fullscale start  PROFILE --root R       # qwen38 serve in its own session (setsid) + sampler
    qwen38 bench fullscale wait   PROFILE --root R       # until the readiness gate's verdict (or a timeout)
    qwen38 bench fullscale measure PROFILE --root R      # c1, c8, prefill 1k/10k/64k, footprint from the log
    qwen38 bench fullscale stop   PROFILE --root R
    qwen38 bench fullscale report --root R --out docs/gpu/DATE-GPU-fullscale.json

The steps are `bench.fullscale_steps`, what comes next `bench.fullscale_run`,
the pure arithmetic `bench.fullscale_figures` and `bench.roofline`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.fullscale_run import run
from bench.fullscale_steps import (
    MEASURE_SIZES,
    SERVED,
    Served,
    bytes_by_recipe,
    generated_variants,
    generation_projection,
    measure_rates,
    sample_memory,
    step_adapter,
    step_bandwidth,
    step_generate,
    step_measure,
    step_patches,
    step_prebuild,
    step_profiles,
    step_report,
    step_requantize,
    step_start,
    step_stop,
    step_wait,
)
from core.errors import BenchError

# ---------------------------------------------------------------------------------------
# CLI


def _cmd(args: argparse.Namespace) -> int:
    root = Path(args.root)
    step = args.step
    if step == "rates":
        rates = measure_rates()
        by_kind = bytes_by_recipe(args.size)
        projections = {
            f"{cores} cores, disk {disk:.0f} MB/s": generation_projection(by_kind, rates, cores, disk, rates["sha256"])
            for cores in (args.cores,) for disk in args.disk_mb_s
        }
        result = {"rates_mb_s_per_core": rates, "bytes_by_recipe": by_kind, "load_average": os.getloadavg(),
                  "projection": projections}
    elif step == "run":
        result = run(root, budget_s=args.budget, size=args.size, sizes=args.sizes, base_port=args.port,
                     out=Path(args.out) if args.out else None, workers=args.workers, served=served_subset(args.served))
    elif step == "patches":
        result = step_patches(root)
    elif step == "bandwidth":
        result = step_bandwidth(root)
    elif step == "prebuild":
        result = step_prebuild(root)
    elif step == "generate":
        result = step_generate(root, args.size, args.workers, args.disk_bytes,
                               generated_variants(args.size, served_subset(args.served)))
    elif step == "requantize":
        result = step_requantize(root)
    elif step == "adapter":
        result = step_adapter(root)
    elif step == "profiles":
        result = step_profiles(root, args.device_bytes)
    elif step == "report":
        result = step_report(root, Path(args.out or root / "fullscale.json"))
    else:
        if not args.profile:
            raise BenchError(f"fullscale {step}: name the served profile (one of {', '.join(SERVED)})")
        if step == "start":
            result = step_start(root, args.profile, args.port)
        elif step == "wait":
            result = step_wait(root, args.profile, args.timeout)
        elif step == "measure":
            result = step_measure(root, args.profile, args.sizes)
        elif step == "sample":
            sample_memory(args.pid, root / "logs" / f"{args.profile}.smi")
            return 0
        else:
            result = step_stop(root, args.profile)
    print(json.dumps(result, indent=1, default=str)[-6000:])
    return 0


def served_subset(names: str | None) -> dict[str, Served] | None:
    """``--served a,b``: those served copies, in `SERVED`'s order (None: all of them)."""
    if not names:
        return None
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SERVED]
    if unknown:
        raise BenchError(f"--served {','.join(unknown)}: unknown; expected some of {', '.join(SERVED)}")
    return {name: s for name, s in SERVED.items() if name in wanted}


STEPS = ("run", "rates", "patches", "bandwidth", "prebuild", "generate", "requantize", "adapter", "profiles", "start",
         "wait", "measure", "stop", "report", "sample")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fullscale",
        help="Qwen3.8-27B's own shapes on a GPU: generate, requantize, serve, measure (resumable steps)",
        description=__doc__.split("\n\n")[0],
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
    parser.add_argument("--sizes", choices=tuple(MEASURE_SIZES), default="quick",
                        help="measure / run: workload sizes (quick fits a short lease; full: the articles')")
    parser.add_argument("--budget", type=float, default=540.0, help="run: seconds this call may take")
    parser.add_argument("--served", default=None,
                        help="run, generate: a comma list of the served copies to run / generate for "
                        f"(default all, in order: {', '.join(SERVED)})")
    parser.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="report / run: the JSON to write (docs/gpu/DATE-GPU-fullscale.json)")
    parser.add_argument("--cores", type=int, default=16, help="rates: cores of the machine projected to (default 16)")
    parser.add_argument("--disk-mb-s", type=float, nargs="+", default=[500.0, 1000.0, 2000.0],
                        help="rates: disk write speeds projected to (MB/s)")
    parser.set_defaults(func=_cmd)
