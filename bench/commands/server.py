"""`qwen38 bench c1|c8|agent|users|depth|copy|image|compare|plot|watchdog|steps`: the benchmarks run against a server.

``qwen38 bench WORKLOAD --base-url URL --model ID [--api-key KEY | --api-key-file F]
[--out FILE.json] [--plot FILE.png]`` runs the workload (`bench.workloads`, measured by
`bench.serving.run_workload`; its size flags are read from the workload's parameter fields),
prints a table and writes the JSON result. It exits non-zero when the figures fail a
consistency check (streamed tokens vs usage, usage vs /tokenize, usage vs /metrics,
speculative counters). ``compare`` and ``plot`` read those results (`bench.report`);
``watchdog`` measures what the watchdog costs a running server (`bench.watchdog`); ``steps``
records a torch-profiler trace of steady decode steps through vLLM's /start_profile and
/stop_profile and tables where a step's time goes (`bench.step_profile`, docs/step-profile.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import httpx

from bench import report
from bench.provenance import client_machine
from bench.serving import DEFAULT_SEED, run_workload
from bench.watchdog import measure_watchdog_cost
from bench.workloads import WORKLOADS, Workload, params_from_args
from core.errors import BenchError
from core.settings import client_api_key
from entrypoint.client import DEFAULT_TIMEOUT, StackClient


def api_key(args: argparse.Namespace) -> str | None:
    """The key to send (None: an open server): `core.settings.client_api_key`'s precedence."""
    return client_api_key(args.api_key, args.api_key_file)


def _write_json(path: Path, doc: dict) -> None:
    from core.atomic import atomic_write_text  # deferred: `qwen38 bench --help` needs none of it

    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")


def _cmd_workload(args: argparse.Namespace) -> int:
    workload = WORKLOADS[args.bench]
    params = params_from_args(workload, vars(args))
    cache_dir = Path(args.cache_dir or os.environ.get("CACHE_DIR") or ".cache/qwen38")
    d = DEFAULT_TIMEOUT
    timeout = httpx.Timeout(connect=d.connect, read=args.request_timeout, write=d.write, pool=d.pool)
    with StackClient(args.base_url, api_key(args), timeout=timeout) as client:
        doc = run_workload(
            client,
            workload,
            params,
            model=args.model,
            seed=args.seed,
            warmup=args.warmup,
            cache_salt=not args.no_cache_salt,
            identity_file=Path(args.identity_file) if args.identity_file else None,
            cache_dir=cache_dir,
            machine_note=args.machine_note,
        )
    print(report.table(doc))
    if args.out:
        _write_json(Path(args.out), doc)
        print(f"result: {args.out}")
    if args.plot:
        report.plot([doc], [workload.name], Path(args.plot))
        print(f"plot: {args.plot}")
    if not doc["consistent"]:
        failed = [c for c in doc["checks"] if c["fatal"] and not c["ok"]]
        raise BenchError(
            f"{len(failed)} consistency check(s) failed ({failed[0]['name']}: {failed[0]['detail']}); "
            "these figures are not trustworthy"
        )
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    a, b = report.load_result(Path(args.a)), report.load_result(Path(args.b))
    print(report.compare(a, b, (args.a, args.b), force=args.force))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    docs = [report.load_result(Path(p)) for p in args.results]
    report.plot(docs, [Path(p).stem for p in args.results], Path(args.out))
    print(f"plot: {args.out}")
    return 0


