"""A tiny Qwen3.5-architecture hybrid checkpoint (GDN + attention, untied), in two
forms: int8 embed_tokens in the compressed-tensors pack-quantized format (REFERENCE.md
§5), and the same model with that embedding dequantized back to bf16.

Random weights from transformers' own Qwen3_5ForCausalLM, seeded. Sizes respect what
the CPU engine needs: attention head_dim >= 32, GDN head dims 128, hidden a multiple
of the 128-wide quantization group.
"""

from __future__ import annotations

import json
from pathlib import Path

GROUP = 128


def quantize_int8_groups(weight):
    """int8 symmetric, group 128 along the input dim, scale = absmax/127 (>= 1e-10)."""
    import torch

    rows, cols = weight.shape
    blocks = weight.float().view(rows, cols // GROUP, GROUP)
    scale = (blocks.abs().amax(-1) / 127).clamp(min=1e-10)
    q = torch.clamp(torch.round(blocks / scale.unsqueeze(-1)), -128, 127).to(torch.int8).view(rows, cols)
    return q, scale.to(torch.bfloat16)


def build_tiny_hybrid(root: Path, seed: int = 0) -> dict[str, Path]:
    """Write ``root/int8-embed`` and ``root/dequantized``; returns both paths."""
    import torch
    from compressed_tensors.compressors.pack_quantized import pack_to_int32
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
    )
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        # A spread-out embedding table, so the int8 rounding is exercised.
        model.model.embed_tokens.weight.normal_(0.0, 0.5)
    dequantized = root / "dequantized"
    model.save_pretrained(dequantized, safe_serialization=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state.update(_mtp_weights(state, config))
    weight = state.pop("model.embed_tokens.weight")
    q, scale = quantize_int8_groups(weight)
    # The reference model reads exactly what the quantized lookup produces.
    state_ref = dict(state)
    state_ref["model.embed_tokens.weight"] = (
        (q.float().view(q.shape[0], -1, GROUP) * scale.float().unsqueeze(-1))
        .view_as(weight)
        .to(torch.bfloat16)
    )
    for shard in dequantized.glob("*.safetensors"):
        shard.unlink()
    save_file(state_ref, dequantized / "model.safetensors", metadata={"format": "pt"})

    quantized = root / "int8-embed"
    quantized.mkdir(parents=True, exist_ok=True)
    state["model.embed_tokens.weight_packed"] = pack_to_int32(q, 8)
    state["model.embed_tokens.weight_scale"] = scale
    state["model.embed_tokens.weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
    save_file(state, quantized / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dequantized / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (dequantized / "config.json").write_text(json.dumps(cfg, indent=2))
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "embed_int8": {
                "targets": ["re:.*embed_tokens$"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": GROUP,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
            }
        },
        "ignore": ["lm_head"],
    }
    (quantized / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in dequantized.iterdir():
        if extra.name not in ("config.json", "model.safetensors") and extra.is_file():
            (quantized / extra.name).write_bytes(extra.read_bytes())
    return {"int8": quantized, "dequantized": dequantized}


def _mtp_weights(state, config) -> dict:
    """An MTP module (`mtp.*`, as Qwen3.5 checkpoints ship it): transformers' class has
    none, so its decoder layer is a copy of the full-attention layer and its fc is
    random. vLLM's Qwen3_5MTP shares the target's embed_tokens by name."""
    import torch

    attention_layer = config.layer_types.index("full_attention")
    prefix = f"model.layers.{attention_layer}."
    hidden = config.hidden_size
    weights = {
        "mtp.layers.0." + name[len(prefix) :]: tensor.clone()
        for name, tensor in state.items()
        if name.startswith(prefix)
    }
    weights["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(torch.bfloat16)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"):
        weights[norm] = torch.zeros(hidden, dtype=torch.bfloat16)
    return weights
