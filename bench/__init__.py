"""`qwen38 bench`: benchmarks that print figures (never timed unit tests).

Each benchmark is a module of this package with ``register(subparsers)``; the serving
workloads (c1, c8, agent, depth, copy) and the micro-benchmarks of the preparation steps
(plan, verify, requantize, adapter) all live here, so every performance claim in the docs names
a ``qwen38 bench ...`` command.
"""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES: tuple[str, ...] = (
    "bench.serving",
    "bench.startup",
    "bench.plan",
    "bench.shutdown",
    "bench.verify",
    "bench.requantize",
    "bench.adapter",
    "bench.fullscale",
    "bench.roofline",
    "bench.watchdog",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print its figures")
    bench = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench)
