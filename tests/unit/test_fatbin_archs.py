"""tests/gpu/fatbin_archs.py reads a real ELF's `.nv_fatbin` section: a copy of a system
binary with a fat-binary section added by binutils' objcopy, in the layout CUDA writes
(fat binary headers with SASS and PTX entries, 8-byte aligned one after the other)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import pytest

from tests.gpu.fatbin_archs import FATBIN_MAGIC, fatbin_archs, fatbin_section, main

ENTRY_HEADER = 64


def entry(kind: int, arch: int, body: bytes) -> bytes:
    header = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, ENTRY_HEADER, len(body))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + body


def fat_binary(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


@pytest.fixture
def cuda_like_library(tmp_path):
    objcopy = shutil.which("objcopy")
    if objcopy is None:
        pytest.skip("binutils' objcopy is not installed")
    first = fat_binary(entry(2, 80, b"\x11" * 40), entry(1, 80, b".target sm_80\0" + b"\0" * 2))
    second = fat_binary(entry(2, 90, b"\x22" * 24), entry(2, 80, b"\x33" * 8))
    blob = tmp_path / "fatbin.bin"
    blob.write_bytes(first + b"\0" * (-len(first) % 8) + second)
    library = tmp_path / "libkernels.so"
    shutil.copy(sys.executable, library)
    subprocess.run([objcopy, "--add-section", f".nv_fatbin={blob}", str(library)], check=True)
    return library


def test_counts_sass_and_ptx_per_architecture_over_every_fat_binary(cuda_like_library):
    found = fatbin_archs(fatbin_section(cuda_like_library.read_bytes()))
    assert found == {("SASS", 80): 2, ("PTX", 80): 1, ("SASS", 90): 1}


def test_the_command_lists_them_and_refuses_a_file_without_cuda_code(cuda_like_library, capsys, tmp_path):
    assert main([str(cuda_like_library)]) == 0
    assert capsys.readouterr().out.strip().endswith("PTX sm_80: 1, SASS sm_80: 2, SASS sm_90: 1")
    assert main([sys.executable]) == 1
    assert "no .nv_fatbin section: not a CUDA library" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("not an ELF file")
    assert main([str(text)]) == 1
    assert "not a 64-bit little-endian ELF file" in capsys.readouterr().err
