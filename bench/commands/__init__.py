"""`qwen38 bench ...`: the command line of the benchmarks and the full-scale lab.

``register(subparsers)`` adds ``qwen38 bench`` and every benchmark under it. The
subcommands live in one module per group, beside the benchmark modules whose functions
they call, parse the flags for and print the figures of:

- `bench.commands.server`: c1, c8, agent, users, depth, copy, image, compare, plot, watchdog, steps (against a
  running server);
- `bench.commands.lifecycle`: startup, plan, shutdown (they run `qwen38` themselves);
- `bench.commands.preparation`: verify, requantize, adapter (the preparation steps at full size);
- `bench.commands.lab`: fullscale, roofline (the lent GPU's run and its projections).
"""

from __future__ import annotations

import argparse

from bench.commands import lab, lifecycle, preparation, server

# The order `qwen38 bench --help` lists the benchmarks in.
REGISTER = (
    server.register_workloads,
    lifecycle.register_startup,
    lifecycle.register_plan,
    lifecycle.register_shutdown,
    preparation.register_verify,
    preparation.register_requantize,
    preparation.register_adapter,
    lab.register_fullscale,
    lab.register_roofline,
    server.register_watchdog,
    server.register_steps,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print its figures")
    bench = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for add in REGISTER:
        add(bench)
