"""What `qwen38 generate` writes, as data: presets, tensor inventories, configs, shards.

Pure (no torch, no I/O): every model the generator makes is first described here, tensor
by tensor - name, safetensors dtype, shape and a `Recipe` that says how its bytes are drawn
- so the inventories, the configs and the byte counts are tested without writing a byte,
and the full size (Qwen3.8-27B: 64 layers, hidden 5120, vocab 248,320) differs from the tiny
ones only by a `TargetShape` / `DrafterShape`.

Formats (the real checkpoints' layouts, REFERENCE.md §1-§2, docs/prepare.md):

- ``bf16``: plain bf16 tensors;
- ``w4a16``: compressed-tensors pack-quantized int4, symmetric, group 128
  (``weight_packed`` I32 [out, in/8], ``weight_scale`` BF16 [out, in/128], ``weight_shape``
  I64 [2]) on every decoder Linear except the hub checkpoint's ``ignore`` list (lm_head,
  the MTP module, GDN ``in_proj_a`` / ``in_proj_b``), like dbirks/Qwen3.8-27B-W4A16-AutoRound;
- ``nvfp4``: ModelOpt MIXED_PRECISION like RadixArk/Qwen3.8-27B-NVFP4: the MLP
  projections packed NVFP4 (``weight`` U8 [out, in/2], ``weight_scale`` F8_E4M3 [out, in/16],
  ``weight_scale_2`` and ``input_scale`` F32), the attention and GDN projections static FP8
  (``weight`` F8_E4M3, per-tensor ``weight_scale`` and ``input_scale``), everything else BF16.
  The real checkpoint's per-module table is not public here (profiles/model-configs/README.md):
  this split is a plausible one, and `stored_bytes` says what it weighs against the article;
- ``gptq``: the DFlash2 drafter's GPTQ W4A16 (``qweight`` I32 [in/8, out], ``qzeros`` I32
  [in/128, out/8] (zero 8, stored 7: GPTQ v1), ``scales`` F16 [in/128, out], ``g_idx`` I32
  [in]) on every layer Linear and ``fc``, like syvai/Qwen3.8-27B-DFlash2-W4A16.

Values are random but well-conditioned: quantized codes are drawn directly (uniform int4 in
[-7, 7], uniform E2M1 pairs) under constant scales that give the weight a standard
deviation of ``std``; float weights are normal with ``std``; norms are the 1-centred zeros
of Qwen3.5 (ones for the gated GDN norm); ``A_log`` = log U(0.01, 16) and ``dt_bias`` = 1 as
transformers initialises them. Quantization clamps activations (FP8 and NVFP4 static input
scales are generous), so every output is finite.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from core.errors import PrepareError

MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "profiles" / "model-configs"
GROUP = 128  # W4A16 and GPTQ group size
NVFP4_BLOCK = 16
E2M1_RMS = math.sqrt(sum(m * m for m in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # uniform codes
INT4_RMS = math.sqrt(sum(k * k for k in range(-7, 8)) / 16)  # codes -7..7, 0 twice (nibble 0 stored as 8)
FP8_MAX = 448.0
E2M1_MAX = 6.0
ACTIVATION_AMAX = 64.0  # static input scales assume activations within +-64: generous for unit-RMS inputs
STD = 0.02  # Qwen3.5's initializer_range
DRAFTER_STD = 0.05  # the tiny drafters' scale; capped at 1/sqrt(fan_in) (unit gain at full size)

Format = Literal["bf16", "w4a16", "nvfp4", "gptq"]
Names = Literal["vl", "text"]  # model.language_model.* (hub checkpoints) or model.*
ConfigForm = Literal["vl", "text"]  # Qwen3_5ForConditionalGeneration or Qwen3_5ForCausalLM config


def _model_config(key: str) -> dict[str, Any]:
    return json.loads((MODEL_CONFIGS / key / "config.json").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class TargetShape:
    """The target's sizes (Qwen3.5/3.8 hybrid: 3 GDN layers then 1 attention layer, repeated)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    max_position_embeddings: int = 4096
    mtp_layers: int = 1

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.num_hidden_layers)]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


@dataclass(frozen=True)
class DrafterShape:
    """A DFlash2 drafter's sizes (its hidden size is the target's)."""

    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    sliding_window: int
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 16
    selector_top_k: int = 4
    block_size: int = 8


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's sizes (vLLM's `Qwen3_VisionTransformer`: a Conv3d patch embedding,
    learned position embeddings, ``depth`` pre-LayerNorm ViT blocks, and a merger that folds
    each ``spatial_merge_size``^2 patches into one token of ``out_hidden_size``, the text hidden)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int  # a square: vLLM interpolates a sqrt x sqrt grid
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size**2


# The tiny processor's pixel budget: at most 256 x 256 pixels an image (256 patches of 16 x 16,
# 64 tokens after the 2 x 2 merge), at least 32 x 32 (one token), so that vLLM's profiling run
# (a largest dummy image) stays cheap on a CPU.
TINY_MIN_PIXELS = 32 * 32
TINY_MAX_PIXELS = 256 * 256


