"""The resolved engine -> vLLM's engine arguments: the one place that names them.

`engine_args` turns a `ResolvedEngine` (`entrypoint.resolved_engine`) into the arguments vLLM 0.28.0
takes, by their long-form names, as its ``--config`` YAML takes them. The launch writes them
into that YAML (`entrypoint.launch.render_invocation`, with the API server's own: where it
listens, its log level, the stack's middleware); the planner hands those that shape the KV
cache (`KV_SHAPING`) to vLLM's own ``EngineArgs`` in its child process (`planned_engine_args`,
read by `entrypoint.kv_capacity`). What is planned is what is launched by construction, not
by a test that compares two derivations (the planner once counted a drafter the launch left
off). Everything here is pure.
"""

from __future__ import annotations

import json
from typing import Any

from core.settings import Settings
from entrypoint.asgi import MIDDLEWARE_PATH
from entrypoint.drain import ENGINE_GRACE_S
from entrypoint.resolved_engine import ResolvedEngine

# The arguments of `engine_args` that shape the KV pool: what the planner asks vLLM about.
KV_SHAPING = (
    "model",
    "dtype",
    "max-model-len",
    "max-num-seqs",
    "max-num-batched-tokens",
    "kv-cache-memory-bytes",
    "enable-prefix-caching",
    "kv-cache-dtype",
    "mamba-ssm-cache-dtype",
    "block-size",
    "tensor-parallel-size",
    "speculative-config",
)


def engine_args(resolved: ResolvedEngine, settings: Settings | None = None) -> dict[str, Any]:
    """vLLM's arguments for ``resolved``, by their long-form names.

    With ``settings``, also the API server's own (the launch): where it listens, its log
    level, what it logs and the stack's middleware; without them, the engine's alone."""
    listen = {"host": settings.host, "port": settings.port} if settings is not None else {}
    args: dict[str, Any] = {
        "model": resolved.target_dir,
        "served-model-name": resolved.served_model_name,
        **listen,
        "dtype": resolved.dtype,
        "max-model-len": resolved.max_model_len,
        "max-num-seqs": resolved.max_num_seqs,
        "kv-cache-dtype": resolved.kv_cache_dtype,
        "enable-prefix-caching": resolved.enable_prefix_caching,
        "mamba-ssm-cache-dtype": resolved.mamba_ssm_cache_dtype,
    }
    if settings is not None:
        args.update(
            {
                # Per-request cached-token counts: the cache-isolation validator reads them.
                "enable-prompt-tokens-details": True,
                "uvicorn-log-level": settings.log_level,
                # The watchdog and Prometheus read /metrics every few seconds: not a log line each.
                "disable-access-log-for-endpoints": "/metrics",
                # The key guard around every route (vLLM's own covers /v1 & co. only), the instance
                # header, and the end of open streams at shutdown (entrypoint.asgi).
                "middleware": [MIDDLEWARE_PATH],
            }
        )
        profiler = profiler_config(settings)
        if profiler is not None:
            args["profiler-config"] = profiler
    # vLLM drains a little longer than the guard, which ends what is still open first.
    args["shutdown-timeout"] = resolved.shutdown_timeout + ENGINE_GRACE_S
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
    args.update({k: v for k, v in optional.items() if v is not None})
    if resolved.cudagraph_capture_limit is not None:
        args["compilation-config"] = {
            **(resolved.compilation_config or {}),
            "max_cudagraph_capture_size": resolved.cudagraph_capture_limit,
        }
    if resolved.enforce_eager:
        args["enforce-eager"] = True
    if resolved.language_model_only:
        args["language-model-only"] = True
    args.update(vision_args(resolved))
    if resolved.tool_call_parser:
        args["enable-auto-tool-choice"] = True
        args["tool-call-parser"] = resolved.tool_call_parser
    if resolved.default_chat_template_kwargs:
        args["default-chat-template-kwargs"] = resolved.default_chat_template_kwargs
    speculative = _speculative_config(resolved)
    if speculative is not None:
        args["speculative-config"] = speculative
    args.update(_parallel_args(resolved))
    lora = resolved.lora
    if lora is not None:
        args["enable-lora"] = True
        args["max-lora-rank"] = lora.max_lora_rank
        args["max-loras"] = lora.max_loras
        # vLLM turns YAML list items into strings with str(): give it JSON strings.
        module = {"name": lora.adapter_id, "path": lora.path, "base_model_name": lora.base_model_name}
        args["lora-modules"] = [json.dumps(module, sort_keys=True)]
    args.update(resolved.extra)
    return args