def _cmd_watchdog(args: argparse.Namespace) -> int:
    with StackClient(args.base_url, api_key(args)) as client:
        result = measure_watchdog_cost(client, args.model, args.reads, args.canaries, args.pause)
    result = {
        "bench": "watchdog",
        "base_url": args.base_url,
        "model": args.model,
        "machine": client_machine(args.machine_note),
        **result,
    }
    reads, canary, load = result["metrics_reads"], result["canaries"], result["at_defaults"]
    print(
        f"/metrics: {reads['seconds']['p50'] * 1000:.1f} ms per read (p50 of {reads['n']}), {reads['bytes']} bytes, "
        f"{reads['api_server_cpu_seconds_per_read'] * 1000:.2f} ms of API-server CPU"
    )
    print(f"canary: {canary['seconds']['p50']:.3f} s (p50 of {canary['n']}), {canary['tokens']} tokens")
    print(
        f"at the defaults: polls take {100 * load['api_server_cpu_share_of_one_core']:.3f} % of one core; "
        f"the canary {100 * load['idle_engine_time_share']:.2f} % of an idle engine's time (none of a busy one's)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def _cmd_steps(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from bench import step_profile  # deferred: `qwen38 bench --help` needs none of it

    command = "qwen38 " + shlex.join(sys.argv[1:])
    if args.from_trace:
        doc = step_profile.from_traces([Path(p) for p in args.from_trace], args.concurrency, command=command,
                                       machine=client_machine(args.machine_note))
        return _write_steps(doc, Path(args.out))
    missing = [flag for flag, value in (("--base-url", args.base_url), ("--model", args.model),
                                        ("--trace-dir", args.trace_dir)) if not value]
    if missing:
        raise BenchError(f"bench steps: {', '.join(missing)} needed against a server (or --from-trace FILE)")
    trace_dir = Path(args.trace_dir)
    if not trace_dir.is_dir():
        raise BenchError(f"--trace-dir {trace_dir}: no such directory (the server's TORCH_PROFILE_DIR)")
    d = DEFAULT_TIMEOUT
    # /stop_profile answers once the trace is written: minutes for a CPU trace of many ops.
    timeout = httpx.Timeout(connect=d.connect, read=args.trace_timeout, write=d.write, pool=d.pool)
    with StackClient(args.base_url, api_key(args), timeout=timeout) as client:
        doc = step_profile.run_steps(
            client, model=args.model, trace_dir=trace_dir, concurrencies=args.concurrency, steps=args.steps,
            warmup_steps=args.warmup_steps, trace_timeout=args.trace_timeout,
            command=command, machine=client_machine(args.machine_note),
        )
    doc["base_url"] = args.base_url
    return _write_steps(doc, Path(args.out))


def _write_steps(doc: dict, out: Path) -> int:
    from bench import step_profile  # deferred: `qwen38 bench --help` needs none of it

    print(step_profile.markdown(doc))
    _write_json(out, doc)
    md = out.with_suffix(".md")
    md.write_text(step_profile.markdown(doc))
    print(f"result: {out}, {md}")
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def _add_params(parser: argparse.ArgumentParser, workload: Workload) -> None:
    group = parser.add_argument_group(f"{workload.name} sizes (defaults: the published workload)")
    for f in dataclasses.fields(workload.params):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, tuple):
            shown = ",".join(map(str, default))
            group.add_argument(
                flag, type=_int_list, default=None, metavar="N[,N...]", help=f"{f.metadata['help']} (default {shown})"
            )
        else:
            group.add_argument(flag, type=type(default), default=None, help=f"{f.metadata['help']} (default {default})")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:18020")
    parser.add_argument("--model", required=True, help="model id to benchmark (one of /v1/models)")
    parser.add_argument("--api-key", help="API key (prefer --api-key-file; default: VLLM_API_KEY / API_KEY_FILE)")
    parser.add_argument("--api-key-file", help="file holding the API key")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--plot", help="draw decode tok/s vs concurrency or context depth into this PNG")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="prompt seed: the same seed, the same work")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests first (default 1)")
    parser.add_argument(
        "--no-cache-salt",
        action="store_true",
        help="send no per-run cache_salt (a repeat run then meets the previous run's cached prefixes)",
    )
    parser.add_argument("--identity-file", help="the server's verify status.json (for a remote server)")
    parser.add_argument(
        "--cache-dir",
        help="CACHE_DIR of a local deployment, to read its identity (default: CACHE_DIR or .cache/qwen38)",
    )
    parser.add_argument("--machine-note", help="free text recorded with the machine, e.g. 'RTX 3090, 300 W limit'")
    parser.add_argument(
        "--request-timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT.read,
        metavar="SECONDS",
        help=f"how long a request may wait for the server's next byte, its first token included "
        f"(default {DEFAULT_TIMEOUT.read:.0f}; a prompt of 100k tokens or more can take longer to prefill)",
    )


