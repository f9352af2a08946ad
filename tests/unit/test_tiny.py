"""The tiny models (`qwen38 tiny`, the generator's `tiny` preset): deterministic, of the real
architectures, loadable by transformers, with the wide greedy margins the CPU tests rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from core.errors import VerifyError
from core.manifest import MANIFEST_NAME, input_ref, read_manifest, sha256_file
from entrypoint.canary import CANARY_PROMPT, CANARY_TOKENS
from prepare.adapter import adapter_derivation, build_adapter, verify_adapter_binding
from prepare.directions import read_directions
from prepare.generate import TINY_ADAPTER_STRENGTH as ADAPTER_STRENGTH
from prepare.generate import build_tiny_models


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_runs_write_byte_identical_files(tiny_root, tmp_path):
    build_tiny_models(tmp_path / "tiny")
    assert _files(tmp_path / "tiny") == _files(tiny_root / "tiny")


def test_target_is_a_qwen35_hybrid_with_untied_embeddings_and_an_mtp_head(tiny_root):
    target = tiny_root / "tiny" / "target"
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["tie_word_embeddings"] is False and config["head_dim"] >= 32
    with safe_open(target / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [1024, 128]
        assert f.get_slice("lm_head.weight").get_shape() == [1024, 128]
    assert {"model.layers.0.linear_attn.out_proj.weight", "model.layers.0.linear_attn.A_log",
            "model.layers.3.self_attn.o_proj.weight", "mtp.fc.weight", "mtp.layers.0.self_attn.o_proj.weight"} <= names


def test_transformers_loads_the_target_and_its_logits_are_finite(tiny_root):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_root / "tiny" / "target"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok("def cache(x):", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 1024) and torch.isfinite(logits).all()


def test_lm_head_sends_every_ordinary_token_to_its_own_successor_and_never_to_a_special_one(tiny_root):
    import torch
    from transformers import AutoTokenizer

    from prepare.synthetic import SPECIAL_IDS
    from prepare.tokenizer import SPECIAL_TOKENS

    target = tiny_root / "tiny" / "target"
    tok = AutoTokenizer.from_pretrained(target)
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(SPECIAL_IDS))  # the recipe's assumption
    with safe_open(target / "model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        head = f.get_tensor("lm_head.weight").float()
    ordinary = torch.arange(SPECIAL_IDS, 1000)
    logits = embed[ordinary] @ head.T
    best = logits.argmax(dim=1)
    assert sorted(best.tolist()) == ordinary.tolist()  # a permutation of the ordinary tokens
    top2 = logits.topk(2, dim=1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 3.0  # wide margins: |e| ~ 11 along its own row, ~N(0, 1) elsewhere
    assert head[:SPECIAL_IDS].abs().sum() == 0 and head[1000:].abs().sum() == 0


def test_chat_template_has_roles_tools_and_the_thinking_switch(tiny_root):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_root / "tiny" / "target")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "cold"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert "<|im_start|>system\nBe brief." in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\ncold\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "<tool_call>", "<|mask|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_drafter_is_a_dflash_draft_model_over_target_layers(tiny_root):
    config = json.loads((tiny_root / "tiny" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 2]
    with safe_open(tiny_root / "tiny" / "drafter" / "model.safetensors", "pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [128, 256]


def test_drafter2_is_a_dflash2_draft_model_shaped_like_the_real_one(tiny_root):
    config = json.loads((tiny_root / "tiny" / "drafter2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert set(config["layer_types"]) == {"sliding_attention"}
    dflash = config["dflash_config"]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id"} <= set(dflash)
    hidden, taps = config["hidden_size"], dflash["conv_kernel_size"]
    with safe_open(tiny_root / "tiny" / "drafter2" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("layers.0.attention_conv.base_kernel").get_shape() == [2, taps, hidden]
        rows = 2 * taps * hidden // dflash["conv_group_size"]
        assert f.get_slice("layers.1.mlp_conv.kernel_projection.weight").get_shape() == [rows, hidden]
        assert f.get_slice("candidate_selector.successor_codebook").get_shape() == [1024, dflash["selector_rank"]]
    assert not any(n.startswith(("lm_head", "embed_tokens")) for n in names)  # shares the target's


def test_adapter_is_rank_1_on_every_residual_writing_module(tiny_root):
    adapter = tiny_root / "tiny" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (1, 1)
    assert {m.rsplit(".", 1)[-1] for m in config["target_modules"]} == {"out_proj", "o_proj", "down_proj"}
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight").get_shape() == [1, 256]
        assert f.get_slice("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").get_shape() == [128, 1]
    modules = {n.rsplit(".lora_", 1)[0].removeprefix("base_model.model.") for n in names}
    assert modules == {"model.layers.0.linear_attn.out_proj", "model.layers.1.linear_attn.out_proj",
                       "model.layers.2.linear_attn.out_proj", "model.layers.3.self_attn.o_proj"} | {
        f"model.layers.{i}.mlp.down_proj" for i in range(4)}
    assert set(config["target_modules"]) == modules


def test_directions_are_unit_vectors_at_the_adapter_strength(tiny_root):
    directions = read_directions(tiny_root / "tiny" / "directions" / "directions.safetensors")
    assert len(directions.modules) == 8
    assert set(directions.coefs.values()) == {ADAPTER_STRENGTH}
    for vector in directions.vectors.values():
        assert vector.shape == (128,) and abs(float(vector.double().norm()) - 1) < 1e-6


def test_adapter_is_what_the_adapter_converter_builds_from_target_and_directions(tiny_root, tmp_path):
    tiny = tiny_root / "tiny"
    record = build_adapter(tiny / "target", tiny / "directions" / "directions.safetensors", tmp_path / "built")
    assert record["formats"] == {"bf16": 8}
    assert (tmp_path / "built" / "adapter_model.safetensors").read_bytes() == (
        tiny / "adapter" / "adapter_model.safetensors"
    ).read_bytes()
    # the same derivation, recorded inside the generated identity the `cpu` profile checks
    derivation = adapter_derivation(read_manifest(tiny / "adapter"), tiny / "adapter")
    assert derivation == read_manifest(tmp_path / "built").identity
    assert derivation.inputs == (input_ref(tiny / "target", "model"), input_ref(tiny / "directions", "directions"))
    assert verify_adapter_binding(tiny / "adapter", tiny / "target") == derivation


def test_adapter_is_bound_to_its_own_target(tiny_root, tmp_path):
    build_tiny_models(tmp_path / "other", seed=7)
    with pytest.raises(VerifyError, match=r"built from tiny-v\d+#[0-9a-f]{12}, the served target"):
        verify_adapter_binding(tiny_root / "tiny" / "adapter", tmp_path / "other" / "target")


def test_adapter_changes_the_greedy_canary_answer(tiny_root):
    """What the readiness gate needs: 12 greedy chat tokens differ (here in transformers, bf16)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_root / "tiny" / "target"
    tok = AutoTokenizer.from_pretrained(target)
    base = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    adapted = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    lora = load_file(str(tiny_root / "tiny" / "adapter" / "adapter_model.safetensors"))
    weights = adapted.state_dict()
    with torch.no_grad():
        for name, a in lora.items():
            if name.endswith(".lora_A.weight"):
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                w = weights[f"{module}.weight"]
                w.copy_((w.float() + lora[name.replace("lora_A", "lora_B")] @ a).to(w.dtype))  # W + B A
    for prompt in (CANARY_PROMPT, "Hello", "def f(x):"):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        ids = tok(text, return_tensors="pt").input_ids
        answers = [m.generate(ids, max_new_tokens=CANARY_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
                   for m in (base, adapted)]
        assert len(answers[0]) == CANARY_TOKENS
        assert answers[0][0] != answers[1][0], prompt  # from the first token on


@pytest.mark.parametrize("name", ["target", "drafter", "drafter2", "directions", "adapter"])
def test_each_model_carries_a_manifest_that_matches_its_files(tiny_root, name):
    directory = tiny_root / "tiny" / name
    manifest = read_manifest(directory)
    assert manifest.identity.generator == "tiny" and manifest.identity.params["model"] == name
    listed = {f.path: f for f in manifest.files}
    on_disk = {p.name for p in directory.iterdir() if p.name != MANIFEST_NAME}
    assert set(listed) == on_disk
    for path, entry in listed.items():
        assert entry.sha256 == sha256_file(directory / path)
        assert entry.size == (directory / path).stat().st_size
