"""Tiny Qwen3.5/3.8-shaped checkpoints in the real tensor layout, built locally.

- `build_bf16_target(dir)`: a `Qwen3_5ForCausalLM` (3 Gated DeltaNet layers + 1 full
  attention, untied embeddings, one MTP layer) at seeded random init, bf16, saved in three
  shards under the names the real Qwen3.8-27B checkpoint uses
  (``model.language_model.*``, ``lm_head.weight``, ``mtp.*``), with a small byte-level BPE
  tokenizer and a ChatML template.
- `build_w4a16_target(dir)`: the same model with its decoder Linear layers quantized to
  W4A16 (4-bit symmetric, group 128, pack-quantized) by compressed-tensors' own
  compressor, like the RTX 3090 target `qwen3.8-27b-w4a16`: lm_head, the MTP module and
  the tiny GDN ``in_proj_a`` / ``in_proj_b`` stay in ``ignore``.

When the lead's ``qwen38 tiny`` provides the bf16 tiny target, set
``QWEN38_TINY_BF16_TARGET`` to its directory: `bf16_target` then copies it instead of
building one. The W4A16 target is always built here (it needs the model in memory for
compressed-tensors' compressor).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

VOCAB_SIZE = 512
HIDDEN = 256
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model of the Qwen3.8 family answers with random words.",
    "Speculative decoding drafts tokens that the target model verifies.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "int8 embeddings free memory for a longer context on a 24 GB card.",
]
SHARDS = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors")


def text_config() -> dict:
    """config.json of the tiny target (Qwen3.8-27B's fields, tiny sizes)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "pad_token_id": 0,
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 4096,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS * 20, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}, indent=2))


def _shard_of(name: str) -> str:
    if name.startswith("lm_head") or name.startswith("mtp."):
        return SHARDS[2]
    if "embed_tokens" in name or any(f"layers.{i}." in name for i in (0, 1)):
        return SHARDS[0]
    return SHARDS[1]


def _save_sharded(state: dict, directory: Path) -> None:
    from safetensors.torch import save_file

    by_shard: dict[str, dict] = {s: {} for s in SHARDS}
    for name, tensor in state.items():
        by_shard[_shard_of(name)][name] = tensor.contiguous()
    weight_map = {}
    total = 0
    for shard, tensors in by_shard.items():
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = shard
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _model(seed: int):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = {k: v for k, v in text_config().items() if k not in ("architectures", "model_type", "dtype")}
    config = Qwen3_5TextConfig(**fields)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    return model, config


def _mtp_state(config, seed: int) -> dict:
    """The MTP module's tensors (one full-attention decoder layer, fc and norms)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    torch.manual_seed(seed + 1)
    layer = Qwen3_5DecoderLayer(config, layer_idx=config.num_hidden_layers - 1).to(torch.bfloat16)
    state = {f"mtp.layers.0.{k}": v.detach() for k, v in layer.state_dict().items()}
    hidden = config.hidden_size
    state["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(torch.bfloat16)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"):
        state[norm] = torch.zeros(hidden, dtype=torch.bfloat16)  # Qwen3.5 RMSNorm: weight is an offset from 1
    return state


def _checkpoint_state(model, config, seed: int) -> dict:
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        state[name] = tensor.detach()
    state.update(_mtp_state(config, seed))
    return state


def build_bf16_target(directory: Path | str, seed: int = 0) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model, config = _model(seed)
    _save_sharded(_checkpoint_state(model, config, seed), directory)
    (directory / "config.json").write_text(json.dumps(text_config(), indent=2) + "\n")
    write_tokenizer(directory)
    return directory


W4A16_IGNORE_PATTERNS = ("lm_head", "re:.*in_proj_a$", "re:.*in_proj_b$")
MTP_IGNORE = "re:^mtp\\."


def build_w4a16_target(directory: Path | str, seed: int = 0) -> Path:
    """The tiny model with W4A16 decoder layers, compressed by compressed-tensors."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model, config = _model(seed)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=list(W4A16_IGNORE_PATTERNS),
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, qconfig)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            weight = module.weight.float()
            groups = weight.reshape(weight.shape[0], -1, args.group_size)
            scale, zero_point = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args)
            module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
            module.weight_zero_point.data.copy_(zero_point.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    _save_sharded(_checkpoint_state(model, config, seed), directory)
    (directory / "config.json").write_text(json.dumps(text_config(), indent=2) + "\n")
    compressor.update_config(str(directory))
    _rename_ignore(directory / "config.json")
    write_tokenizer(directory)
    return directory


def _rename_ignore(config_path: Path) -> None:
    """Name ignored modules as the checkpoint does, and keep the (bf16) MTP module out."""
    config = json.loads(config_path.read_text())
    quant = config["quantization_config"]
    renamed = ["model.language_model." + n[len("model.") :] if n.startswith("model.") else n for n in quant["ignore"]]
    quant["ignore"] = sorted(renamed) + [MTP_IGNORE]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def bf16_target(directory: Path | str, seed: int = 0) -> Path:
    """The bf16 tiny target: the lead's (``QWEN38_TINY_BF16_TARGET``) or one built here."""
    given = os.environ.get("QWEN38_TINY_BF16_TARGET")
    directory = Path(directory)
    if given:
        shutil.copytree(given, directory, dirs_exist_ok=True)
        return directory
    return build_bf16_target(directory, seed)
