"""Resolve: a profile plus the user's settings become one typed engine description.

`resolve` is the one place where a profile's engine table, its speculative and LoRA
sections and the overrides in `Settings` meet. Rendering the vLLM invocation, planning its
memory, the plan cache key and the compile cache key all read the same `ResolvedEngine`,
computed once per command, so they cannot disagree about what will run (they once did:
the planner counted a drafter the launch left off). Knobs that conflict raise one
`SettingsError` line, the same for every command.

The value it returns, `ResolvedEngine`, and its digest live in `entrypoint.resolved_engine`.

The resolution is pure but for what this host is asked: `resolve_on_this_host`, the one
resolution of a command that starts or shows an engine here, reads the link between the
profile's GPUs from nvidia-smi where that link decides something (`resolve`'s ``link_reader``).
What only a launch refuses, or the models refuse, is checked where the launch
(`entrypoint.launch`) and the models' configs (`entrypoint.model_configs`) are.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from core.errors import SettingsError
from core.profiles import MAX_VERIFY_BLOCK, Profile, Speculative
from core.settings import DEFAULT_IMAGES_PER_PROMPT, DEFAULT_MAX_PIXELS, SPECULATION_METHODS, Settings, url_domains
from entrypoint.resolved_engine import (
    ResolvedEngine,
    ResolvedLora,
    ResolvedParallel,
    ResolvedSpeculative,
    ResolvedVision,
)
from entrypoint.toolchain import Runner, run_command
from entrypoint.topology import LinkReading, TopologyError, read_link

LinkReader = Callable[[str], "LinkReading | None"]  # CUDA_VISIBLE_DEVICES -> the link nvidia-smi reports
# Machines whose profiles keep the vision tower in host memory unless VISION_TOWER says otherwise:
# a 24 GB card has no 0.92 GB to spare beside its KV pool. (The Spark's memory is one pool for
# CPU and GPU alike: moving the tower saves it nothing.)
TOWER_IN_HOST_MEMORY = frozenset({"rtx3090"})

def lookup_tokens(spec: Speculative, lookup: bool | None, verify_block: int | None) -> int:
    """Verify positions past the drafter's that lookup drafting fills for ``spec`` (0: off).

    ``lookup``/``verify_block`` are the user's overrides (None: this profile decides).
    Raises SettingsError (one line) for a combination vLLM could not honour.
    """
    on = spec.lookup if lookup is None else lookup
    if not on:
        if verify_block is not None:
            raise SettingsError(
                f"VERIFY_BLOCK={verify_block}: without lookup drafting the verify block is "
                f"1 + the drafter depth ({spec.num_speculative_tokens + 1}); set LOOKUP=true or unset VERIFY_BLOCK"
            )
        return 0
    if spec.method != "dflash":
        raise SettingsError(f"LOOKUP=true: lookup drafting extends a dflash drafter, not method {spec.method!r}")
    block = spec.verify_block if verify_block is None else verify_block
    least = spec.num_speculative_tokens + 2
    if not least <= block <= MAX_VERIFY_BLOCK:
        raise SettingsError(
            f"VERIFY_BLOCK={block}: with the drafter's {spec.num_speculative_tokens} tokens it must be "
            f"{least}..{MAX_VERIFY_BLOCK} (1 + drafter depth + at least one lookup token)"
        )
    return block - 1 - spec.num_speculative_tokens


def speculation_method(profile: Profile, choice: bool | str | None) -> str | None:
    """The method ``choice`` (the SPECULATION setting) picks on ``profile``; None: off.

    None leaves it to the profile (its own method where `enabled`), True is the profile's own
    method, False off, a name that method if the profile allows it (one `SettingsError` line if not).
    """
    spec = profile.speculative
    if choice is None:
        return spec.method if spec is not None and spec.enabled else None
    if choice is False:
        return None
    if spec is None:
        said = "true" if choice is True else choice
        raise SettingsError(f"SPECULATION={said}: profile {profile.name} has no speculative decoding configured")
    if choice is True:
        return spec.method
    if choice not in spec.methods:
        raise SettingsError(
            f"SPECULATION={choice}: profile {profile.name} allows {', '.join(spec.methods)} or off, not {choice}"
        )
    return choice


def reads_drafter(profile: Profile, choice: bool | str | None) -> bool:
    """Whether the engine reads the profile's drafter directory with SPECULATION ``choice``:
    only its own drafting method does (mtp and off read none)."""
    return _drafts_with_drafter(profile, speculation_method(profile, choice))


def unread_drafter(profile: Profile, choice: bool | str | None) -> str | None:
    """Why the engine will not read ``profile``'s drafter with SPECULATION ``choice``, and what
    would prepare it; None: prepare it (the engine reads it, or there is none to download).

    A generated (tiny) drafter is never skipped: one generator run writes every tiny model."""
    drafter = profile.models.drafter
    if drafter is None or drafter.generated is not None or reads_drafter(profile, choice):
        return None
    method = speculation_method(profile, choice)
    if choice is None:
        said = f"profile {profile.name} by default"  # its own speculative section decides
    else:
        said = "SPECULATION=" + ("true" if choice is True else "off" if choice is False else str(choice))
    if method == "mtp":
        why = f"{said} serves the target's own MTP head"
    elif method is not None:
        why = f"{said} drafts with {method}, which does not read it"
    else:
        why = f"{said} serves without speculative decoding"
    # Only the settings that do read it, tried against the same decision.
    ways = []
    own = profile.speculative.method if profile.speculative is not None else None
    if own in SPECULATION_METHODS and reads_drafter(profile, own):
        ways.append(f"set SPECULATION={own}")
    elif reads_drafter(profile, True):
        ways.append("set SPECULATION=true")
    if choice is not None and reads_drafter(profile, None):
        ways.append("unset SPECULATION")
    return f"{why}; {' or '.join(ways)} to prepare it" if ways else why


def _drafts_with_drafter(profile: Profile, method: str | None) -> bool:
    spec, drafter = profile.speculative, profile.models.drafter
    return method is not None and method == spec.method and spec.uses_drafter and drafter is not None


def resolve_speculative(profile: Profile, settings: Settings, models_dir: Path) -> ResolvedSpeculative | None:
    """The speculation ``profile`` serves with ``settings`` (None: off): the method SPECULATION
    picks, its depth (MTP_DEPTH for mtp) and lookup positions; one `SettingsError` line for a
    combination it cannot serve."""
    method = speculation_method(profile, settings.speculation)
    if method != "dflash" and (settings.lookup or settings.verify_block is not None):
        knob = "LOOKUP=true" if settings.lookup else f"VERIFY_BLOCK={settings.verify_block}"
        if method is None:
            raise SettingsError(
                f"{knob}: lookup drafting extends speculative decoding, which is off for profile "
                f"{profile.name}; set SPECULATION=true"
            )
        raise SettingsError(
            f"{knob}: lookup drafting extends a dflash drafter, not method {method!r}; set SPECULATION=dflash"
        )
    if settings.mtp_depth is not None and method != "mtp":
        raise SettingsError(
            f"MTP_DEPTH={settings.mtp_depth}: speculation on profile {profile.name} is {method or 'off'}, "
            "not mtp; set SPECULATION=mtp or unset MTP_DEPTH"
        )
    if method is None:
        return None
    spec = profile.speculative
    assert spec is not None  # a method was chosen from it
    if method == "mtp":
        return ResolvedSpeculative(
            method="mtp",
            drafter_tokens=settings.mtp_depth or spec.depth("mtp"),
            lookup_tokens=0,
            # The profile's sampling and backend are its drafter's; the MTP head keeps vLLM's defaults.
            draft_sample_method=spec.draft_sample_method if spec.method == "mtp" else None,
            drafter_dir=None,  # vLLM reads the head from the target (its `mtp.*` tensors)
            attention_backend=spec.attention_backend if spec.method == "mtp" else None,
        )
    drafter = profile.models.drafter
    return ResolvedSpeculative(
        method=method,
        drafter_tokens=spec.num_speculative_tokens,
        lookup_tokens=lookup_tokens(spec, settings.lookup, settings.verify_block),
        draft_sample_method=spec.draft_sample_method,
        drafter_dir=str((models_dir / drafter.dir).absolute()) if _drafts_with_drafter(profile, method) else None,
        attention_backend=spec.attention_backend,
    )


def processor_kwargs(platform: str) -> dict[str, object]:
    """The image processor options the engine is given on ``platform`` (its ``mm_processor_kwargs``).

    The CPU image's torchvision is an import-only stand-in (docker/cpu/torchvision-standin), and
    stock vLLM 0.28.0's Qwen3-VL processing asks transformers for the torchvision image processor
    (``use_fast=True``) unless a request asks otherwise: its first resize fails. Patch 0086 lets
    the engine's own options choose, so on CPU every image, a request's or the start-up profiling's
    dummy one, goes through transformers' PIL processor (``use_fast: false``), whichever API it
    came in by. GPU images ship the real torchvision and keep the fast one."""
    return {"use_fast": False} if platform == "cpu" else {}


def resolve_vision(profile: Profile, settings: Settings) -> ResolvedVision | None:
    """Images in (VISION=true; no shipped profile turns them on by itself), with the limits of one
    request; None: text only. The target's tower is checked where its config.json is read
    (`entrypoint.model_configs.check_model_limits`)."""
    if not settings.vision:
        for knob, value in (("VISION_IMAGES_PER_PROMPT", settings.vision_images_per_prompt),
                            ("VISION_MAX_PIXELS", settings.vision_max_pixels),
                            ("VISION_URL_DOMAINS", settings.vision_url_domains),
                            ("VISION_TOWER", settings.vision_tower)):
            if value is not None:
                raise SettingsError(
                    f"{knob}={value}: vision is off for profile {profile.name}; set VISION=true or unset {knob}"
                )
        return None
    return ResolvedVision(
        images_per_prompt=settings.vision_images_per_prompt or DEFAULT_IMAGES_PER_PROMPT,
        max_pixels=settings.vision_max_pixels or DEFAULT_MAX_PIXELS,
        processor_kwargs=processor_kwargs(profile.platform),
        url_domains=url_domains(settings.vision_url_domains),
        tower=settings.vision_tower or ("host" if profile.machine in TOWER_IN_HOST_MEMORY else "gpu"),
    )


def cudagraph_capture_limit(profile: Profile, max_num_seqs: int, speculative: ResolvedSpeculative | None) -> int | None:
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
    width = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
    return max_num_seqs * width


def _devices(profile: Profile, settings: Settings) -> str | None:
    """CUDA_VISIBLE_DEVICES: the user's, else the first GPUs the profile needs on this host."""
    if profile.platform != "cuda":
        return None
    needed = profile.parallel.gpus_per_node
    if settings.cuda_visible_devices is None:
        return ",".join(str(index) for index in range(needed))
    named = settings.cuda_visible_devices.split(",")
    if len(named) < needed:
        example = ",".join(str(index) for index in range(needed))
        raise SettingsError(
            f"CUDA_VISIBLE_DEVICES={settings.cuda_visible_devices}: profile {profile.name} splits every layer over "
            f"{needed} GPUs of this host (tensor_parallel_size {profile.parallel.tensor_parallel_size}); "
            f"name {needed}, e.g. CUDA_VISIBLE_DEVICES={example}, or leave it empty"
        )
    return settings.cuda_visible_devices


