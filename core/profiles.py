"""Profiles: one declarative TOML file per serving configuration in ``profiles/``.

A profile says which model directories it serves (each bound to the pinned artifact and
the transformation it derives from), under which model ids, and the engine settings that
shape it. It is data only; `entrypoint.resolve.resolve` turns a profile plus the user's
settings into the engine every command runs. Every field is typed and documented here,
once; unknown keys are rejected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import ProfileError

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
ARTIFACT_LOCK_NAME = "artifacts.lock.toml"

KVCacheDType = Literal[
    "auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head", "k4v2_g128"
]
# Our 4-bit-key / 2-bit-value KV cache (docs/kv-k4v2.md): Triton kernels for CUDA GPUs only.
K4V2_KV_CACHE_DTYPE = "k4v2_g128"
MambaDType = Literal["auto", "float32", "float16", "bfloat16"]


# The longest drain a profile or SHUTDOWN_TIMEOUT may ask for: with the supervisor's teardown
# margin (entrypoint.supervise) it stays well inside compose's 60 s stop_grace_period.
MAX_SHUTDOWN_TIMEOUT_S = 30
SHUTDOWN_MARGIN_S = 15  # after the drain, for the engine's teardown before its processes are killed

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSlot(_Strict):
    """One model directory the server reads."""

    dir: str = Field(description="Directory under MODELS_DIR that holds the model files.")
    artifact: str | None = Field(
        default=None,
        description="Key of profiles/artifacts.lock.toml this directory is (or derives from).",
    )
    transform: str | None = Field(
        default=None,
        description="Preparation step that produced `dir` from its origin (none: as downloaded or generated).",
    )
    generated: Literal["tiny"] | None = Field(
        default=None, description="Generated locally by `qwen38 tiny` instead of downloaded."
    )

    @model_validator(mode="after")
    def _has_an_origin(self) -> ModelSlot:
        if self.dir.startswith("/") or ".." in Path(self.dir).parts:
            raise ValueError(f"dir must be a relative path inside MODELS_DIR, got {self.dir!r}")
        if (self.artifact is None) == (self.generated is None):
            raise ValueError("a model slot names exactly one origin: `artifact` or `generated`")
        return self


class Served(_Strict):
    """The model ids clients see in /v1/models."""

    base: str = Field(description="Id of the clean base model.")
    adapter: str | None = Field(default=None, description="Id of the LoRA adapter, if any.")


class Models(_Strict):
    target: ModelSlot
    drafter: ModelSlot | None = None
    adapter: ModelSlot | None = None


# vLLM verifies at most this many tokens per step here (the DFlash drafters' block).
MAX_VERIFY_BLOCK = 16


# The MTP depth the 3090 seed serves by default (4 draft tokens, REFERENCE.md; issue 55).
SEED_MTP_DEPTH = 4
# MTP drafts at most this many tokens: 1 + depth is verified per step, at most MAX_VERIFY_BLOCK.
MAX_MTP_DEPTH = MAX_VERIFY_BLOCK - 1

SpeculativeMethod = Literal["dflash", "draft_model", "ngram", "mtp"]


class Mtp(_Strict):
    """The target's own multi-token-prediction head as a second speculation method
    (``SPECULATION=mtp``): no drafter directory, the head's weights are the target's ``mtp.*``."""

    num_speculative_tokens: int = Field(
        default=SEED_MTP_DEPTH,
        ge=1,
        le=MAX_MTP_DEPTH,
        description="Draft tokens per step (the MTP head run this many times); the MTP_DEPTH setting overrides it.",
    )


class Speculative(_Strict):
    """Speculative decoding (vLLM `--speculative-config`): the profile's own method, and the
    methods a deployment may choose instead (``SPECULATION``)."""

    enabled: bool = Field(default=True, description="Default on/off; the SPECULATION setting overrides it.")
    method: SpeculativeMethod = Field(
        default="dflash", description="The profile's own method (SPECULATION=true); dflash drafts with `models.drafter`."
    )
    num_speculative_tokens: int = Field(ge=1, le=16)
    draft_sample_method: Literal["greedy", "probabilistic"] | None = None
    attention_backend: Literal["TRITON_ATTN", "FLASHINFER", "FLASH_ATTN", "FLEX_ATTENTION"] | None = Field(
        default=None,
        description="Attention backend of the drafter's layers (vLLM's speculative_config.attention_backend). "
        "None: vLLM selects one for the drafter on its own; it never inherits the target's.",
    )
    lookup: bool = Field(
        default=False,
        description="Lookup drafting (reproduction mode) default on/off; the LOOKUP setting overrides it.",
    )
    verify_block: int = Field(
        default=MAX_VERIFY_BLOCK,
        ge=2,
        le=MAX_VERIFY_BLOCK,
        description="Tokens verified per step with lookup on: 1 + drafter depth + lookup tokens; "
        "the VERIFY_BLOCK setting overrides it.",
    )

    mtp: Mtp | None = Field(
        default=None,
        description="Also allow the target's MTP head (SPECULATION=mtp), with its depth; "
        "a profile whose own method is mtp has its depth in num_speculative_tokens instead.",
    )

    @model_validator(mode="after")
    def _mtp_once(self) -> Speculative:
        if self.method == "mtp" and self.mtp is not None:
            raise ValueError("method mtp takes its depth from num_speculative_tokens; drop the [speculative.mtp] table")
        return self

    @property
    def uses_drafter(self) -> bool:
        return self.method in ("dflash", "draft_model")

    @property
    def methods(self) -> tuple[str, ...]:
        """The speculation methods this profile can serve (besides none): its own, then mtp."""
        return (self.method,) + (("mtp",) if self.mtp is not None else ())

    def depth(self, method: str) -> int:
        """Draft tokens per step of ``method`` (one of `methods`) as the profile sets it."""
        if method == self.method:
            return self.num_speculative_tokens
        if method == "mtp" and self.mtp is not None:
            return self.mtp.num_speculative_tokens
        raise ValueError(f"method {method!r} is not one of this profile's ({', '.join(self.methods)})")


class Lora(_Strict):
    """Native per-request LoRA for the `adapter` slot (base requests bypass it)."""

    max_lora_rank: int = Field(default=1, ge=1, le=64)
    max_loras: int = Field(default=1, ge=1, le=8)


class Parallel(_Strict):
    """vLLM's own tensor parallelism: every layer split over several GPUs, in one host or several.

    vLLM's multiprocessing executor runs one worker per GPU; across hosts (``nodes`` > 1) the
    head runs the API and its share of the workers, each other host runs its share headless
    (vLLM's ``--nnodes``/``--node-rank``/``--headless``). The KV pool (``kv_cache_memory_bytes``)
    is per GPU, and so are the KV heads and recurrent state vLLM keeps in it.
    """

    tensor_parallel_size: int = Field(
        default=1, ge=1, le=8, description="GPUs each layer is split over (vLLM --tensor-parallel-size)."
    )
    nodes: int = Field(
        default=1, ge=1, le=8, description="Hosts the GPUs are in (vLLM --nnodes); each holds the same number."
    )

    @model_validator(mode="after")
    def _even_split(self) -> Parallel:
        if self.tensor_parallel_size % self.nodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} cannot be split evenly over {self.nodes} nodes"
            )
        return self

    @property
    def gpus_per_node(self) -> int:
        return self.tensor_parallel_size // self.nodes


class Engine(_Strict):
    """vLLM engine arguments (long-form names with `_`; rendered with `-`)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int = Field(ge=256, description="Longest request (prompt + output) served.")
    max_num_seqs: int = Field(ge=1, le=1024, description="Concurrent request slots.")
    max_num_batched_tokens: int | None = Field(default=None, ge=256)
    kv_cache_dtype: KVCacheDType = "auto"
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1 << 20, description="KV pool pinned in bytes (replaces utilization)."
    )
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    enable_prefix_caching: bool = False
    mamba_ssm_cache_dtype: MambaDType = "auto"
    block_size: int | None = Field(default=None, ge=1)
    attention_backend: str | None = Field(
        default=None,
        pattern=r"^[A-Z][A-Z0-9_]*$",
        description="vLLM attention backend by name (e.g. TRITON_ATTN); unset: vLLM picks for the GPU.",
    )
    enforce_eager: bool = False
    compilation_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    enable_flashinfer_autotune: bool | None = None
    language_model_only: bool = False
    shutdown_timeout: int = Field(
        default=0,
        ge=0,
        le=MAX_SHUTDOWN_TIMEOUT_S,
        description="Seconds SIGTERM lets in-flight requests finish before they are ended (vLLM's "
        "--shutdown-timeout; 0: end them at once).",
    )
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    structured_outputs_config: dict[str, Any] | None = None
    default_chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Other vLLM arguments, verbatim; may not repeat a typed field.",
    )

    @model_validator(mode="after")
    def _extra_does_not_shadow(self) -> Engine:
        typed = set(type(self).model_fields) - {"extra"}
        for key in self.extra:
            if key.replace("-", "_") in typed:
                raise ValueError(f"engine.extra.{key} repeats the typed field engine.{key}")
        return self


