"""`qwen38 dashboard`: the monitoring dashboard (`entrypoint.dashboard`): its Grafana JSON, a
check of its queries against a Prometheus, a Grafana-less picture."""

from __future__ import annotations

import argparse
from pathlib import Path

from entrypoint import dashboard


def _cmd_dashboard(args: argparse.Namespace) -> int:
    if args.action == "json":
        print(dashboard.dashboard_json(), end="")
        return 0
    if args.action == "check":
        checks = dashboard.check_queries(args.prometheus)
        for check in checks:
            shown = f"{check.series} series, e.g. {check.values[0]:.4g}" if check.has_data else "no data"
            print(f"{'ok ' if check.has_data else '-- '} {check.panel} / {check.legend}: {shown}")
        missing = [c for c in checks if not c.has_data]
        print(f"{len(checks) - len(missing)} of {len(checks)} queries return data from {args.prometheus}")
        return 0
    out = dashboard.render_png(args.prometheus, Path(args.out), args.minutes)
    print(f"wrote {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboard",
        help="the monitoring dashboard: its Grafana JSON, a check of its queries, a Grafana-less picture",
        description="Print the Grafana dashboard the monitoring profile provisions, run each of its queries "
        "against a Prometheus and say which return data, or draw its panels to a PNG without Grafana.",
    )
    parser.add_argument("action", choices=["json", "check", "render"])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus URL (check, render)")
    parser.add_argument("--out", default="dashboard.png", help="PNG to write (render)")
    parser.add_argument("--minutes", type=float, default=15.0, help="time range to draw (render)")
    parser.set_defaults(func=_cmd_dashboard)