@dataclass(frozen=True)
class Preset:
    """A size of the generated models, and which of them ``qwen38 generate`` writes."""

    name: str
    description: str
    target: TargetShape
    drafter: DrafterShape | None
    names: Names = "vl"
    config_form: ConfigForm = "vl"
    shard_bytes: int = 2 << 30  # shards of about this size (the hub checkpoints use ~4-5 GB)
    tokenizer_vocab: int = 1000  # tokens the BPE learns; the rest of the vocabulary is filler
    tokenizer_corpus: tuple[str, ...] | None = None  # None: prepare.tokenizer's seeded corpus
    embed_std: float = STD
    variants: tuple[str, ...] = ()  # what `qwen38 generate --size NAME` writes by default
    shard_names: tuple[str, ...] | None = None  # fixed shard files (tests rely on which holds what)
    # The tiny target's wide greedy margins (see `TINY`): lm_head maps each ordinary token to a
    # fixed successor, and the residual-writing projections are this many times stronger.
    successor_head: bool = False
    residual_gain: float = 1.0
    # A vision tower (``model.visual.*``) and its processor configs; only with the "vl" config
    # form and names (`Qwen3_5ForConditionalGeneration`).
    vision: VisionShape | None = None
    # The image processor's pixel budget (preprocessor_config.json's ``size``), with a tower.
    min_pixels: int = TINY_MIN_PIXELS
    max_pixels: int = TINY_MAX_PIXELS

    def with_layers(self, layers: int) -> Preset:
        """The same shapes with ``layers`` target layers (a slice, for measuring throughput)."""
        if layers < 4 or layers % 4:
            raise PrepareError(f"--layers {layers}: expected a positive multiple of 4 (3 GDN + 1 attention)")
        drafter = self.drafter
        if drafter is not None:
            ids = tuple(sorted({min(i, layers - 1) for i in drafter.target_layer_ids}))
            drafter = replace(drafter, target_layer_ids=ids)
        return replace(self, name=f"{self.name}-{layers}l", target=replace(self.target, num_hidden_layers=layers),
                       drafter=drafter)


# tiny-vl's tokenizer corpus (the draft-vocab tests count its tokens: a held-out text must
# need merges the corpus never used).
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model of the Qwen3.8 family answers with random words.",
    "Speculative decoding drafts tokens that the target model verifies.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "int8 embeddings free memory for a longer context on a 24 GB card.",
)

# The artifact keys of profiles/artifacts.lock.toml name the generated directories, so a
# profile's slots (``artifacts/<key>``) point at them unchanged.
VARIANTS: dict[str, tuple[str, Format]] = {
    "qwen3.8-27b-w4a16": ("target", "w4a16"),
    "qwen3.8-27b-nvfp4": ("target", "nvfp4"),
    "qwen3.8-27b-bf16": ("target", "bf16"),
    "qwen3.8-27b-dflash2-w4a16": ("drafter", "gptq"),
    "qwen3.8-27b-dflash2": ("drafter", "bf16"),
}
REAL_VARIANTS = ("qwen3.8-27b-w4a16", "qwen3.8-27b-dflash2-w4a16", "qwen3.8-27b-nvfp4", "qwen3.8-27b-dflash2")

def target_shape_from_config(text_config: dict[str, Any]) -> TargetShape:
    """The target's sizes as a checkpoint's ``text_config`` states them."""
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings")
    shape = TargetShape(**{k: text_config[k] for k in fields}, mtp_layers=text_config.get("mtp_num_hidden_layers", 0))
    if shape.layer_types != text_config["layer_types"]:
        raise PrepareError("text_config.layer_types: expected (3 x linear_attention, full_attention) repeated")
    return shape


def drafter_shape_from_config(config: dict[str, Any]) -> DrafterShape:
    """A DFlash2 drafter's sizes as its config.json states them."""
    dflash = config["dflash_config"]
    return DrafterShape(
        num_hidden_layers=config["num_hidden_layers"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], target_layer_ids=tuple(dflash["target_layer_ids"]),
        sliding_window=config["sliding_window"], conv_kernel_size=dflash["conv_kernel_size"],
        conv_group_size=dflash["conv_group_size"], selector_rank=dflash["selector_rank"],
        selector_top_k=dflash["selector_top_k"], block_size=dflash["block_size"],
    )


def vision_shape_from_config(vision_config: dict[str, Any]) -> VisionShape:
    """The vision tower's sizes as a checkpoint's ``vision_config`` states them."""
    fields = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "num_position_embeddings",
              "patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels")
    if vision_config.get("deepstack_visual_indexes"):
        raise PrepareError("vision_config.deepstack_visual_indexes: the generator writes no deepstack mergers")
    return VisionShape(**{k: vision_config[k] for k in fields})