class Capacity(_Strict):
    """What the planner is expected to find (documentation and a regression check)."""

    pool_tokens: int | None = None
    pool_tokens_prefix_caching: int | None = None


class Profile(_Strict):
    """A serving configuration: models, ids, engine and the machine it is for."""

    name: str
    description: str
    platform: Literal["cpu", "cuda"]
    machine: str = Field(description="The machine it is sized for (e.g. rtx3090, dgx-spark).")
    cuda_arch: str | None = Field(default=None, description="Compute capability, e.g. 8.6.")
    require_api_key: bool = False
    require_patches: bool = Field(
        default=True,
        description="Refuse to serve unless every patch of the series is delivered (every profile of this "
        "stack runs the patched engine; only a test profile turns this off).",
    )
    served: Served
    models: Models
    engine: Engine
    speculative: Speculative | None = None
    lora: Lora | None = None
    parallel: Parallel = Field(default_factory=Parallel)
    env: dict[str, str] = Field(default_factory=dict, description="Environment for vLLM.")
    capacity: Capacity = Field(default_factory=Capacity)

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        needs_drafter = self.speculative is not None and self.speculative.uses_drafter
        if needs_drafter != (self.models.drafter is not None):
            raise ValueError("a dflash/draft_model `speculative` and `models.drafter` go together")
        has_adapter = self.models.adapter is not None
        if has_adapter != (self.served.adapter is not None) or has_adapter != (self.lora is not None):
            raise ValueError("`models.adapter`, `served.adapter` and `lora` go together")
        if self.served.adapter == self.served.base:
            raise ValueError("the adapter id must differ from the base id")
        if self.platform == "cpu" and self.engine.kv_cache_dtype == K4V2_KV_CACHE_DTYPE:
            raise ValueError(
                f"engine.kv_cache_dtype {K4V2_KV_CACHE_DTYPE}: its kernels are Triton kernels for CUDA GPUs and the "
                "CPU build has none; use kv_cache_dtype auto on a cpu profile"
            )
        return self

    @property
    def model_ids(self) -> list[str]:
        return [self.served.base] + ([self.served.adapter] if self.served.adapter else [])


