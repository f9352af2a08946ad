"""Launch: render a profile + settings into the exact vLLM invocation, then exec it.

`render_invocation` is pure: the same profile, settings and key give the same argv,
environment and ``--config`` YAML content. Nearly everything goes into the YAML (vLLM's
``--config`` takes long-form names; the command line would win over it, so we put nothing
else there); the API key travels in the environment, never in argv, and is masked
whenever an invocation is shown.

`qwen38 serve` runs the flow of DESIGN.md: settings -> verify -> plan -> render -> launch,
where launch is a supervisor (`entrypoint.supervise`) that owns vLLM's processes, stops them
within a bound and runs the readiness gate; `entrypoint.asgi.StackMiddleware`, named in the
YAML, puts the API key guard around every route of vLLM's app.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from entrypoint.asgi import API_KEY_ENV, MIDDLEWARE_PATH
from entrypoint.drain import DRAIN_ENV, ENGINE_GRACE_S
from entrypoint.errors import SettingsError
from entrypoint.profiles import Profile, load_profile
from entrypoint.settings import Settings, load_settings, read_api_key

ENGINE_MODULE = "entrypoint.engine_main"  # vLLM's OpenAI server, tied to the supervisor's life
MASK = "********"
SECRET_ENV = frozenset({API_KEY_ENV})


@dataclass(frozen=True)
class Invocation:
    """Exactly what is exec'ed: argv, the environment set for vLLM, the --config content."""

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


@dataclass(frozen=True)
class Resolved:
    """The profile's engine settings after the user's overrides were applied."""

    max_model_len: int
    max_num_seqs: int
    kv_cache_memory_bytes: int | None
    prefix_caching: bool
    speculation: bool
    enable_thinking: bool | None
    lookup_tokens: int = 0  # verify positions past the drafter's filled by lookup drafting


def resolve(profile: Profile, settings: Settings) -> Resolved:
    """Apply the overrides; refuse ones the profile cannot honour (one line each)."""
    engine = profile.engine
    spec = profile.speculative
    speculation = settings.speculation if settings.speculation is not None else bool(spec and spec.enabled)
    if speculation and spec is None:
        raise SettingsError(f"SPECULATION=true: profile {profile.name} has no speculative decoding configured")
    lookup_tokens = 0
    if speculation:
        try:
            lookup_tokens = spec.lookup_tokens(settings.lookup, settings.verify_block)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    elif settings.lookup or settings.verify_block is not None:
        knob = "LOOKUP=true" if settings.lookup else f"VERIFY_BLOCK={settings.verify_block}"
        raise SettingsError(
            f"{knob}: lookup drafting extends speculative decoding, which is off for profile {profile.name}; "
            "set SPECULATION=true"
        )
    prefix_caching = settings.prefix_caching if settings.prefix_caching is not None else engine.enable_prefix_caching
    if profile.platform == "cpu" and speculation and prefix_caching:
        raise SettingsError(
            f"profile {profile.name}: the CPU build cannot combine speculative decoding with prefix caching on "
            "a hybrid (GDN) target (the align-mode state copy is a Triton kernel); "
            "set SPECULATION=false or PREFIX_CACHING=false"
        )
    return Resolved(
        max_model_len=settings.max_model_len or engine.max_model_len,
        max_num_seqs=settings.max_num_seqs or engine.max_num_seqs,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes or engine.kv_cache_memory_bytes,
        prefix_caching=prefix_caching,
        speculation=speculation,
        enable_thinking=settings.enable_thinking,
        lookup_tokens=lookup_tokens,
    )


def model_dir(settings: Settings, relative: str) -> Path:
    return (settings.models_dir / relative).absolute()


def run_dir(settings: Settings) -> Path:
    return (settings.cache_dir / "run").absolute()


def status_path(settings: Settings, profile_name: str) -> Path:
    return run_dir(settings) / f"{profile_name}.status.json"


def compile_cache_key(profile: Profile, resolved: Resolved) -> str:
    """A cache directory name keyed by everything that shapes the compiled graphs.

    vLLM 0.28.0's own compile-cache hash misses the speculative depth (upstream #53292);
    keying the whole cache root by what we know shapes the graphs keeps two shapes from
    ever sharing an artifact, patched or not.
    """
    spec = profile.speculative
    factors = {
        "profile": profile.name,
        "speculation": resolved.speculation,
        "method": spec.method if (spec and resolved.speculation) else None,
        "depth": spec.num_speculative_tokens + resolved.lookup_tokens if (spec and resolved.speculation) else 0,
        "draft_sample_method": spec.draft_sample_method if (spec and resolved.speculation) else None,
        "lora": profile.lora is not None,
        "kv_cache_dtype": profile.engine.kv_cache_dtype,
        "max_num_seqs": resolved.max_num_seqs,
        "prefix_caching": resolved.prefix_caching,
        "enforce_eager": profile.engine.enforce_eager,
        "compilation_config": profile.engine.compilation_config,
    }
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:12]
    return f"{profile.name}-{digest}"