# The full size is read from the real checkpoints' configs (profiles/model-configs/): one source
# for the shapes the generator writes, the roofline counts and the planner plans.
FULL_TARGET = target_shape_from_config(_model_config("qwen3.8-27b-w4a16")["text_config"])
FULL_DRAFTER = drafter_shape_from_config(_model_config("qwen3.8-27b-dflash2"))
# The real tower (27 blocks, hidden 1152): what the planner counts with VISION=true, and what the
# full preset's targets carry (the hub checkpoints carry it too, 921,460,192 bytes in bf16).
FULL_VISION = vision_shape_from_config(_model_config("qwen3.8-27b-w4a16")["vision_config"])
# The full targets' image processor budget: at most the stack's own cap (core.settings
# DEFAULT_MAX_PIXELS, which `qwen38 serve` hands the processor with VISION=true anyway), at least
# 32 x 32. The real checkpoint's preprocessor_config.json is not in profiles/model-configs.
FULL_MIN_PIXELS = 32 * 32
FULL_MAX_PIXELS = 2_097_152

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "full", "Qwen3.8-27B's own shapes (profiles/model-configs): the lent GPU's artifacts",
            FULL_TARGET, FULL_DRAFTER, variants=REAL_VARIANTS,
            # The real tower under model.visual.* in both targets (bf16 in every format), the vision
            # tokens in the tokenizer, and the processor configs: a VL checkpoint, served text-only
            # (`language_model_only`) unless VISION=true, as the hub checkpoints are.
            vision=FULL_VISION, min_pixels=FULL_MIN_PIXELS, max_pixels=FULL_MAX_PIXELS,
        ),
        Preset(
            "small", "the real formats at CPU-servable sizes (hidden 512, 8 layers, vocab 2048)",
            TargetShape(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, vocab_size=2048,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        linear_num_key_heads=2, linear_num_value_heads=4),
            DrafterShape(num_hidden_layers=2, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, target_layer_ids=(1, 3, 5), sliding_window=64),
            shard_bytes=4 << 20, variants=REAL_VARIANTS,
        ),
        # The requantize / draft-vocab / prepare-profile tests' target (was tests/tiny_qwen35.py):
        # text config, hub tensor names, three shards with embed+layers 0-1 / layers 2-3 / lm_head+MTP.
        Preset(
            "tiny-vl", "tiny text-config target under the hub checkpoint's tensor names, in 3 shards",
            TargetShape(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=512,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        linear_num_key_heads=2, linear_num_value_heads=4),
            None, config_form="text", tokenizer_vocab=400, tokenizer_corpus=SENTENCES * 20,
            variants=("qwen3.8-27b-bf16", "qwen3.8-27b-w4a16"),
            shard_names=("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                         "model-00003-of-00003.safetensors"),
        ),
        # The embed-int8 patch and planner tests' hybrid (was tests/support/tiny_hybrid.py):
        # model.* names, one file, a spread-out embedding so int8 rounding is exercised.
        Preset(
            "tiny-hybrid", "tiny Qwen3_5ForCausalLM hybrid (model.* names, one file), 1024-token vocabulary",
            TargetShape(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=1024,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        linear_num_key_heads=2, linear_num_value_heads=2, max_position_embeddings=2048),
            None, names="text", config_form="text", embed_std=0.5, variants=("qwen3.8-27b-bf16",),
            shard_names=("model.safetensors",),
        ),
    )
}
# The cpu profile's set (`prepare.generate.build_tiny_models`: target, DFlash and DFlash2
# drafters, directions, adapter). A random model at the default init has near-tied logits, so
# two kernels that round differently (a speculative verify pass and a plain decode step, say)
# soon pick different tokens: here the residual stream carries a unit-scale token embedding
# and lm_head points each ordinary token at a fixed successor (special tokens and padding
# rows never win, so generation runs to max_tokens), which gives every greedy choice a wide
# margin; the residual-writing projections are 60 times stronger, so that the layers still
# shift the logits and a rank-1 adapter on them changes the output.
TINY_PRESET = "tiny"
TINY = Preset(
    TINY_PRESET, "the cpu profile's tiny hybrid and its drafters (model.* names, one file, 1,024-token vocabulary)",
    TargetShape(hidden_size=128, intermediate_size=256, num_hidden_layers=4, vocab_size=1024,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # >= 32: the CPU engine needs it
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=32768),
    DrafterShape(num_hidden_layers=2, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, target_layer_ids=(1, 2), sliding_window=64),
    names="text", config_form="text", embed_std=1.0, successor_head=True, residual_gain=60.0,
    variants=("qwen3.8-27b-bf16",), shard_names=("model.safetensors",),
)
PRESETS = {TINY_PRESET: TINY, **PRESETS}
# The tiny target with a tiny vision tower (docs/vision.md): TINY's text model under the hub
# checkpoint's names and `Qwen3_5ForConditionalGeneration` config, plus a 2-block ViT of the
# real structure (patch 16, temporal patch 2, merge 2, no deepstack) whose merger writes
# TINY's hidden size. Its tokenizer carries the vision tokens and its chat template places
# ``<|vision_start|><|image_pad|><|vision_end|>`` for an image part.
TINY_VISION_PRESET = "tiny-vision"
TINY_VISION = replace(
    TINY, name=TINY_VISION_PRESET, drafter=None, names="vl", config_form="vl",
    description="the cpu profile's tiny target with a tiny vision tower (2 ViT blocks, hidden 64), one file",
    vision=VisionShape(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                       out_hidden_size=TINY.target.hidden_size, num_position_embeddings=256),
)
PRESETS[TINY_VISION_PRESET] = TINY_VISION
PRESET_NAMES = tuple(PRESETS)
# The generated tokenizer's special tokens take ids 0-9 (prepare.tokenizer.SPECIAL_TOKENS).
SPECIAL_IDS = 10
RESIDUAL_WRITERS = ("linear_attn.out_proj", "self_attn.o_proj", "mlp.down_proj")


def preset(name: str, layers: int | None = None) -> Preset:
    try:
        found = PRESETS[name]
    except KeyError:
        raise PrepareError(f"--size {name}: unknown preset; expected one of {', '.join(PRESET_NAMES)}") from None
    return found.with_layers(layers) if layers is not None else found