def profile_names(directory: Path = PROFILES_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.toml") if p.name != ARTIFACT_LOCK_NAME)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    return f"{where}: {err['msg']}"


def load_profile(name: str, directory: Path = PROFILES_DIR) -> Profile:
    """Read and validate ``profiles/<name>.toml``; any problem is one `ProfileError` line."""
    path = directory / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(profile_names(directory)) or "none"
        raise ProfileError(f"unknown profile {name!r} (no {path}); known profiles: {known}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    try:
        return Profile.model_validate({"name": name, **data})
    except ValidationError as exc:
        raise ProfileError(f"{path}: {_first_error(exc)}") from None


def render_profiles_table(directory: Path = PROFILES_DIR) -> str:
    """A Markdown table of every profile, generated from the profile files."""
    rows = [
        "| Profile | Machine | Context | Slots | KV cache | Speculation | Model ids |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in profile_names(directory):
        p = load_profile(name, directory)
        spec = p.speculative
        spec_text = (
            f"{spec.method} K={spec.num_speculative_tokens}"
            + ("" if spec.enabled else " (off by default)")
            + (f", lookup to {spec.verify_block}" if spec.lookup else "")
            + (f"; or mtp K={spec.mtp.num_speculative_tokens}" if spec.mtp else "")
            if spec
            else "none"
        )
        par = p.parallel
        machine = p.machine if par.tensor_parallel_size == 1 else f"{par.tensor_parallel_size}x {p.machine}"
        if par.nodes > 1:
            machine += f" ({par.nodes} hosts)"
        rows.append(
            f"| `{name}` | {machine} | {p.engine.max_model_len:,} | {p.engine.max_num_seqs} | "
            f"{p.engine.kv_cache_dtype}{', prefix caching' if p.engine.enable_prefix_caching else ''} | "
            f"{spec_text} | {', '.join(f'`{i}`' for i in p.model_ids)} |"
        )
    return "\n".join(rows) + "\n"
