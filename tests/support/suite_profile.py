"""Where the test suite's time goes: which processes import vLLM, and how idle the CPU is.

Used on a throw-away clone (it writes into that clone's venv), never on the one you work in:

    python -m tests.support.suite_profile hook .venv /tmp/vllm-imports.log
    .venv/bin/python -m pytest                         # or `make test`
    python -m tests.support.suite_profile imports /tmp/vllm-imports.log
    python -m tests.support.suite_profile unhook .venv

`hook` puts a `.pth` file in the venv whose audit hook appends one line per Python that
imports vLLM (time, pid, parent pid, the pytest test it runs under, its command line). `idle`
averages the idle column of `vmstat -t 5 > FILE` (run beside the suite) between two times.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

MODULE = "qwen38_vllm_import_log"
LOGGER = '''import os, sys, time
_LOG = {log!r}
_seen = []


def _hook(event, args):
    if event == "import" and not _seen and args and args[0] == "vllm":
        _seen.append(True)
        line = "\\t".join([f"{{time.time():.1f}}", str(os.getpid()), str(os.getppid()),
                           os.environ.get("PYTEST_CURRENT_TEST", "-"), " ".join(sys.argv)[:200]])
        try:
            with open(_LOG, "a") as handle:
                handle.write(line + "\\n")
        except OSError:
            pass


sys.addaudithook(_hook)
'''


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"no site-packages under {venv}: give the venv's directory (e.g. .venv)")
    return found[0]


def hook(venv: Path, log: Path) -> None:
    target = site_packages(venv)
    (target / f"{MODULE}.py").write_text(LOGGER.format(log=str(log.resolve())))
    (target / f"zz_{MODULE}.pth").write_text(f"import {MODULE}\n")


def unhook(venv: Path) -> None:
    target = site_packages(venv)
    for name in (f"{MODULE}.py", f"zz_{MODULE}.pth"):
        (target / name).unlink(missing_ok=True)


def kind(command: str) -> str:
    """What a logged process was, from its command line."""
    if "kv_capacity" in command:
        return "planner"
    if "api_server" in command:
        return "serve (API server or engine core)"
    if command == "-m":
        return "python -m (vLLM's model inspection)"
    if command.startswith("-c"):
        return "python -c (a script against a view)"
    return "other: " + command.split(" ")[0].rsplit("/", 1)[-1]


def imports(log: Path) -> str:
    rows = [line.rstrip("\n").split("\t") for line in log.read_text().splitlines() if line.strip()]
    by_kind = collections.Counter(kind(row[4]) for row in rows)
    by_file = collections.Counter(row[3].split("::")[0] for row in rows)
    lines = [f"{len(rows)} Pythons imported vLLM", "", "by kind:"]
    lines += [f"  {n:3d}  {k}" for k, n in by_kind.most_common()]
    lines += ["", "by test file (PYTEST_CURRENT_TEST when it started):"]
    lines += [f"  {n:3d}  {f}" for f, n in by_file.most_common()]
    return "\n".join(lines)


def idle(vmstat: Path, start: str, end: str) -> str:
    """The mean of `vmstat -t`'s idle column over the samples stamped from ``start`` to ``end``
    (HH:MM:SS), and per minute."""
    header = None
    samples: list[tuple[str, int]] = []
    for line in vmstat.read_text().splitlines():
        fields = line.split()
        if "id" in fields:
            header = fields
        elif header and fields and fields[0].isdigit():
            stamp = fields[-1]
            if start <= stamp <= end:
                samples.append((stamp, int(fields[header.index("id")])))
    if not samples:
        raise SystemExit(f"no vmstat -t samples between {start} and {end} in {vmstat}")
    minutes: dict[str, list[int]] = collections.defaultdict(list)
    for stamp, value in samples:
        minutes[stamp[:5]].append(value)
    lines = [f"idle {sum(v for _, v in samples) / len(samples):.1f} % on average over {len(samples)} samples"]
    lines += [f"  {minute}  {sum(v) / len(v):5.1f} %" for minute, v in sorted(minutes.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.suite_profile", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("hook", "unhook"):
        command = sub.add_parser(name)
        command.add_argument("venv", type=Path)
        if name == "hook":
            command.add_argument("log", type=Path)
    sub.add_parser("imports").add_argument("log", type=Path)
    command = sub.add_parser("idle")
    command.add_argument("vmstat", type=Path)
    command.add_argument("start", help="HH:MM:SS")
    command.add_argument("end", help="HH:MM:SS")
    args = parser.parse_args(argv)
    if args.command == "hook":
        hook(args.venv, args.log)
    elif args.command == "unhook":
        unhook(args.venv)
    elif args.command == "imports":
        print(imports(args.log))
    else:
        print(idle(args.vmstat, args.start, args.end))


if __name__ == "__main__":
    sys.exit(main())