# ---------------------------------------------------------------------------------------
# Recipes: how a tensor's bytes are drawn (pure data; prepare.generate executes them)


@dataclass(frozen=True)
class Recipe:
    """``kind`` and its parameters:

    - ``normal`` (std): float rows, normal(0, std);
    - ``const`` (value): every element ``value`` (norms, scales, GPTQ zeros);
    - ``log_uniform`` (low, high): log U(low, high) (GDN ``A_log``);
    - ``int4_ct``: packed int32 words along dim 1 of uniform codes in [-7, 7];
    - ``int4_gptq``: the same words, packed along dim 0 (GPTQ ``qweight``);
    - ``e2m1``: packed uniform E2M1 pairs (NVFP4 ``weight``);
    - ``fp8_normal`` (std, scale): normal(0, std) / scale in FP8 E4M3;
    - ``group_index`` (group): element i is i // group (GPTQ ``g_idx``);
    - ``shape_of`` (rows, cols): the int64 pair of a compressed-tensors ``weight_shape``;
    - ``dflash2_base_kernel``: the conv taps' identity start (tap 0 ones, the rest zeros);
    - ``successor_rows`` (source, std, ids_from, ids_to): a successor table over the tokens
      [ids_from, ids_to): row successor(i) is the unit direction of row i of ``source`` (a
      ``normal`` tensor of ``std``), every other row zero; the successors are a permutation
      seeded by ``seed_name``.
    """

    kind: str
    std: float = 0.0
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    scale: float = 0.0
    rows: int = 0
    cols: int = 0
    group: int = 0
    seed_name: str = ""  # the name the draw is seeded with, when not the tensor's own
    source: str = ""
    ids_from: int = 0
    ids_to: int = 0


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    recipe: Recipe

    @property
    def nbytes(self) -> int:
        size = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}[self.dtype]
        return math.prod(self.shape) * size


def _float(name: str, shape: tuple[int, ...], std: float, dtype: str = "BF16") -> StoredTensor:
    return StoredTensor(name, dtype, shape, Recipe("normal", std=std))


def _const(name: str, shape: tuple[int, ...], value: float, dtype: str = "BF16") -> StoredTensor:
    return StoredTensor(name, dtype, shape, Recipe("const", value=value))