def _link(
    profile: Profile,
    settings: Settings,
    detected: LinkReading | None,
    link_reader: LinkReader | None,
    devices: str | None,
) -> tuple[str, str]:
    """The link between the profile's GPUs and where that answer came from."""
    if profile.parallel.nodes > 1:
        return "network", f"{profile.parallel.nodes} hosts"
    if settings.gpu_link != "auto":
        return settings.gpu_link, f"GPU_LINK={settings.gpu_link}"
    if detected is None and link_reader is not None and devices is not None:
        detected = link_reader(devices)
    if detected is not None:
        return detected.kind, f"nvidia-smi topo -m: {detected.summary()}"
    return "pcie", "assumed PCIe (GPU_LINK=auto and nvidia-smi topo -m was not read)"


def _parallel(
    profile: Profile,
    settings: Settings,
    detected: LinkReading | None,
    link_reader: LinkReader | None,
    devices: str | None,
) -> ResolvedParallel | None:
    par = profile.parallel
    if settings.node_rank >= par.nodes:
        where = "one host" if par.nodes == 1 else f"{par.nodes} hosts (ranks 0..{par.nodes - 1})"
        raise SettingsError(f"NODE_RANK={settings.node_rank}: profile {profile.name} runs on {where}; set NODE_RANK=0")
    if par.tensor_parallel_size == 1:
        return None
    link, origin = _link(profile, settings, detected, link_reader, devices)
    if link == "network" and settings.custom_all_reduce:
        raise SettingsError(
            f"CUSTOM_ALL_REDUCE=true: profile {profile.name}'s GPUs are in {par.nodes} hosts; vLLM's custom "
            "all-reduce sums between GPUs of one host (over NVLink or PCIe peer access); unset CUSTOM_ALL_REDUCE"
        )
    custom = settings.custom_all_reduce if settings.custom_all_reduce is not None else link == "nvlink"
    p2p = settings.nccl_p2p if settings.nccl_p2p is not None else link != "pcie"
    multi_host = par.nodes > 1  # where the hosts meet: checked by `entrypoint.launch.check_multi_host`
    return ResolvedParallel(
        tensor_parallel_size=par.tensor_parallel_size,
        nodes=par.nodes,
        node_rank=settings.node_rank,
        link=link,
        link_origin=origin,
        custom_all_reduce=custom,
        nccl_p2p=p2p,
        head_address=settings.head_address if multi_host else None,
        head_port=settings.head_port if multi_host else None,
        # The head's own address is the head address; a worker must say its own.
        node_address=(settings.node_address or (settings.head_address if settings.node_rank == 0 else None))
        if multi_host
        else None,
        network_interface=settings.network_interface if multi_host else None,
        rdma_devices=settings.rdma_devices if multi_host else None,
        nccl_log_level=settings.nccl_log_level,
    )


