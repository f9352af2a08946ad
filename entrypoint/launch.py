"""Launch: render a resolved engine into the exact vLLM invocation `qwen38 serve` runs.

`render_invocation` is pure: the same profile, settings and key give the same argv,
environment and ``--config`` YAML content. It renders the `ResolvedEngine`
(`entrypoint.resolve`) the rest of the command uses. Nearly everything goes into the YAML
(vLLM's ``--config`` takes long-form names; the command line would win over it, so we put
nothing else there); the API key travels in the environment, never in argv, and is masked
whenever an invocation is shown.

`qwen38 serve` (`entrypoint.serve`) runs the flow of DESIGN.md: settings -> verify -> plan ->
render -> launch, where launch is a supervisor (`entrypoint.supervise`) that owns vLLM's
processes, stops them within a bound and runs the readiness gate;
`entrypoint.asgi.StackMiddleware`, named in the YAML, puts the API key guard around every
route of vLLM's app.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from core.errors import SettingsError
from core.profiles import Profile
from core.settings import Settings, load_settings, load_settings_profile, read_api_key
from entrypoint.asgi import API_KEY_ENV, MIDDLEWARE_PATH
from entrypoint.compile_cache import compile_cache_key, vllm_cache_root
from entrypoint.drain import DRAIN_ENV, ENGINE_GRACE_S
from entrypoint.resolve import ResolvedEngine, check_multi_host, resolve
from entrypoint.toolchain import Runner

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


def run_dir(settings: Settings) -> Path:
    return (settings.cache_dir / "run").absolute()


def status_path(settings: Settings, profile_name: str) -> Path:
    return run_dir(settings) / f"{profile_name}.status.json"


def _engine_config(resolved: ResolvedEngine, settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": resolved.target_dir,
        "served-model-name": resolved.served_model_name,
        "host": settings.host,
        "port": settings.port,
        "dtype": resolved.dtype,
        "max-model-len": resolved.max_model_len,
        "max-num-seqs": resolved.max_num_seqs,
        "kv-cache-dtype": resolved.kv_cache_dtype,
        "enable-prefix-caching": resolved.enable_prefix_caching,
        "mamba-ssm-cache-dtype": resolved.mamba_ssm_cache_dtype,
        # Per-request cached-token counts: the cache-isolation validator reads them.
        "enable-prompt-tokens-details": True,
        "uvicorn-log-level": settings.log_level,
        # The watchdog and Prometheus read /metrics every few seconds: not a log line each.
        "disable-access-log-for-endpoints": "/metrics",
        # The key guard around every route (vLLM's own covers /v1 & co. only), the instance
        # header, and the end of open streams at shutdown (entrypoint.asgi).
        "middleware": [MIDDLEWARE_PATH],
        # vLLM drains a little longer than the guard, which ends what is still open first.
        "shutdown-timeout": resolved.shutdown_timeout + ENGINE_GRACE_S,
    }
    optional = {
        "kv-cache-memory-bytes": resolved.kv_cache_memory_bytes,
        "gpu-memory-utilization": resolved.gpu_memory_utilization,
        "max-num-batched-tokens": resolved.max_num_batched_tokens,
        "block-size": resolved.block_size,
        "attention-backend": resolved.attention_backend,
        "seed": resolved.seed,
        "compilation-config": resolved.compilation_config,
        "additional-config": resolved.additional_config,
        "structured-outputs-config": resolved.structured_outputs_config,
        "reasoning-parser": resolved.reasoning_parser,
        "enable-flashinfer-autotune": resolved.enable_flashinfer_autotune,
    }
    config.update({k: v for k, v in optional.items() if v is not None})
    if resolved.cudagraph_capture_limit is not None:
        config["compilation-config"] = {
            **(resolved.compilation_config or {}),
            "max_cudagraph_capture_size": resolved.cudagraph_capture_limit,
        }
    if resolved.enforce_eager:
        config["enforce-eager"] = True
    if resolved.language_model_only:
        config["language-model-only"] = True
    if resolved.tool_call_parser:
        config["enable-auto-tool-choice"] = True
        config["tool-call-parser"] = resolved.tool_call_parser
    if resolved.default_chat_template_kwargs:
        config["default-chat-template-kwargs"] = resolved.default_chat_template_kwargs

    spec = resolved.speculative
    if spec is not None:
        # Lookup drafting (patch 0070) widens the verify block: vLLM verifies
        # num_speculative_tokens drafts, the last lookup_tokens of them from lookup.
        spec_config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
        if spec.lookup_tokens:
            spec_config["lookup_tokens"] = spec.lookup_tokens
        if spec.drafter_dir is not None:
            spec_config["model"] = spec.drafter_dir
        if spec.draft_sample_method is not None:
            spec_config["draft_sample_method"] = spec.draft_sample_method
        if spec.attention_backend is not None:
            spec_config["attention_backend"] = spec.attention_backend
        config["speculative-config"] = spec_config

    config.update(_parallel_config(resolved))

    lora = resolved.lora
    if lora is not None:
        config["enable-lora"] = True
        config["max-lora-rank"] = lora.max_lora_rank
        config["max-loras"] = lora.max_loras
        # vLLM turns YAML list items into strings with str(): give it JSON strings.
        module = {"name": lora.adapter_id, "path": lora.path, "base_model_name": lora.base_model_name}
        config["lora-modules"] = [json.dumps(module, sort_keys=True)]

    config.update(resolved.extra)
    return config


def _parallel_config(resolved: ResolvedEngine) -> dict[str, Any]:
    """vLLM's own tensor parallelism: its multiprocessing executor, in one host or across hosts
    (never Ray, which the images do not ship and vLLM 0.28.0 does not need for either)."""
    par = resolved.parallel
    if par is None:
        return {}
    config: dict[str, Any] = {"tensor-parallel-size": par.tensor_parallel_size, "distributed-executor-backend": "mp"}
    if not par.custom_all_reduce:
        config["disable-custom-all-reduce"] = True
    if par.nodes > 1:
        config.update(
            {"nnodes": par.nodes, "node-rank": par.node_rank, "master-addr": par.head_address,
             "master-port": par.head_port}
        )  # fmt: skip
    return config


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
    env.update(resolved.env)
    if api_key is not None:
        # Our guard's variable, not VLLM_API_KEY: vLLM would install its own narrower check beside it.
        env[API_KEY_ENV] = api_key.get_secret_value()
    return env


def render_invocation(
    profile: Profile,
    settings: Settings,
    api_key: SecretStr | None,
    python: str = sys.executable,
    *,
    resolved: ResolvedEngine | None = None,
) -> Invocation:
    """Profile + settings + key -> the exact vLLM invocation (pure; no I/O).

    ``resolved`` is `resolve(profile, settings)`, passed where the command resolved it already.
    """
    if profile.require_api_key and api_key is None:
        raise SettingsError(
            f"profile {profile.name} requires an API key: set API_KEY_FILE (e.g. from `qwen38 key init`) "
            "or VLLM_API_KEY"
        )
    resolved = resolved or resolve(profile, settings)
    check_multi_host(resolved)
    cache_key = compile_cache_key(resolved)
    config_path = run_dir(settings) / f"{profile.name}.vllm.yaml"
    # A worker host runs its share of the GPUs headless: no API server (vLLM --headless).
    headless = ["--headless"] if resolved.parallel is not None and resolved.parallel.headless else []
    argv = [python, "-m", ENGINE_MODULE, *headless, "--config", str(config_path)]
    return Invocation(
        argv=argv,
        env=_engine_env(resolved, settings, api_key),
        config=_engine_config(resolved, settings),
        config_path=config_path,
        cache_key=cache_key,
        model_ids=profile.model_ids,
    )


# ---- I/O edge: commands ------------------------------------------------------------------


def load(args: argparse.Namespace) -> tuple[Profile, Settings, SecretStr | None]:
    settings = load_settings(profile=getattr(args, "profile", None))
    return load_settings_profile(settings), settings, read_api_key(settings)


def resolve_on_this_host(profile: Profile, settings: Settings, run: Runner | None = None) -> ResolvedEngine:
    """`resolve` with the link between the profile's GPUs as this host's nvidia-smi reports it
    (one-host multi-GPU profiles with GPU_LINK=auto; a matrix that cannot be read counts as PCIe,
    the safe side, and says so). ``run`` runs nvidia-smi (default: `run_command`)."""
    from entrypoint.toolchain import run_command
    from entrypoint.topology import TopologyError, read_link

    run = run or run_command
    first = resolve(profile, settings)
    par = first.parallel
    if par is None or par.nodes > 1 or settings.gpu_link != "auto" or first.devices is None:
        return first
    try:
        reading = read_link(first.devices, run)
    except TopologyError as exc:
        print(f"qwen38: topology: {exc}; assuming PCIe (set GPU_LINK to say)", file=sys.stderr)
        return first
    return resolve(profile, settings, reading) if reading is not None else first


def _cmd_render(args: argparse.Namespace) -> int:
    profile, settings, key = load(args)
    invocation = render_invocation(profile, settings, key, resolved=resolve_on_this_host(profile, settings))
    public = invocation.public()
    if args.json:
        print(json.dumps(public, indent=2))
        return 0
    print("# command")
    print(shlex.join(public["argv"]))
    print("# environment")
    for name, value in public["env"].items():
        print(f"{name}={value}")
    print(f"# {public['config_path']}")
    print(invocation.config_yaml(), end="")
    return 0


def write_run_files(invocation: Invocation) -> None:
    from core.atomic import atomic_write_text

    atomic_write_text(invocation.config_path, invocation.config_yaml())




def register(subparsers: argparse._SubParsersAction) -> None:
    render = subparsers.add_parser(
        "render",
        help="print the exact vLLM invocation a profile renders to (secrets masked)",
        description="Print the argv, the environment and the --config YAML `qwen38 serve` would run.",
    )
    render.add_argument("--profile", help="profile to render (default: the PROFILE setting)")
    render.add_argument("--json", action="store_true", help="one JSON object: argv, env, config")
    render.set_defaults(func=_cmd_render)