def vision_args(resolved: ResolvedEngine) -> dict[str, Any]:
    """vLLM's multimodal arguments with VISION on: images only (no video: the stack offers none,
    and the CPU image has no torchvision to decode it), at most the setting's count a prompt, and
    the image processor capped at the setting's pixels (the size vLLM profiles the encoder with)."""
    if resolved.vision is None:
        return {}
    # vLLM's own check of the URL hosts our API layer lets through (its empty list allows any
    # host: our layer alone then refuses every URL). Redirects are off (`entrypoint.launch._engine_env`).
    domains = {"allowed-media-domains": list(resolved.vision.url_domains)} if resolved.vision.url_domains else {}
    return {
        **domains,
        "limit-mm-per-prompt": {"image": resolved.vision.images_per_prompt, "video": 0},
        "mm-processor-kwargs": {"max_pixels": resolved.vision.max_pixels, **resolved.vision.processor_kwargs},
        # No processor cache: with it, vLLM 0.28.0 runs the HF processor on a prompt's text
        # alone, and transformers 5's Qwen3-VL processor refuses an image token without its
        # image ("Found 1 <|image_pad|> tokens in the text but no images"): the start-up
        # profiling run fails. Each image is then processed once per request it is in.
        "mm-processor-cache-gb": 0,
    }


def profiler_config(settings: Settings) -> dict[str, Any] | None:
    """vLLM's ``--profiler-config`` for TORCH_PROFILE_DIR (None: unset, profiling off).

    The torch profiler writing into that directory (vLLM wants it absolute), without Python
    stacks (they multiply the trace and the step's host time); vLLM's defaults otherwise:
    gzip'd chrome traces, every iteration between /start_profile and /stop_profile."""
    if settings.torch_profile_dir is None:
        return None
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(settings.torch_profile_dir.absolute()),
        "torch_profiler_with_stack": False,
    }


def _speculative_config(resolved: ResolvedEngine) -> dict[str, Any] | None:
    spec = resolved.speculative
    if spec is None:
        return None
    # Lookup drafting (patch 0070) widens the verify block: vLLM verifies
    # num_speculative_tokens drafts, the last lookup_tokens of them from lookup.
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.lookup_tokens:
        config["lookup_tokens"] = spec.lookup_tokens
    if spec.drafter_dir is not None:
        config["model"] = spec.drafter_dir
    if spec.draft_sample_method is not None:
        config["draft_sample_method"] = spec.draft_sample_method
    if spec.attention_backend is not None:
        config["attention_backend"] = spec.attention_backend
    return config


def _parallel_args(resolved: ResolvedEngine) -> dict[str, Any]:
    """vLLM's own tensor parallelism: its multiprocessing executor, in one host or across hosts
    (never Ray, which the images do not ship and vLLM 0.28.0 does not need for either)."""
    par = resolved.parallel
    if par is None:
        return {}
    args: dict[str, Any] = {"tensor-parallel-size": par.tensor_parallel_size, "distributed-executor-backend": "mp"}
    if not par.custom_all_reduce:
        args["disable-custom-all-reduce"] = True
    if par.nodes > 1:
        args.update(
            {"nnodes": par.nodes, "node-rank": par.node_rank, "master-addr": par.head_address,
             "master-port": par.head_port}
        )  # fmt: skip
    return args


def planned_engine_args(
    resolved: ResolvedEngine, *, target: str, drafter: str | None, batched_tokens: int
) -> dict[str, Any]:
    """``EngineArgs``' keywords for the arguments of `engine_args` that shape the KV cache
    (`KV_SHAPING`), as the planner's child process (`entrypoint.kv_capacity`) hands them to vLLM.

    Three things differ from the launch, each the planner's: the models are the shape-only
    copies of their config.json at ``target`` and ``drafter``; the batch is ``batched_tokens``
    where the profile leaves it to vLLM's default for the device (vLLM would pick the planning
    machine's); lookup drafting is only the width of the verify block (the KV arithmetic needs
    nothing more, so a stock tree, which has no ``lookup_tokens``, plans the same request)."""
    args = engine_args(resolved)
    keywords = {name.replace("-", "_"): args[name] for name in KV_SHAPING if name in args}
    keywords["model"] = target
    keywords.setdefault("max_num_batched_tokens", batched_tokens)
    speculative = keywords.get("speculative_config")
    if speculative is not None:
        speculative = {key: value for key, value in speculative.items() if key not in ("lookup_tokens", "model")}
        if drafter is not None:
            speculative["model"] = drafter
        keywords["speculative_config"] = speculative
    return keywords