def cudagraph_capture_limit(profile: Profile, resolved: Resolved) -> int | None:
    """The largest CUDA graph worth capturing: every slot verifying its whole block at once.

    vLLM 0.28.0 captures up to twice that (max_num_seqs x (1 + K) x 2); each size costs
    capture time at every cold start and graph memory, and no decode step can use it. None
    where the profile decides itself (its own sizes, eager, or no CUDA graphs at all).
    """
    own = profile.engine.compilation_config or {}
    if profile.platform != "cuda" or profile.engine.enforce_eager:
        return None
    if {"cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode"} & set(own):
        return None
    width = 1
    if resolved.speculation and profile.speculative is not None:
        width += profile.speculative.num_speculative_tokens + resolved.lookup_tokens
    return resolved.max_num_seqs * width


def shutdown_drain(profile: Profile, settings: Settings) -> int:
    """Seconds SIGTERM lets in-flight requests run (SHUTDOWN_TIMEOUT, else the profile's)."""
    return settings.shutdown_timeout if settings.shutdown_timeout is not None else profile.engine.shutdown_timeout


def _engine_config(profile: Profile, settings: Settings, resolved: Resolved) -> dict[str, Any]:
    engine = profile.engine
    config: dict[str, Any] = {
        "model": str(model_dir(settings, profile.models.target.dir)),
        "served-model-name": profile.served.base,
        "host": settings.host,
        "port": settings.port,
        "dtype": engine.dtype,
        "max-model-len": resolved.max_model_len,
        "max-num-seqs": resolved.max_num_seqs,
        "kv-cache-dtype": engine.kv_cache_dtype,
        "enable-prefix-caching": resolved.prefix_caching,
        "mamba-ssm-cache-dtype": engine.mamba_ssm_cache_dtype,
        # Per-request cached-token counts: the cache-isolation validator reads them.
        "enable-prompt-tokens-details": True,
        "uvicorn-log-level": settings.log_level,
        # The watchdog and Prometheus read /metrics every few seconds: not a log line each.
        "disable-access-log-for-endpoints": "/metrics",
        # The key guard around every route (vLLM's own covers /v1 & co. only), the instance
        # header, and the end of open streams at shutdown (entrypoint.asgi).
        "middleware": [MIDDLEWARE_PATH],
        # vLLM drains a little longer than the guard, which ends what is still open first.
        "shutdown-timeout": shutdown_drain(profile, settings) + ENGINE_GRACE_S,
    }
    optional = {
        "kv-cache-memory-bytes": resolved.kv_cache_memory_bytes,
        "gpu-memory-utilization": engine.gpu_memory_utilization,
        "max-num-batched-tokens": engine.max_num_batched_tokens,
        "block-size": engine.block_size,
        "seed": engine.seed,
        "compilation-config": engine.compilation_config,
        "additional-config": engine.additional_config,
        "structured-outputs-config": engine.structured_outputs_config,
        "reasoning-parser": engine.reasoning_parser,
        "enable-flashinfer-autotune": engine.enable_flashinfer_autotune,
    }
    config.update({k: v for k, v in optional.items() if v is not None})
    capture = cudagraph_capture_limit(profile, resolved)
    if capture is not None:
        config["compilation-config"] = {**(engine.compilation_config or {}), "max_cudagraph_capture_size": capture}
    if engine.enforce_eager:
        config["enforce-eager"] = True
    if engine.language_model_only:
        config["language-model-only"] = True
    if engine.tool_call_parser:
        config["enable-auto-tool-choice"] = True
        config["tool-call-parser"] = engine.tool_call_parser

    template_kwargs = dict(engine.default_chat_template_kwargs or {})
    if resolved.enable_thinking is not None:
        template_kwargs["enable_thinking"] = resolved.enable_thinking
    if template_kwargs:
        config["default-chat-template-kwargs"] = template_kwargs

    if resolved.speculation and profile.speculative is not None:
        spec = profile.speculative
        # Lookup drafting (patch 0070) widens the verify block: vLLM verifies
        # num_speculative_tokens drafts, the last lookup_tokens of them from lookup.
        spec_config: dict[str, Any] = {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens + resolved.lookup_tokens,
        }
        if resolved.lookup_tokens:
            spec_config["lookup_tokens"] = resolved.lookup_tokens
        if profile.models.drafter is not None:
            spec_config["model"] = str(model_dir(settings, profile.models.drafter.dir))
        if spec.draft_sample_method is not None:
            spec_config["draft_sample_method"] = spec.draft_sample_method
        if spec.attention_backend is not None:
            spec_config["attention_backend"] = spec.attention_backend
        config["speculative-config"] = spec_config

    if profile.lora is not None and profile.models.adapter is not None and profile.served.adapter:
        config["enable-lora"] = True
        config["max-lora-rank"] = profile.lora.max_lora_rank
        config["max-loras"] = profile.lora.max_loras
        # vLLM turns YAML list items into strings with str(): give it JSON strings.
        module = {
            "name": profile.served.adapter,
            "path": str(model_dir(settings, profile.models.adapter.dir)),
            "base_model_name": profile.served.base,
        }
        config["lora-modules"] = [json.dumps(module, sort_keys=True)]

    for key, value in engine.extra.items():
        config[key.replace("_", "-")] = value
    return config


