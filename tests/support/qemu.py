"""QEMU's user-mode x86_64 emulator: a Python of this checkout on an emulated CPU model (its
CPUID and instructions emulated, the host's kernel and files as they are), e.g. an x86_64 CPU
without AVX-512 on a host with it."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALL = "`make qemu` (unpacks Debian's qemu-user-static into .venv) or apt-get install -y qemu-user"
# QEMU's model of an AMD EPYC 7002 (Zen 2): AVX2, no AVX-512, as the AVX2-only kind lent to this
# project (an AMD EPYC).
AVX2_MODEL = "EPYC-Rome"


def qemu_x86_64() -> str | None:
    """qemu-x86_64 from PATH or `make qemu`'s .venv/qemu (None: neither)."""
    return (shutil.which("qemu-x86_64") or shutil.which("qemu-x86_64-static")
            or shutil.which("qemu-x86_64", path=str(REPO / ".venv" / "qemu")))
