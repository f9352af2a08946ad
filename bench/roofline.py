"""`qwen38 bench roofline`: the bytes a decode step must read, against memory bandwidth.

Decode is memory-bound: every step streams the target's weights once, each sequence's KV
cache and recurrent (GDN) state, and - with speculation - the drafter. A step can go no
faster than bytes / bandwidth, so bandwidth / bytes is a ceiling on steps per second, and
with an acceptance length tau (tokens a step yields) a ceiling on tok/s. Every figure this
prints is such a projection (100 % of the bandwidth, no compute time, no launch overhead),
never a measurement; docs/performance.md sets them beside the articles' measured figures.

Byte counts come from the real shapes: `prepare.synthetic`'s full preset, whose shapes a
unit test holds equal to profiles/model-configs/, and its stored formats (W4A16 and its
int8 lm_head after `prepare requantize`, GPTQ and bf16 drafters, NVFP4/FP8/BF16 target).
What one step reads (the method, docs/performance.md):

- target weights: every decoder layer, the final norm and lm_head; not embed_tokens (a
  gather of a few rows) nor the MTP head (unused with DFlash2);
- drafter (speculation only): its weights (the candidate selector's codebooks counted whole:
  an upper bound) and the target's lm_head once more (the drafter's logits use it);
- KV: each sequence's context through the 16 attention layers at the profile's KV dtype,
  read once (the split-KV verify kernel reads it once for all K+1 query tokens), plus the
  drafter's sliding-window KV;
- GDN state: each sequence's state read once and written once per step; with speculation
  written once per verified position (K+1), as vLLM keeps a state per draft position.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.checkpoint import text_config
from core.errors import BenchError
from core.profiles import K4V2_KV_CACHE_DTYPE, load_profile
from prepare.synthetic import MODEL_CONFIGS, PRESETS, VARIANTS, VISUAL_PREFIX, drafter_tensors, target_tensors

# Nominal bandwidths (vendor figures); the H200's measured figure comes from the GPU run.
BANDWIDTH = {"H200 (nominal)": 4.8e12, "RTX 3090": 936e9, "DGX Spark": 273e9}
MACHINES = {"rtx3090": "RTX 3090", "dgx-spark": "DGX Spark"}  # a profile's `machine` -> BANDWIDTH key
# DFlash2 K=7 probabilistic drafting on the Spark, clean base and adapter (REFERENCE.md §1).
ACCEPTANCE = {"clean base (Spark article)": 5.15, "adapter (Spark article)": 3.74}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# ---------------------------------------------------------------------------------------
# Bytes per token and per sequence, from a model config


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
    if kv_dtype == K4V2_KV_CACHE_DTYPE:  # 4-bit keys, 2-bit values, group scales: the format's own count
        # Deferred: the format's module imports torch and Triton, which no other profile needs here.
        from entrypoint.kv_capacity import k4v2_format

        return layers * text_config["num_key_value_heads"] * k4v2_format().TOKEN_HEAD_BYTES
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


def ssm_state_dtype_bytes(engine_dtype: str, text_config: dict[str, Any]) -> int:
    """The SSM state's element size: the profile's ``mamba_ssm_cache_dtype``, else the config's."""
    name = text_config.get("mamba_ssm_dtype", "bfloat16") if engine_dtype == "auto" else engine_dtype
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class Serving:
    """What one profile's decode step reads, by part (bytes), at context 0."""

    profile: str
    machine: str
    target_weights: int
    drafter_weights: int  # incl. the target's lm_head read again
    kv_per_token: int  # target attention KV, per sequence and context token
    drafter_kv_per_token: int
    drafter_window: int
    gdn_state: int  # per sequence
    k: int  # drafted tokens per step

    def step_bytes(self, context: int, batch: int, speculative: bool) -> int:
        per_seq = self.kv_per_token * context
        state_writes = (self.k + 1) if speculative else 1
        per_seq += self.gdn_state * (1 + state_writes)
        total = self.target_weights + batch * per_seq
        if speculative:
            total += self.drafter_weights + batch * self.drafter_kv_per_token * min(context, self.drafter_window)
        return total


def _sum(tensors, skip=()) -> int:
    return sum(t.nbytes for t in tensors if not t.name.startswith(skip) and "embed_tokens" not in t.name)


