"""End to end on CPU: `qwen38 adapter build` on the tiny Qwen3.5 hybrid, run by real vLLM.

The base is `qwen38 tiny`'s target and the directions its generated directions file; the
CLI's adapter is byte for byte the tiny adapter the `cpu` profile serves.

Three engines of the real vLLM 0.28.0 CPU build (offline `LLM`, one after another in one
child process: tests/support/lora_probe.py), all bf16 (the CPU GDN kernel requires it):
1. the base with LoRA enabled and the adapter requested as `mode-b` (two identities, one engine);
2. the same base without LoRA;
3. the "projected" base: every target weight replaced by W - c r r^T W offline.
vLLM 0.28.0's CPU platform turns graph compilation off whenever LoRA is enabled
(`platforms/cpu.py`), after the custom-op choice was made for a compiled graph, so that
engine runs uncompiled with the native (non-custom) ops; engines 2 and 3 are configured the
same way (`compilation_config={"mode": 0, "custom_ops": ["none"]}`) so the comparison
isolates the adapter, not the compiler or the kernels. Serving the adapter as a second model
id over HTTP is proven by the `cpu` profile's end-to-end tests (test_cpu_profile.py).
Proven: base requests on the LoRA engine answer bit for bit as on the engine without LoRA;
adapter requests differ from base; and the adapter's log-probabilities match the projected
model's to bf16 noise, on average ~40 times closer than they are to the base's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.manifest import MANIFEST_NAME
from prepare.checkpoint_writer import write_checkpoint
from prepare.directions import read_directions
from tests.support import avx2_kernels
from tests.support.lora_probe import PROMPTS
from tests.support.session_cache import session_vllm_cache
from tests.support.vllm_env import vllm_child_env

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]


def _project(base: Path, out: Path, directions_path: Path) -> Path:
    """The base with W' = W - c r (r^T W) written into each target weight (fp64 math)."""
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(MANIFEST_NAME))  # another model
    tensors = load_file(str(base / "model.safetensors"))
    directions = read_directions(directions_path)
    for module in directions.modules:
        w = tensors[f"{module}.weight"].double()
        r = directions.vectors[module].double()
        projected = w - directions.coefs[module] * torch.outer(r, r @ w)
        tensors[f"{module}.weight"] = projected.float()  # vLLM casts to bf16 on load
    write_checkpoint(out, {"model.safetensors": tensors})
    return out


@pytest.fixture(scope="module")
def observed(tmp_path_factory, tiny_root) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("adapter-e2e")
    base = tiny_root / "tiny" / "target"
    directions = tiny_root / "tiny" / "directions" / "directions.safetensors"
    adapter = work / "mode-b"
    # a bare environment (on the AVX2 switch, its variable too: the bits below are the kernels')
    bare = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **avx2_kernels.passed_on()}
    build = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "adapter", "build", "--model", str(base),
         "--directions", str(directions), "--out", str(adapter)],
        cwd=REPO, capture_output=True, text=True, env=bare,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    assert "8 modules" in build.stdout
    tiny_adapter = tiny_root / "tiny" / "adapter" / "adapter_model.safetensors"
    assert (adapter / "adapter_model.safetensors").read_bytes() == tiny_adapter.read_bytes()
    projected = _project(base, work / "projected", directions)
    runs = [
        {"name": "lora", "model": str(base), "lora": str(adapter), "compile": "default"},
        {"name": "plain", "model": str(base), "lora": None, "compile": "native"},
        {"name": "projected", "model": str(projected), "lora": None, "compile": "native"},
    ]
    (work / "runs.json").write_text(json.dumps(runs))
    out = work / "observed.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.lora_probe", "--runs", str(work / "runs.json"), str(out)],
        cwd=REPO, capture_output=True, text=True, env=vllm_child_env(session_vllm_cache()), timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    by_run = json.loads(out.read_text())
    return {
        "base@lora-server": by_run["lora"]["base"], "mode-b": by_run["lora"]["mode-b"],
        "base@plain-server": by_run["plain"]["base"], "projected": by_run["projected"]["base"],
    }  # fmt: skip


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_base_requests_answer_as_on_a_server_without_lora(observed):
    assert observed["base@lora-server"]["greedy"] == observed["base@plain-server"]["greedy"]
    assert observed["base@lora-server"]["logprobs"] == observed["base@plain-server"]["logprobs"]


def test_adapter_requests_differ_from_base_requests(observed):
    for adapter, base in zip(observed["mode-b"]["greedy"], observed["base@lora-server"]["greedy"], strict=True):
        assert adapter != base
    assert _max_abs_diff(observed["mode-b"]["logprobs"], observed["base@lora-server"]["logprobs"]) > 0.05


def test_adapter_matches_the_projected_model(observed):
    adapter, base, projected = (observed[k]["logprobs"] for k in ("mode-b", "base@lora-server", "projected"))
    effect, error = _max_abs_diff(adapter, base), _max_abs_diff(adapter, projected)
    mean_effect, mean_error = _mean_abs_diff(adapter, base), _mean_abs_diff(adapter, projected)
    same = sum(a == p for a, p in zip(observed["mode-b"]["greedy"], observed["projected"]["greedy"], strict=True))
    print(
        f"\nadapter vs base: |d logprob| max {effect:.4f}, mean {mean_effect:.4f}; "
        f"adapter vs projected: max {error:.4f}, mean {mean_error:.4f}; "
        f"greedy continuations identical {same}/{len(PROMPTS)}"
    )
    # bf16 rounds the two paths differently (LoRA: W x + B (A x); projected: (W - c r r^T W) x),
    # so they agree to bf16 noise, not bit for bit. The tiny adapter is strong (c = 100: the
    # component along r is reversed and amplified 99-fold), so the noise is too: mean 0.03,
    # with single sensitive positions up to ~0.45. A wrong transform is far off: leaving out
    # one module type's LoRA puts it at 50-90 % of the effect (docs/adapter.md).
    assert mean_error < 0.1 * mean_effect
    assert mean_error < 0.05
    assert error < 0.25 * effect
    # greedy continuations start the same (later tokens may flip where two are near-tied)
    assert [g[0] for g in observed["mode-b"]["greedy"]] == [g[0] for g in observed["projected"]["greedy"]]