def _engine_env(profile: Profile, settings: Settings, api_key: SecretStr | None, cache_key: str) -> dict[str, str]:
    cache = settings.cache_dir.absolute()
    env = {
        "VLLM_CACHE_ROOT": str(cache / "vllm" / cache_key),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "FLASHINFER_WORKSPACE_BASE": str(cache / "flashinfer"),
        "VLLM_LOGGING_LEVEL": settings.log_level.upper(),
        # Serving never downloads: every file was fetched, pinned and verified by `prepare`.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        DRAIN_ENV: str(shutdown_drain(profile, settings)),
    }
    if profile.platform == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = settings.cuda_visible_devices
    env.update(profile.env)
    if api_key is not None:
        # Our guard's variable, not VLLM_API_KEY: vLLM would install its own narrower check beside it.
        env[API_KEY_ENV] = api_key.get_secret_value()
    return env


def render_invocation(
    profile: Profile,
    settings: Settings,
    api_key: SecretStr | None,
    python: str = sys.executable,
) -> Invocation:
    """Profile + settings + key -> the exact vLLM invocation (pure; no I/O)."""
    if profile.require_api_key and api_key is None:
        raise SettingsError(
            f"profile {profile.name} requires an API key: set API_KEY_FILE (e.g. from `qwen38 key init`) "
            "or VLLM_API_KEY"
        )
    resolved = resolve(profile, settings)
    cache_key = compile_cache_key(profile, resolved)
    config = _engine_config(profile, settings, resolved)
    config_path = run_dir(settings) / f"{profile.name}.vllm.yaml"
    argv = [python, "-m", ENGINE_MODULE, "--config", str(config_path)]
    return Invocation(
        argv=argv,
        env=_engine_env(profile, settings, api_key, cache_key),
        config=config,
        config_path=config_path,
        cache_key=cache_key,
        model_ids=profile.model_ids,
    )


# ---- I/O edge: commands ------------------------------------------------------------------


def load(args: argparse.Namespace) -> tuple[Profile, Settings, SecretStr | None]:
    settings = load_settings(profile=getattr(args, "profile", None))
    profile = load_profile(settings.profile, settings.profiles_dir)
    return profile, settings, read_api_key(settings)


def _cmd_render(args: argparse.Namespace) -> int:
    profile, settings, key = load(args)
    invocation = render_invocation(profile, settings, key)
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
    from prepare.atomic import atomic_write_text

    atomic_write_text(invocation.config_path, invocation.config_yaml())


def _cmd_serve(args: argparse.Namespace) -> int:
    from entrypoint import ready
    from entrypoint.supervise import begin_start, check_interpreter, supervise

    profile, settings, key = load(args)
    start = begin_start(profile, settings)  # run lock, leftovers of a killed start, old verdict gone
    invocation = render_invocation(profile, settings, key)
    check_interpreter(invocation)
    from entrypoint.preflight import run_preflight

    identity = run_preflight(profile, settings, invocation)
    write_run_files(invocation)
    gate = ready.Watcher(profile, settings, key, identity=identity, instance=start.instance)
    print(f"qwen38: serving profile {profile.name} ({', '.join(profile.model_ids)}) on {gate.base_url}", flush=True)
    return supervise(invocation, start, gate=None if args.no_ready_gate else gate.run)


def register(subparsers: argparse._SubParsersAction) -> None:
    render = subparsers.add_parser(
        "render",
        help="print the exact vLLM invocation a profile renders to (secrets masked)",
        description="Print the argv, the environment and the --config YAML `qwen38 serve` would exec.",
    )
    render.add_argument("--profile", help="profile to render (default: the PROFILE setting)")
    render.add_argument("--json", action="store_true", help="one JSON object: argv, env, config")
    render.set_defaults(func=_cmd_render)

    serve = subparsers.add_parser(
        "serve",
        help="verify, plan, then run vLLM for a profile under a supervisor (readiness gate, bounded stop)",
        description="Run the start-up flow: verify the pinned artifacts, plan memory, render the "
        "invocation and run vLLM as a child this process supervises: it runs the readiness gate, "
        "stops the server if the gate fails, and on SIGTERM stops every engine process within "
        "the profile's drain plus a fixed margin.",
    )
    serve.add_argument("--profile", help="profile to serve (default: the PROFILE setting)")
    serve.add_argument("--no-ready-gate", action="store_true", help="do not run the readiness gate")
    serve.set_defaults(func=_cmd_serve)
