"""`qwen38 bench c1|c8|agent|depth|copy|compare|plot`: the serving benchmarks' commands.

``qwen38 bench WORKLOAD --base-url URL --model ID [--api-key KEY | --api-key-file F]
[--out FILE.json] [--plot FILE.png]`` builds the workload's prompts from the seed with the
server's tokenizer, sends one unmeasured warm-up request, runs each point, prints a table
and writes the JSON result. It exits non-zero when the figures fail a consistency check
(streamed tokens vs usage, usage vs /tokenize, usage vs /metrics, speculative counters).
Run it against an otherwise idle server: /metrics counters are server-wide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import provenance, report
from bench.measurement import ServerTokenizer, run_point, warm_up
from bench.prompts import PROMPTS_VERSION
from bench.workloads import WORKLOADS, Context, Workload, params_from_args
from core.errors import BenchError
from entrypoint.client import DEFAULT_TIMEOUT, StackClient

DEFAULT_SEED = 0


def api_key(args: argparse.Namespace) -> str | None:
    """The key to send (None: an open server): `core.settings.client_api_key`'s precedence."""
    from core.settings import client_api_key

    return client_api_key(args.api_key, args.api_key_file)


def _list_models(client: StackClient) -> list[dict[str, Any]]:
    response = client.get("/v1/models")
    if response.status_code != 200:
        raise BenchError(f"{client.base_url}/v1/models answered {response.status_code} (wrong or missing API key?)")
    return response.json()["data"]


def run_workload(
    client: StackClient,
    workload: Workload,
    params: Any,
    *,
    model: str,
    seed: int = DEFAULT_SEED,
    warmup: int = 1,
    cache_salt: bool = True,
    identity_file: Path | None = None,
    cache_dir: Path | None = None,
    machine_note: str | None = None,
    progress=print,
) -> dict[str, Any]:
    """Build, warm up, measure every point; the result document (see `report`)."""
    models = _list_models(client)
    ids = [m["id"] for m in models]
    if model not in ids:
        raise BenchError(f"--model {model}: the server lists {ids}")
    server = provenance.server_identity(client, model, models, identity_file=identity_file, cache_dir=cache_dir)
    salt = secrets.token_hex(6) if cache_salt else None
    ctx = Context(
        model=model,
        seed=seed,
        tokenizer=ServerTokenizer(client, model),
        cache_salt=salt,
        max_model_len=server["max_model_len"],
    )
    started = time.perf_counter()
    points = workload.build(params, ctx)
    progress(
        f"bench {workload.name}: {sum(len(j) for p in points for j in p.jobs)} requests in {len(points)} "
        f"point(s), prompts built in {time.perf_counter() - started:.1f} s"
    )
    if warmup:
        warm_up(client, [ctx.warm_up_request()] * warmup)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    runs = []
    for point in points:
        run = run_point(client, point.jobs, point.concurrency)
        completion = sum(r.completion_tokens or 0 for r in run.records)
        progress(f"  {point.label}: {len(run.records)} requests, {completion} tokens in {run.duration_s:.2f} s")
        runs.append(run)
    run_settings = {
        "model": model,
        "seed": seed,
        "prompts_version": PROMPTS_VERSION,
        "warmup": warmup,
        "cache_salt": salt,
        "temperature": 0,
        "ignore_eos": True,
        "thinking": False,
    }
    return report.build_document(
        workload,
        params,
        points,
        runs,
        run_settings=run_settings,
        server=server,
        machine=provenance.client_machine(machine_note),
        versions=provenance.versions(),
        started_at=started_at,
    )


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    from core.atomic import atomic_write_text

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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


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


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
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