def int8_table_bytes(rows: int, cols: int) -> int:
    """An int8 table after `prepare requantize`: codes plus one fp16 scale per 128 columns."""
    return rows * cols + rows * (cols // 128) * 2


def model_config(artifact: str) -> dict[str, Any]:
    """A real checkpoint's config.json (profiles/model-configs/<artifact key>)."""

    path = MODEL_CONFIGS / artifact / "config.json"
    if not path.is_file():
        raise BenchError(f"{path}: missing; the roofline reads the real model's config from there")
    return json.loads(path.read_text(encoding="utf-8"))


def serving(profile) -> Serving:
    """The bytes one decode step of ``profile`` (an `core.profiles.Profile`) reads, from
    the real configs of its artifacts (profiles/model-configs/) and their stored formats (the
    tensor inventories of `prepare.synthetic`'s full preset, which is read from those configs)."""

    full = PRESETS["full"]
    target = profile.models.target
    if target.artifact not in VARIANTS:
        raise BenchError(f"profile {profile.name}: target artifact {target.artifact!r} is not one the roofline knows")
    text = text_config(model_config(target.artifact))
    _, fmt = VARIANTS[target.artifact]
    lm_head_bf16 = text["vocab_size"] * text["hidden_size"] * 2
    lm_head = int8_table_bytes(text["vocab_size"], text["hidden_size"]) if target.transform == "requantize-int8" \
        else lm_head_bf16
    # The tower (model.visual.*) is read per image, never per decode step.
    weights = _sum(target_tensors(full, fmt), skip=("mtp.", VISUAL_PREFIX)) - lm_head_bf16 + lm_head
    drafter_bytes = drafter_kv = window = k = 0
    spec = profile.speculative
    if profile.models.drafter is not None and spec is not None:
        drafter_cfg = model_config(profile.models.drafter.artifact)
        _, drafter_fmt = VARIANTS[profile.models.drafter.artifact]
        drafter_bytes = sum(t.nbytes for t in drafter_tensors(full, drafter_fmt)) + lm_head
        drafter_kv = (drafter_cfg["num_hidden_layers"] * drafter_cfg["num_key_value_heads"] * drafter_cfg["head_dim"]
                      * 2 * DTYPE_BYTES[drafter_cfg.get("dtype", "bfloat16")])
        window = drafter_cfg["sliding_window"]
        k = spec.num_speculative_tokens
    state = gdn_state_bytes_per_slot(text, ssm_state_dtype_bytes(profile.engine.mamba_ssm_cache_dtype, text))
    return Serving(profile.name, MACHINES.get(profile.machine, profile.machine), weights, drafter_bytes,
                   attention_kv_bytes_per_token(text, profile.engine.kv_cache_dtype), drafter_kv, window, state, k)


def servings(names=("single", "long", "huge", "spark-lora")) -> dict[str, Serving]:
    return {name: serving(load_profile(name)) for name in names}


def roofline_fraction(s: Serving, bandwidth: float, context: int, batch: int, speculative: bool,
                      measured_step_s: float) -> dict[str, float]:
    """How close a measured decode step came to the bandwidth limit: the step time the bytes
    need at ``bandwidth`` over the measured step time (1.0: at the limit)."""
    if bandwidth <= 0 or measured_step_s <= 0:
        raise BenchError("bandwidth and the measured step time must be positive")
    needed = s.step_bytes(context, batch, speculative)
    floor_s = needed / bandwidth
    return {"bytes_per_step": needed, "bandwidth_gb_s": bandwidth / 1e9, "floor_step_ms": floor_s * 1e3,
            "measured_step_ms": measured_step_s * 1e3, "fraction_of_limit": floor_s / measured_step_s}


def ceiling_tok_s(s: Serving, bandwidth: float, context: int, batch: int, tau: float | None) -> float:
    """Projected tok/s one stream sees at 100 % of ``bandwidth`` (tau None: no speculation)."""
    steps = bandwidth / s.step_bytes(context, batch, tau is not None)
    return steps * (tau if tau is not None else 1.0)


def table(contexts=(512, 10_000, 43_000, 100_000, 245_000), batches=(1, 8), measured: dict[str, float] | None = None
          ) -> list[dict[str, Any]]:
    """Every profile on its machine and on the H200 (nominal, and ``measured``: machine -> bytes/s),
    at each context its profile serves."""

    rows = []
    for name, s in servings().items():
        engine = load_profile(name).engine
        longest = engine.max_model_len
        machines = {s.machine: BANDWIDTH[s.machine], "H200 (nominal)": BANDWIDTH["H200 (nominal)"], **(measured or {})}
        for machine, bandwidth in machines.items():
            for batch in (b for b in batches if b <= engine.max_num_seqs):
                for context in (c for c in contexts if c <= longest):
                    row = {
                        "profile": name, "machine": machine, "bandwidth_gb_s": bandwidth / 1e9, "batch": batch,
                        "context": context, "step_gb_nospec": s.step_bytes(context, batch, False) / 1e9,
                        "step_gb_spec": s.step_bytes(context, batch, True) / 1e9,
                        "tok_s_nospec": ceiling_tok_s(s, bandwidth, context, batch, None),
                    }
                    for label, tau in ACCEPTANCE.items():
                        row[f"tok_s_spec_tau_{tau}"] = ceiling_tok_s(s, bandwidth, context, batch, tau)
                    rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], machine_filter=None) -> str:
    taus = list(ACCEPTANCE.values())
    head = ("| profile | machine | batch | context | GB/step (no spec / K=7) | projected tok/s per stream: "
            f"no spec | K=7, tau {taus[0]} | K=7, tau {taus[1]} |")
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if machine_filter and r["machine"] not in machine_filter:
            continue
        out.append(
            f"| {r['profile']} | {r['machine']} | {r['batch']} | {r['context']:,} | "
            f"{r['step_gb_nospec']:.2f} / {r['step_gb_spec']:.2f} | {r['tok_s_nospec']:.1f} | "
            f"{r[f'tok_s_spec_tau_{taus[0]}']:.1f} | {r[f'tok_s_spec_tau_{taus[1]}']:.1f} |"
        )
    return "\n".join(out) + "\n"