def linear_tensors(module: str, out_f: int, in_f: int, fmt: Format, std: float) -> list[StoredTensor]:
    """The tensors that store one Linear [out_f, in_f] in ``fmt``, weights of standard deviation ``std``."""
    if fmt == "bf16":
        return [_float(f"{module}.weight", (out_f, in_f), std)]
    if fmt == "w4a16":
        _divisible(module, in_f, GROUP)
        return [
            StoredTensor(f"{module}.weight_packed", "I32", (out_f, in_f // 8), Recipe("int4_ct")),
            _const(f"{module}.weight_scale", (out_f, in_f // GROUP), std / INT4_RMS),
            StoredTensor(f"{module}.weight_shape", "I64", (2,), Recipe("shape_of", rows=out_f, cols=in_f)),
        ]
    if fmt == "gptq":
        _divisible(module, in_f, GROUP)
        _divisible(module, out_f, 8)
        return [
            StoredTensor(f"{module}.qweight", "I32", (in_f // 8, out_f), Recipe("int4_gptq")),
            _const(f"{module}.qzeros", (in_f // GROUP, out_f // 8), float(0x77777777), "I32"),
            _const(f"{module}.scales", (in_f // GROUP, out_f), std / INT4_RMS, "F16"),
            StoredTensor(f"{module}.g_idx", "I32", (in_f,), Recipe("group_index", group=GROUP)),
        ]
    raise ValueError(f"linear_tensors: {fmt!r} is chosen per module (see nvfp4_linear / fp8_linear)")


def nvfp4_linear(module: str, out_f: int, in_f: int, std: float) -> list[StoredTensor]:
    _divisible(module, in_f, NVFP4_BLOCK)
    return [
        StoredTensor(f"{module}.weight", "U8", (out_f, in_f // 2), Recipe("e2m1")),
        _const(f"{module}.weight_scale", (out_f, in_f // NVFP4_BLOCK), 1.0, "F8_E4M3"),
        _const(f"{module}.weight_scale_2", (), std / E2M1_RMS, "F32"),
        _const(f"{module}.input_scale", (), ACTIVATION_AMAX / (E2M1_MAX * FP8_MAX), "F32"),
    ]


def fp8_linear(module: str, out_f: int, in_f: int, std: float) -> list[StoredTensor]:
    scale = 6 * std / FP8_MAX  # +-6 std fill the E4M3 range
    return [
        StoredTensor(f"{module}.weight", "F8_E4M3", (out_f, in_f), Recipe("fp8_normal", std=std, scale=scale)),
        _const(f"{module}.weight_scale", (), scale, "F32"),
        _const(f"{module}.input_scale", (), ACTIVATION_AMAX / FP8_MAX, "F32"),
    ]


def _divisible(module: str, size: int, by: int) -> None:
    if size % by:
        raise PrepareError(f"{module}: input size {size} is not a multiple of {by}; choose other preset sizes")


# ---------------------------------------------------------------------------------------
# The target


def decoder_prefix(names: Names) -> str:
    return "model.language_model." if names == "vl" else "model."


NVFP4_KINDS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
W4A16_IGNORED = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")


def _target_linears(shape: TargetShape, layer: str, kind: str) -> list[tuple[str, int, int]]:
    """(module, out, in) of one decoder layer's Linears (``kind``: linear_attention / full_attention)."""
    h = shape.hidden_size
    out: list[tuple[str, int, int]] = []
    if kind == "linear_attention":
        v = shape.linear_value_dim
        out += [
            (f"{layer}.linear_attn.in_proj_qkv", shape.conv_dim, h),
            (f"{layer}.linear_attn.in_proj_z", v, h),
            (f"{layer}.linear_attn.in_proj_b", shape.linear_num_value_heads, h),
            (f"{layer}.linear_attn.in_proj_a", shape.linear_num_value_heads, h),
            (f"{layer}.linear_attn.out_proj", h, v),
        ]
    else:
        q = shape.num_attention_heads * shape.head_dim
        kv = shape.num_key_value_heads * shape.head_dim
        out += [
            (f"{layer}.self_attn.q_proj", 2 * q, h),  # attn_output_gate: query and gate
            (f"{layer}.self_attn.k_proj", kv, h),
            (f"{layer}.self_attn.v_proj", kv, h),
            (f"{layer}.self_attn.o_proj", h, q),
        ]
    i = shape.intermediate_size
    out += [(f"{layer}.mlp.gate_proj", i, h), (f"{layer}.mlp.up_proj", i, h), (f"{layer}.mlp.down_proj", h, i)]
    return out


def _layer_small_tensors(shape: TargetShape, layer: str, kind: str) -> list[StoredTensor]:
    h = shape.hidden_size
    out = [_const(f"{layer}.input_layernorm.weight", (h,), 0.0), _const(f"{layer}.post_attention_layernorm.weight", (h,), 0.0)]
    if kind == "linear_attention":
        heads = shape.linear_num_value_heads
        out += [
            _float(f"{layer}.linear_attn.conv1d.weight", (shape.conv_dim, 1, shape.linear_conv_kernel_dim), STD),
            _const(f"{layer}.linear_attn.dt_bias", (heads,), 1.0),
            StoredTensor(f"{layer}.linear_attn.A_log", "BF16", (heads,), Recipe("log_uniform", low=0.01, high=16.0)),
            _const(f"{layer}.linear_attn.norm.weight", (shape.linear_value_head_dim,), 1.0),  # gated RMSNorm: ones
        ]
    else:
        out += [
            _const(f"{layer}.self_attn.q_norm.weight", (shape.head_dim,), 0.0),
            _const(f"{layer}.self_attn.k_norm.weight", (shape.head_dim,), 0.0),
        ]
    return out


def _module_format(fmt: Format, module: str) -> str:
    """The stored format of one decoder Linear in a target of format ``fmt``."""
    if fmt == "bf16":
        return "bf16"
    if fmt == "w4a16":
        return "bf16" if module.endswith(W4A16_IGNORED) else "w4a16"
    if fmt == "nvfp4":
        if module.endswith(NVFP4_KINDS):
            return "nvfp4"
        return "bf16" if module.endswith(W4A16_IGNORED) else "fp8"
    raise PrepareError(f"a target is stored as bf16, w4a16 or nvfp4, not {fmt}")


def _linear(module: str, out_f: int, in_f: int, stored: str, std: float) -> list[StoredTensor]:
    if stored == "nvfp4":
        return nvfp4_linear(module, out_f, in_f, std)
    if stored == "fp8":
        return fp8_linear(module, out_f, in_f, std)
    return linear_tensors(module, out_f, in_f, stored, std)  # type: ignore[arg-type]


def target_tensors(p: Preset, fmt: Format) -> list[StoredTensor]:
    """Every tensor of the target in ``fmt``, in checkpoint order (embed, layers, norm, lm_head, MTP)."""
    shape, prefix = p.target, decoder_prefix(p.names)
    h, v = shape.hidden_size, shape.vocab_size
    embed = f"{prefix}embed_tokens.weight"
    out = [_float(embed, (v, h), p.embed_std)]
    for index, kind in enumerate(shape.layer_types):
        layer = f"{prefix}layers.{index}"
        for module, out_f, in_f in _target_linears(shape, layer, kind):
            gain = p.residual_gain if module.endswith(RESIDUAL_WRITERS) else 1.0
            out += _linear(module, out_f, in_f, _module_format(fmt, module), STD * gain)
        out += _layer_small_tensors(shape, layer, kind)
    out.append(_const(f"{prefix}norm.weight", (h,), 0.0))
    if p.successor_head:
        out.append(StoredTensor("lm_head.weight", "BF16", (v, h), Recipe(
            "successor_rows", std=p.embed_std, seed_name="successor", source=embed, ids_from=SPECIAL_IDS,
            ids_to=p.tokenizer_vocab)))
    else:
        out.append(_float("lm_head.weight", (v, h), STD))
    # The MTP head (bf16 in every format: the W4A16 ignore list and the NVFP4 exclusions name it).
    for index in range(shape.mtp_layers):
        layer = f"mtp.layers.{index}"
        for module, out_f, in_f in _target_linears(shape, layer, "full_attention"):
            out += linear_tensors(module, out_f, in_f, "bf16", STD)
        out += _layer_small_tensors(shape, layer, "full_attention")
    if shape.mtp_layers:
        out.append(_float("mtp.fc.weight", (h, 2 * h), STD))
        out += [_const(f"mtp.{n}.weight", (h,), 0.0) for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")]
    if p.vision is not None:
        if p.names != "vl" or p.config_form != "vl":
            raise PrepareError(f"preset {p.name}: a vision tower needs the hub checkpoint's names and vl config")
        out += vision_tensors(p.vision)
    return out


VISUAL_PREFIX = "model.visual."


def vision_tensors(v: VisionShape) -> list[StoredTensor]:
    """The tower's tensors under the hub checkpoint's names (bf16 in every format: the W4A16
    ignore list and the NVFP4 exclusions name ``visual``). LayerNorms are ones and zeros,
    biases zero, weights normal(0, 0.02) as the real config's initializer_range."""
    h, merged, p = v.hidden_size, v.merged_size, VISUAL_PREFIX
    out = [
        _float(f"{p}patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size), STD),
        _const(f"{p}patch_embed.proj.bias", (h,), 0.0),
        _float(f"{p}pos_embed.weight", (v.num_position_embeddings, h), STD),
    ]

    def layer_norm(module: str, size: int) -> list[StoredTensor]:
        return [_const(f"{module}.weight", (size,), 1.0), _const(f"{module}.bias", (size,), 0.0)]

    def biased(module: str, out_f: int, in_f: int) -> list[StoredTensor]:
        return [_float(f"{module}.weight", (out_f, in_f), STD), _const(f"{module}.bias", (out_f,), 0.0)]

    for index in range(v.depth):
        block = f"{p}blocks.{index}"
        out += layer_norm(f"{block}.norm1", h) + layer_norm(f"{block}.norm2", h)
        out += biased(f"{block}.attn.qkv", 3 * h, h) + biased(f"{block}.attn.proj", h, h)
        out += biased(f"{block}.mlp.linear_fc1", v.intermediate_size, h)
        out += biased(f"{block}.mlp.linear_fc2", h, v.intermediate_size)
    out += layer_norm(f"{p}merger.norm", h)
    out += biased(f"{p}merger.linear_fc1", merged, merged) + biased(f"{p}merger.linear_fc2", v.out_hidden_size, merged)
    return out


def nvfp4_layer_table(p: Preset) -> dict[str, dict[str, Any]]:
    """ModelOpt's ``quantized_layers``: every NVFP4 / FP8 module of the nvfp4 target."""
    shape, prefix = p.target, decoder_prefix(p.names)
    table: dict[str, dict[str, Any]] = {}
    for index, kind in enumerate(shape.layer_types):
        for module, _, _ in _target_linears(shape, f"{prefix}layers.{index}", kind):
            stored = _module_format("nvfp4", module)
            if stored == "nvfp4":
                table[module] = {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}
            elif stored == "fp8":
                table[module] = {"quant_algo": "FP8"}
    return table


# ---------------------------------------------------------------------------------------
# The DFlash2 drafter


def drafter_std(fan_in: int) -> float:
    return min(DRAFTER_STD, 1 / math.sqrt(fan_in))


def drafter_linears(p: Preset) -> list[tuple[str, int, int]]:
    """(module, out, in) of the drafter's Linears (GPTQ quantizes exactly these)."""
    d, h = p.drafter, p.target.hidden_size
    assert d is not None
    q, kv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    out: list[tuple[str, int, int]] = []
    for layer in range(d.num_hidden_layers):
        base = f"layers.{layer}"
        out += [
            (f"{base}.self_attn.q_proj", q, h), (f"{base}.self_attn.k_proj", kv, h), (f"{base}.self_attn.v_proj", kv, h),
            (f"{base}.self_attn.o_proj", h, q), (f"{base}.mlp.gate_proj", d.intermediate_size, h),
            (f"{base}.mlp.up_proj", d.intermediate_size, h), (f"{base}.mlp.down_proj", h, d.intermediate_size),
        ]
    out.append(("fc", h, h * len(d.target_layer_ids)))
    return out


def drafter_tensors(p: Preset, fmt: Format, *, dflash: int = 2) -> list[StoredTensor]:
    """A `DFlash2DraftModel`'s tensors (``dflash=1``: a `DFlashDraftModel`'s, without conv taps
    and candidate selector); no embed_tokens / lm_head: a drafter shares the target's."""
    d, h, v = p.drafter, p.target.hidden_size, p.target.vocab_size
    if d is None:
        raise PrepareError(f"preset {p.name} has no drafter")
    if fmt not in ("bf16", "gptq"):
        raise PrepareError(f"the drafter is stored as bf16 or gptq, not {fmt}")
    out: list[StoredTensor] = []
    for module, out_f, in_f in drafter_linears(p):
        stored = linear_tensors(module, out_f, in_f, fmt, drafter_std(in_f))
        if module == "fc" and fmt == "bf16":  # the tiny drafters seed it by its module name
            stored = [replace(stored[0], recipe=replace(stored[0].recipe, seed_name="fc"))]
        out += stored
    groups = h // d.conv_group_size
    for layer in range(d.num_hidden_layers):
        base = f"layers.{layer}"
        for norm, size in (("self_attn.q_norm", d.head_dim), ("self_attn.k_norm", d.head_dim),
                           ("input_layernorm", h), ("post_attention_layernorm", h)):
            out.append(_const(f"{base}.{norm}.weight", (size,), 1.0))
        for conv in ("attention_conv", "mlp_conv") if dflash == 2 else ():
            out.append(StoredTensor(f"{base}.{conv}.base_kernel", "BF16", (2, d.conv_kernel_size, h),
                                    Recipe("dflash2_base_kernel")))
            projection = _float(f"{base}.{conv}.kernel_projection.weight", (2 * d.conv_kernel_size * groups, h),
                                min(0.02, 1 / math.sqrt(h)))
            out.append(replace(projection, recipe=replace(projection.recipe, seed_name=f"{base}.{conv}")))
    out += [_const("hidden_norm.weight", (h,), 1.0), _const("norm.weight", (h,), 1.0)]
    if dflash == 1:
        return out
    rank = d.selector_rank
    out += [
        _float("candidate_selector.predecessor_codebook", (v, rank), drafter_std(rank)),
        _float("candidate_selector.successor_codebook", (v, rank), drafter_std(rank)),
        _float("candidate_selector.hidden_projection.weight", (rank, h), drafter_std(h)),
    ]
    return out


# ---------------------------------------------------------------------------------------
# Configs


def _text_fields(shape: TargetShape, special: dict[str, int]) -> dict[str, Any]:
    return {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "layer_types": shape.layer_types,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "linear_conv_kernel_dim": shape.linear_conv_kernel_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "mtp_num_hidden_layers": shape.mtp_layers,
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
    }


def w4a16_quantization_config() -> dict[str, Any]:
    """The hub W4A16 checkpoint's block (profiles/model-configs); its ignore list is regexes
    and ``lm_head``, so it holds under either tensor naming."""
    return _model_config("qwen3.8-27b-w4a16")["quantization_config"]


def nvfp4_quantization_config(p: Preset) -> dict[str, Any]:
    base = _model_config("qwen3.8-27b-nvfp4")["quantization_config"]
    return {
        **base,
        "exclude_modules": ["lm_head", "re:.*mtp.*", "re:.*visual.*"],
        "quantized_layers": nvfp4_layer_table(p),
        "producer": {"name": "modelopt", "version": "qwen38-generate"},
    }


def mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """The real (t, h, w) split [11, 11, 10] of the rotary half-dimension, scaled to this head_dim
    (vLLM asserts the sections sum to rotary_dim / 2)."""
    half = int(head_dim * partial_rotary_factor) // 2
    first = half * 11 // 32
    return [first, first, half - 2 * first]


def target_config(p: Preset, fmt: Format, special: dict[str, int]) -> dict[str, Any]:
    """config.json: the real model's (profiles/model-configs) with this preset's shapes."""
    real = _model_config("qwen3.8-27b-nvfp4" if fmt == "nvfp4" else "qwen3.8-27b-w4a16")
    quant = {"w4a16": w4a16_quantization_config, "nvfp4": lambda: nvfp4_quantization_config(p)}
    text = {**real["text_config"], **_text_fields(p.target, special)}
    rope = dict(text["rope_parameters"])
    rope["mrope_section"] = mrope_section(p.target.head_dim, rope["partial_rotary_factor"])
    text["rope_parameters"] = rope
    if p.config_form == "vl":
        config = {k: v for k, v in real.items() if k != "quantization_config"}
        config["text_config"] = text
        if p.vision is not None:
            config["vision_config"] = {**real["vision_config"], **vision_fields(p.vision)}
            config.update({key: special[name] for name, key in VISION_TOKEN_KEYS.items()})
    else:
        config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
        config.update({k: v for k, v in text.items() if k != "model_type"})
        config["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items()
                                     if k not in ("mrope_interleaved", "mrope_section")}
    if fmt in quant:
        config["quantization_config"] = quant[fmt]()
    return config


# The vision tokens (prepare.tokenizer.VISION_TOKENS) as config.json names their ids.
VISION_TOKEN_KEYS = {"vision_start": "vision_start_token_id", "vision_end": "vision_end_token_id",
                     "image_pad": "image_token_id", "video_pad": "video_token_id"}


def vision_fields(v: VisionShape) -> dict[str, Any]:
    return {"depth": v.depth, "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads, "out_hidden_size": v.out_hidden_size,
            "num_position_embeddings": v.num_position_embeddings, "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.spatial_merge_size,
            "in_channels": v.in_channels, "deepstack_visual_indexes": []}


def processor_configs(v: VisionShape, *, min_pixels: int = TINY_MIN_PIXELS,
                      max_pixels: int = TINY_MAX_PIXELS) -> dict[str, dict[str, Any]]:
    """preprocessor_config.json and video_preprocessor_config.json: transformers'
    `Qwen3VLProcessor` (an image processor and a video processor of the tower's patch sizes,
    mean and std 0.5 as the Qwen3-VL family's), under a pixel budget (the tiny one by default;
    the full preset's is `FULL_MAX_PIXELS`)."""
    common = {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size, "merge_size": v.spatial_merge_size,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "processor_class": "Qwen3VLProcessor",
    }
    return {
        "preprocessor_config.json": {**common, "image_processor_type": "Qwen2VLImageProcessorFast"},
        "video_preprocessor_config.json": {**common, "video_processor_type": "Qwen3VLVideoProcessor",
                                           "fps": 2, "min_frames": 4, "max_frames": 16, "do_sample_frames": True},
    }


def dflash1_config(p: Preset, special: dict[str, int]) -> dict[str, Any]:
    """A `DFlashDraftModel` (DFlash 1: the one the CPU build serves) over the preset's target."""
    d = p.drafter
    assert d is not None
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": p.target.vocab_size,
        "hidden_size": p.target.hidden_size, "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim, "hidden_act": "silu",
        "max_position_embeddings": p.target.max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "block_size": d.block_size, "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": special["mask"], "target_layer_ids": list(d.target_layer_ids)},
    }


def drafter_config(p: Preset, fmt: Format, special: dict[str, int]) -> dict[str, Any]:
    """A `DFlash2DraftModel`: the real drafter's config (profiles/model-configs) at the preset's sizes."""
    d = p.drafter
    assert d is not None
    config = _model_config("qwen3.8-27b-dflash2-w4a16" if fmt == "gptq" else "qwen3.8-27b-dflash2")
    config.update(
        {
            "hidden_size": p.target.hidden_size,
            "intermediate_size": d.intermediate_size,
            "num_hidden_layers": d.num_hidden_layers,
            "layer_types": ["sliding_attention"] * d.num_hidden_layers,
            "max_window_layers": d.num_hidden_layers,
            "sliding_window": d.sliding_window,
            "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_key_value_heads,
            "head_dim": d.head_dim,
            "num_target_layers": p.target.num_hidden_layers,
            "vocab_size": p.target.vocab_size,
            "max_position_embeddings": p.target.max_position_embeddings,
        }
    )
    config["dflash_config"] = {
        **config["dflash_config"],
        "block_size": d.block_size,
        "mask_token_id": special["mask"],
        "target_layer_ids": list(d.target_layer_ids),
        "conv_kernel_size": d.conv_kernel_size,
        "conv_group_size": d.conv_group_size,
        "selector_rank": d.selector_rank,
        "selector_top_k": d.selector_top_k,
    }
    return config


# ---------------------------------------------------------------------------------------
# Shards


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go into which shard file (sizes about ``Preset.shard_bytes``); written,
    index included, by `prepare.checkpoint_writer`."""

    shards: dict[str, list[StoredTensor]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for tensors in self.shards.values() for t in tensors)


def _module_of(name: str) -> str:
    """Tensors of one module stay in one shard (``weight_packed`` beside its ``weight_scale``)."""
    return name.rsplit(".", 1)[0]


def plan_shards(p: Preset, tensors: list[StoredTensor], *, fixed: bool = True) -> ShardPlan:
    """Checkpoint order, cut into ~``shard_bytes`` shards at module boundaries.

    The tiny test presets name their shards (``shard_names``): three as the old test builder
    wrote them (embed + layers 0-1, layers 2-3 + norm, lm_head + MTP) or one file.
    """
    if fixed and p.shard_names is not None:
        if len(p.shard_names) == 1:
            return ShardPlan({p.shard_names[0]: list(tensors)})
        first, middle, last = p.shard_names
        out: dict[str, list[StoredTensor]] = {first: [], middle: [], last: []}
        for t in tensors:
            if t.name.startswith(("lm_head", "mtp.")):
                out[last].append(t)
            elif "embed_tokens" in t.name or ".layers.0." in t.name or ".layers.1." in t.name:
                out[first].append(t)
            else:
                out[middle].append(t)
        return ShardPlan(out)
    groups: list[list[StoredTensor]] = []
    for t in tensors:
        if groups and _module_of(groups[-1][-1].name) == _module_of(t.name):
            groups[-1].append(t)
        else:
            groups.append([t])
    cut: list[list[StoredTensor]] = [[]]
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for t in group)
        if cut[-1] and size + group_bytes > p.shard_bytes:
            cut.append([])
            size = 0
        cut[-1].extend(group)
        size += group_bytes
    count = len(cut)
    return ShardPlan({f"model-{i + 1:05d}-of-{count:05d}.safetensors": shard for i, shard in enumerate(cut)})


def variant_tensors(p: Preset, variant: str) -> list[StoredTensor]:
    role, fmt = variant_role(variant)
    return target_tensors(p, fmt) if role == "target" else drafter_tensors(p, fmt)


def variant_role(variant: str) -> tuple[str, Format]:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise PrepareError(f"--only {variant}: unknown model; expected one of {', '.join(VARIANTS)}") from None


def stored_bytes(tensors: list[StoredTensor]) -> dict[str, int]:
    """Bytes by storage class: packed 4-bit (+ scales), FP8 (+ scales), BF16/other."""
    out = {"int4": 0, "nvfp4": 0, "fp8": 0, "bf16": 0, "other": 0}
    modules_by_kind: dict[str, str] = {}
    for t in tensors:
        if t.recipe.kind in ("int4_ct", "int4_gptq"):
            modules_by_kind[_module_of(t.name)] = "int4"
        elif t.recipe.kind == "e2m1":
            modules_by_kind[_module_of(t.name)] = "nvfp4"
        elif t.recipe.kind == "fp8_normal":
            modules_by_kind[_module_of(t.name)] = "fp8"
    for t in tensors:
        kind = modules_by_kind.get(_module_of(t.name))
        out[kind or ("bf16" if t.dtype == "BF16" else "other")] += t.nbytes
    return out


def iter_blocks(t: StoredTensor, block_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges [start, end) of ``t`` of about ``block_bytes`` each (one range for small tensors)."""
    rows = t.shape[0] if t.shape else 1
    row_bytes = max(1, t.nbytes // max(rows, 1))
    step = max(1, block_bytes // row_bytes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)
