"""`qwen38 bench startup|plan|shutdown`: the benchmarks that run `qwen38` themselves.

Each spawns the real command in a child process, as a user would (`bench.startup`:
`qwen38 serve` to a passed gate; `bench.plan`: `qwen38 plan` cold, cached and re-planned;
`bench.shutdown`: SIGTERM mid-stream), prints its figures and writes them as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import plan, shutdown, startup
from bench.provenance import client_machine, versions, write_result
from core.errors import BenchError
from core.profiles import profile_names
from core.settings import client_api_key, load_settings
from entrypoint.run_files import config_path, status_path


def _description(module) -> str | None:
    """A benchmark module's first paragraph: the subcommand's description."""
    return module.__doc__.split("\n\n")[0] if module.__doc__ else None


def _cmd_startup(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise BenchError(f"--repeat {args.repeat}: must be >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="qwen38-bench-startup-"))
    cache_dir = Path(args.cache_dir) if args.cache_dir else workdir / "cache"
    env = startup.engine_env(args.profile, workdir)
    port = args.port or startup.free_port()
    runs = []
    for i in range(args.repeat):
        kind = "given cache" if args.cache_dir else ("cold cache" if i == 0 else "warm cache")
        result = startup.measure_start(args.profile, env, cache_dir, port, workdir / f"serve-{i}.log", args.timeout)
        result["cache"] = kind
        runs.append(result)
        print(
            f"start {i + 1} ({kind}): `qwen38 serve --profile {args.profile}` -> ready in {result['ready_s']:.1f} s "
            f"(/health at {result['health_s']} s; verify {result['verify_s']} s; plan {result['plan_s']} s; "
            f"gate {result['gate_s']} s; load {result['loadavg_before'][0]}); "
            f"stopped in {result['stop_s']:.1f} s",
            flush=True,
        )
    doc = {
        "benchmark": "startup",
        "versions": versions(),
        "profile": args.profile,
        "runs": runs,
        "machine": client_machine(args.machine_note),
        "models_dir": env.get("MODELS_DIR", "models"),
    }
    write_result(doc, args.out)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    profiles = args.profile or profile_names(load_settings().profiles_dir)
    workdir = Path(tempfile.mkdtemp(prefix="qwen38-bench-plan-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plan.REPO), env.get("PYTHONPATH", "")) if p)
    results = {}
    try:
        for profile in profiles:
            runs = plan.measure_profile(profile, env, workdir, compare=args.compare, timeout=args.timeout)
            results[profile] = runs
            line = ", ".join(f"{kind} {run['seconds']:.2f} s" for kind, run in runs.items())
            print(f"plan {profile}: {line} (pool {runs['cold']['pool_tokens']:,} tokens; "
                  f"load {runs['cold']['loadavg_before'][0]})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "benchmark": "plan",
        "versions": versions(),
        "command": "qwen38 plan --profile P --no-compare (cold, cached, MAX_MODEL_LEN halved)",
        "profiles": results,
        "machine": client_machine(args.machine_note),
        "models_dir": env.get("MODELS_DIR", "models"),
    }
    write_result(doc, args.out)
    return 0


def _cmd_shutdown(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="qwen38-bench-shutdown-"))
    cache_dir = Path(args.cache_dir) if args.cache_dir else workdir / "cache"
    port = args.port or startup.free_port()
    env = {**startup.engine_env(args.profile, workdir), "PORT": str(port), "CACHE_DIR": str(cache_dir)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(startup.REPO), env.get("PYTHONPATH", "")) if p)
    if args.shutdown_timeout is not None:
        env["SHUTDOWN_TIMEOUT"] = str(args.shutdown_timeout)
    log = workdir / "serve.log"
    load_before = [round(x, 2) for x in os.getloadavg()]
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "entrypoint.cli", "serve", "--profile", args.profile],
            env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        status = status_path(cache_dir, args.profile)
        deadline = time.monotonic() + args.timeout
        while (verdict := startup.gate_verdict(status, process.pid)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"`qwen38 serve --profile {args.profile}` did not pass its gate; see {log}")
            time.sleep(0.5)
        if not verdict.get("ready"):
            raise BenchError(f"the readiness gate failed: {verdict.get('error')}")
        # The server's key: the throw-away one startup.engine_env wrote, else the user's settings.
        generated = workdir / startup.THROWAWAY_KEY
        key = client_api_key(key_file=generated if generated.is_file() else None) or ""
        import yaml

        # deferred: the drain's module is read only once a server is up (`bench --help` stays light)
        from entrypoint.drain import ENGINE_GRACE_S

        rendered = yaml.safe_load(config_path(cache_dir, args.profile).read_text())
        drain = rendered["shutdown-timeout"] - ENGINE_GRACE_S
        result = shutdown.stop_mid_stream(process, f"http://127.0.0.1:{port}", key, short_tokens=args.short_tokens)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"drain {drain} s; a request sent {shutdown.LATE_S} s after SIGTERM: {result['late_request']}")
    print(f"SIGTERM -> `qwen38 serve` exited in {result['exit_s']:.1f} s (exit {result['exit_code']})")
    for client in result["clients"]:
        print(
            f"  {client['client']:<13} {client['outcome']:<8} after {client['seconds_after_stop']} s, "
            f"{client['events_at_stop']} events before the stop, {client['events']} in all: {client['detail']}"
        )
    doc = {
        "benchmark": "shutdown",
        "versions": versions(),
        "profile": args.profile,
        "shutdown_timeout": drain,
        "loadavg_before": load_before,
        **result,
        "machine": client_machine(args.machine_note),
    }
    write_result(doc, args.out)
    return 0


def register_startup(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "startup",
        help="time from `qwen38 serve --profile P` to a passed readiness gate",
        description=_description(startup),
    )
    parser.add_argument("--profile", required=True, help="profile to start (its models must be prepared)")
    parser.add_argument("--repeat", type=int, default=2, help="starts: the first cold, the others warm (default 2)")
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    parser.add_argument("--cache-dir", help="use this CACHE_DIR (default: a fresh temporary one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the gate (default 1800)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--machine-note", help="free text recorded with the machine")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    parser.set_defaults(func=_cmd_startup)


def register_plan(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="time `qwen38 plan`: cold, cached, and re-planned after a knob change",
        description=_description(plan),
    )
    parser.add_argument("--profile", action="append", help="profile to plan (repeatable; default: all)")
    parser.add_argument("--compare", action="store_true", help="also time the default plan of both trees, cold")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one plan may take (default 900)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--machine-note", help="free text recorded with the machine")
    parser.set_defaults(func=_cmd_plan)


def register_shutdown(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "shutdown",
        help="SIGTERM `qwen38 serve` mid-stream: what each SDK sees, and how long the stop takes",
        description=_description(shutdown),
    )
    parser.add_argument("--profile", required=True, help="profile to start (its models must be prepared)")
    parser.add_argument("--shutdown-timeout", type=int, default=None, help="drain seconds (default: the profile's)")
    parser.add_argument("--short-tokens", type=int, default=48, help="max_tokens of the short stream (default 48)")
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    parser.add_argument("--cache-dir", help="use this CACHE_DIR (default: a fresh temporary one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the gate (default 1800)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--machine-note", help="free text recorded with the machine")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (serve.log)")
    parser.set_defaults(func=_cmd_shutdown)