def register_workloads(subparsers: argparse._SubParsersAction) -> None:
    """c1, c8, agent, users, depth, copy, image (one per workload), then compare and plot."""
    for workload in WORKLOADS.values():
        parser = subparsers.add_parser(workload.name, help=workload.help, description=workload.description)
        _add_common(parser)
        _add_params(parser, workload)
        parser.set_defaults(func=_cmd_workload)

    compare = subparsers.add_parser(
        "compare",
        help="print two results side by side with ratios",
        description="Compare two `qwen38 bench WORKLOAD --out` results: overall and "
        "per point, with B/A ratios; notes where their parameters differ.",
    )
    compare.add_argument("a", help="result A (the reference)")
    compare.add_argument("b", help="result B")
    compare.add_argument("--force", action="store_true", help="compare results of different workloads anyway")
    compare.set_defaults(func=_cmd_compare)

    plot = subparsers.add_parser(
        "plot",
        help="draw decode tok/s vs concurrency or depth from result files",
        description="Plot one or more results on one chart: per-stream decode tok/s "
        "(and aggregate output tok/s vs concurrency).",
    )
    plot.add_argument("results", nargs="+", help="result JSON files (same x axis: c1/c8/agent, or depth/copy)")
    plot.add_argument("--out", required=True, help="PNG to write")
    plot.set_defaults(func=_cmd_plot)


def register_steps(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "steps",
        help="profile steady decode steps: where a step's time goes, by part",
        description="Against a server started with TORCH_PROFILE_DIR: record a torch-profiler trace of steady "
        "decode steps through vLLM's /start_profile and /stop_profile at each concurrency, and write a table "
        "of the step's time by part (GEMMs, GDN kernels, attention, drafter, sampling, lm_head, host) as JSON "
        "and markdown (docs/step-profile.md).",
    )
    parser.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:18020")
    parser.add_argument("--model", help="model id to decode with (one of /v1/models)")
    parser.add_argument("--api-key", help="API key (prefer --api-key-file; default: VLLM_API_KEY / API_KEY_FILE)")
    parser.add_argument("--api-key-file", help="file holding the API key")
    parser.add_argument("--trace-dir", help="the server's TORCH_PROFILE_DIR (read here: a local server)")
    parser.add_argument("--from-trace", action="append", metavar="FILE",
                        help="no server: analyse this worker trace (recorded elsewhere); once per --concurrency, "
                        "in its order")
    parser.add_argument(
        "--concurrency", type=_int_list, default=(1,), metavar="N[,N...]", help="streams side by side (default 1)"
    )
    parser.add_argument("--steps", type=int, default=32, help="tokens each stream decodes while profiled (default 32)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="tokens of the unprofiled warm-up (default 8)")
    parser.add_argument(
        "--trace-timeout",
        type=_positive_seconds,
        default=1800.0,
        metavar="SECONDS",
        help="how long /stop_profile may take to write the trace (default 1800)",
    )
    parser.add_argument("--out", required=True, help="the JSON result; the markdown table beside it (.md)")
    parser.add_argument("--machine-note", help="free text recorded with the machine")
    parser.set_defaults(func=_cmd_steps)


def register_watchdog(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "watchdog",
        help="what the watchdog's /metrics polls and canaries cost a running server",
        description="Measure the API server's CPU per /metrics read and the canary's time on a running server, "
        "and the load both put on it at the default watchdog knobs.",
    )
    parser.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:18020")
    parser.add_argument("--model", required=True, help="the base model id (the canary's)")
    parser.add_argument("--api-key", help="API key (prefer --api-key-file; default: VLLM_API_KEY / API_KEY_FILE)")
    parser.add_argument("--api-key-file", help="file holding the API key")
    parser.add_argument("--reads", type=int, default=200, help="/metrics reads (default 200)")
    parser.add_argument("--canaries", type=int, default=10, help="canary requests (default 10)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between canaries (default 1)")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--machine-note", help="free text recorded with the machine")
    parser.set_defaults(func=_cmd_watchdog)