def resolve(
    profile: Profile,
    settings: Settings,
    detected_link: LinkReading | None = None,
    *,
    link_reader: LinkReader | None = None,
) -> ResolvedEngine:
    """Apply the user's overrides to the profile; refuse ones it cannot honour (one line each).

    ``detected_link`` is what `nvidia-smi topo -m` reported between the profile's GPUs (read
    at the edge, `entrypoint.topology`); with GPU_LINK=auto it picks the all-reduce defaults.
    ``link_reader`` reads it where it was not given and decides something (one host, several
    GPUs, GPU_LINK=auto): the edge's reader, `resolve_on_this_host`."""
    engine = profile.engine
    models_dir = Path(settings.models_dir)
    speculative = resolve_speculative(profile, settings, models_dir)
    prefix_caching = settings.prefix_caching if settings.prefix_caching is not None else engine.enable_prefix_caching
    if profile.platform == "cpu" and speculative is not None and prefix_caching:
        raise SettingsError(
            f"profile {profile.name}: the CPU build cannot combine speculative decoding with prefix caching on "
            "a hybrid (GDN) target (the align-mode state copy is a Triton kernel); "
            "set SPECULATION=false or PREFIX_CACHING=false"
        )
    template_kwargs = dict(engine.default_chat_template_kwargs or {})
    if settings.enable_thinking is not None:
        template_kwargs["enable_thinking"] = settings.enable_thinking
    lora = None
    if profile.lora is not None and profile.models.adapter is not None and profile.served.adapter:
        lora = ResolvedLora(
            adapter_id=profile.served.adapter,
            path=str((models_dir / profile.models.adapter.dir).absolute()),
            base_model_name=profile.served.base,
            max_lora_rank=profile.lora.max_lora_rank,
            max_loras=profile.lora.max_loras,
        )
    overrides = {
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "kv_cache_memory_bytes": settings.kv_cache_memory_bytes,
        "enable_prefix_caching": settings.prefix_caching,
        "speculation": settings.speculation,
        "mtp_depth": settings.mtp_depth,
        "lookup": settings.lookup,
        "verify_block": settings.verify_block,
        "enable_thinking": settings.enable_thinking,
        "shutdown_timeout": settings.shutdown_timeout,
        "vision": settings.vision,
    }
    max_num_seqs = settings.max_num_seqs or engine.max_num_seqs
    devices = _devices(profile, settings)
    vision = resolve_vision(profile, settings)
    return ResolvedEngine(
        profile=profile.name,
        platform=profile.platform,
        machine=profile.machine,
        cuda_arch=profile.cuda_arch,
        require_patches=profile.require_patches,
        target_dir=str((models_dir / profile.models.target.dir).absolute()),
        served_model_name=profile.served.base,
        dtype=engine.dtype,
        max_model_len=settings.max_model_len or engine.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        kv_cache_dtype=engine.kv_cache_dtype,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes or engine.kv_cache_memory_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enable_prefix_caching=prefix_caching,
        mamba_ssm_cache_dtype=engine.mamba_ssm_cache_dtype,
        block_size=engine.block_size,
        attention_backend=engine.attention_backend,
        enforce_eager=engine.enforce_eager,
        compilation_config=engine.compilation_config,
        cudagraph_capture_limit=cudagraph_capture_limit(profile, max_num_seqs, speculative),
        additional_config=engine.additional_config,
        enable_flashinfer_autotune=engine.enable_flashinfer_autotune,
        # Text only unless VISION=true; VISION=false makes a profile's VL target text-only too.
        language_model_only=vision is None and (engine.language_model_only or settings.vision is False),
        tool_call_parser=engine.tool_call_parser,
        reasoning_parser=engine.reasoning_parser,
        structured_outputs_config=engine.structured_outputs_config,
        default_chat_template_kwargs=template_kwargs or None,
        seed=engine.seed,
        shutdown_timeout=settings.shutdown_timeout if settings.shutdown_timeout is not None else engine.shutdown_timeout,
        extra={key.replace("_", "-"): value for key, value in engine.extra.items()},
        speculative=speculative,
        lora=lora,
        devices=devices,
        parallel=_parallel(profile, settings, detected_link, link_reader, devices),
        env=dict(profile.env),
        vision=vision,
        overridden=tuple(name for name, value in overrides.items() if value is not None),
    )


def resolve_on_this_host(profile: Profile, settings: Settings, run: Runner | None = None) -> ResolvedEngine:
    """`resolve`, once, with the link between the profile's GPUs as this host's nvidia-smi
    reports it where it decides something (one-host multi-GPU profiles with GPU_LINK=auto; a
    matrix that cannot be read counts as PCIe, the safe side, and says so). ``run`` runs
    nvidia-smi (default: `run_command`)."""

    def reading(devices: str) -> LinkReading | None:
        try:
            return read_link(devices, run or run_command)
        except TopologyError as exc:
            print(f"qwen38: topology: {exc}; assuming PCIe (set GPU_LINK to say)", file=sys.stderr)
            return None

    return resolve(profile, settings, link_reader=reading)
