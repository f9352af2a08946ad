"""Which GPU architectures a CUDA library carries code for: machine code (SASS, one ELF per
architecture) or PTX, counted from its `.nv_fatbin` section. No CUDA toolkit needed.

A GPU runs SASS built for its own major architecture (sm_80 code on sm_86, never on sm_90 or
sm_12x); elsewhere the driver compiles the PTX at the kernel's first launch (minutes for a large
library, cached in CUDA_CACHE_PATH). vLLM 0.28.0's FlashAttention 2 library holds sm_80 only,
which is why the lent H200 spent ~200 s of a first start compiling it (docs/gpu.md).

    python -m tests.gpu.fatbin_archs LIBRARY.so [...]
"""

from __future__ import annotations

import struct
import sys
from collections import Counter
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "PTX", 2: "SASS"}


def fatbin_section(data: bytes) -> bytes:
    """The bytes of the `.nv_fatbin` section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = sections[shstrndx][4]
    for name, _type, _flags, _addr, offset, size in sections:
        end = data.index(b"\0", names_offset + name)
        if data[names_offset + name:end] == b".nv_fatbin":
            return data[offset:offset + size]
    raise ValueError("no .nv_fatbin section: not a CUDA library")


def fatbin_archs(fatbin: bytes) -> Counter:
    """{("SASS" | "PTX", sm): entries} over every fat binary in the section."""
    found: Counter = Counter()
    pos = 0
    while pos + 16 <= len(fatbin):
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", fatbin, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned in the section
            continue
        entry, end = pos + header_size, pos + header_size + body_size
        while entry < end:
            kind, _flags, entry_header, entry_size = struct.unpack_from("<HHIQ", fatbin, entry)
            arch, = struct.unpack_from("<I", fatbin, entry + 28)
            found[(KINDS.get(kind, f"kind {kind}"), arch)] += 1
            entry += entry_header + entry_size
        pos = end
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for path in argv:
        try:
            found = fatbin_archs(fatbin_section(Path(path).read_bytes()))
        except (OSError, ValueError) as exc:
            print(f"fatbin_archs: {path}: {exc}", file=sys.stderr)
            return 1
        listed = ", ".join(f"{kind} sm_{arch}: {count}" for (kind, arch), count in sorted(found.items()))
        print(f"{path}: {listed or 'no fat binaries'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
