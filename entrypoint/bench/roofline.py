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

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from entrypoint.bench.fullscale import attention_kv_bytes_per_token, gdn_state_bytes_per_slot

# Nominal bandwidths (vendor figures); the H200's measured figure comes from the GPU run.
BANDWIDTH = {"H200 (nominal)": 4.8e12, "RTX 3090": 936e9, "DGX Spark": 273e9}
H200_MEASURED = None  # bytes/s: fill from docs/gpu/*-fullscale.json when the GPU run has measured it
# DFlash2 K=7 probabilistic drafting on the Spark, clean base and adapter (REFERENCE.md §1).
ACCEPTANCE = {"clean base (Spark article)": 5.15, "adapter (Spark article)": 3.74}
MEASURED_ARTICLES = {  # tok/s one stream sees (REFERENCE.md §1)
    ("single", 1): 107.0,  # RTX 3090, short context
    ("spark-lora", 1): 45.17,  # Spark C1, clean base
}


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


def servings() -> dict[str, Serving]:
    from prepare.synthetic import PRESETS, drafter_tensors, target_tensors

    full = PRESETS["full"]
    t, d = full.target, full.drafter
    assert d is not None
    text = {
        "layer_types": t.layer_types, "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
        "linear_num_value_heads": t.linear_num_value_heads, "linear_key_head_dim": t.linear_key_head_dim,
        "linear_value_head_dim": t.linear_value_head_dim, "linear_num_key_heads": t.linear_num_key_heads,
        "linear_conv_kernel_dim": t.linear_conv_kernel_dim,
    }
    lm_head_bf16 = t.vocab_size * t.hidden_size * 2
    lm_head_int8 = int8_table_bytes(t.vocab_size, t.hidden_size)
    w4a16 = _sum(target_tensors(full, "w4a16"), skip=("mtp.",)) - lm_head_bf16 + lm_head_int8
    nvfp4 = _sum(target_tensors(full, "nvfp4"), skip=("mtp.",))
    gptq = sum(x.nbytes for x in drafter_tensors(full, "gptq"))
    bf16 = sum(x.nbytes for x in drafter_tensors(full, "bf16"))
    drafter_kv = d.num_hidden_layers * d.num_key_value_heads * d.head_dim * 2 * 2
    gdn_fp16 = gdn_state_bytes_per_slot(text, ssm_dtype_bytes=2)
    gdn_fp32 = gdn_state_bytes_per_slot(text, ssm_dtype_bytes=4)
    return {
        "single": Serving("single", "RTX 3090", w4a16, gptq + lm_head_int8, attention_kv_bytes_per_token(text, "auto"),
                          drafter_kv, d.sliding_window, gdn_fp16, 7),
        "long": Serving("long", "RTX 3090", w4a16, gptq + lm_head_int8,
                        attention_kv_bytes_per_token(text, "int8_per_token_head"), drafter_kv, d.sliding_window,
                        gdn_fp16, 7),
        # spark-lora keeps the config's float32 SSM state (no mamba_ssm_cache_dtype in its profile).
        "spark-lora": Serving("spark-lora", "DGX Spark", nvfp4, bf16 + lm_head_bf16,
                              attention_kv_bytes_per_token(text, "fp8_e4m3"), drafter_kv, d.sliding_window,
                              gdn_fp32, 7),
    }


def ceiling_tok_s(s: Serving, bandwidth: float, context: int, batch: int, tau: float | None) -> float:
    """Projected tok/s one stream sees at 100 % of ``bandwidth`` (tau None: no speculation)."""
    steps = bandwidth / s.step_bytes(context, batch, tau is not None)
    return steps * (tau if tau is not None else 1.0)


def table(contexts=(512, 10_000, 43_000, 100_000), batches=(1, 8)) -> list[dict[str, Any]]:
    """Every profile on its machine and on the H200, at each context its profile serves."""
    from entrypoint.profiles import load_profile

    rows = []
    for name, s in servings().items():
        longest = load_profile(name).engine.max_model_len
        machines = {s.machine: BANDWIDTH[s.machine], "H200 (nominal)": BANDWIDTH["H200 (nominal)"]}
        for machine, bandwidth in machines.items():
            for batch in batches:
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


def _cmd(args: argparse.Namespace) -> int:
    rows = table()
    parts = {name: asdict(s) for name, s in servings().items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"servings": parts, "rows": rows, "projection": True}, indent=1) + "\n")
    for name, s in parts.items():
        print(f"{name}: " + ", ".join(f"{k} {v / 1e9:.3f} GB" if isinstance(v, int) and v > 1e6 else f"{k} {v}"
                                      for k, v in s.items() if k not in ("profile",)))
    print(markdown(rows), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "roofline", help="projected decode ceilings from bytes per step and memory bandwidth (docs/performance.md)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--json", default=None, help="write the servings and the table as JSON here")
    parser.set_defaults(func=_cmd)
