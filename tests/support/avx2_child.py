"""A child Python that sees the AVX2-kernels switch (`tests.support.avx2_kernels`) from a site
directory of its own: the switch's tests and the checks of what it changes run their code
there, nothing installed into the interpreter's site-packages. Whether the switch acts is the
child environment's QWEN38_CPU_KERNELS, as everywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import avx2_kernels
from tests.support.vllm_views import REPO_ROOT, last_json_line
from tests.support.warm_python import forking_is_safe, warm_python

# The child's first line: the site directory (its argv[1]) is added the way Python adds
# site-packages, its .pth line run, before anything imports torch.
PRELUDE = "import site, sys; site.addsitedir(sys.argv[1])\n"


def private_site(directory: Path) -> Path:
    """``directory``/site holding the switch (made and installed where missing)."""
    site = directory / "site"
    site.mkdir(exist_ok=True)
    if not (site / f"{avx2_kernels.MODULE}.pth").exists():
        avx2_kernels.install(site)
    return site


def run(code: str, site: Path, env: dict[str, str], *args: str, under: tuple[str, ...] = (),
        timeout: int = 900) -> subprocess.CompletedProcess:
    """``code`` in a new Python (started by ``under``, e.g. an emulator, where given) with
    ``site`` added first; ``sys.argv[2:]`` are ``args``."""
    return subprocess.run([*under, sys.executable, "-c", PRELUDE + code, str(site), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)


def json_result(code: str, site: Path, env: dict[str, str], *args: str, under: tuple[str, ...] = (),
                timeout: int = 900) -> dict:
    """`run`'s last JSON line; a child that fails fails the caller with its stderr."""
    done = run(code, site, env, *args, under=under, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    return last_json_line(done)


def warm_json_result(code: str, site: Path, env: dict[str, str], timeout: int = 900) -> dict:
    """`json_result` of ``code`` (which reads no ``sys.argv``) in a fork of the warm Python that
    added ``site`` first, as `run`'s child does, then imported torch and vLLM
    (`tests.support.warm_python`): one import for every script of the same site and environment.
    A new Python where forking is not safe."""
    if not forking_is_safe():
        return json_result(code, site, env, timeout=timeout)
    done = warm_python(env, REPO_ROOT, site).run(code, timeout)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    return last_json_line(done)
