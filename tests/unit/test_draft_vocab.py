"""`qwen38 prepare draft-vocab`: selection, coverage, the d2t/t2d files and their consumer."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.errors import PrepareError
from core.manifest import read_manifest
from prepare.draft_vocab import VOCAB_JSON, VOCAB_TENSORS, build_draft_vocab, select_ids
from prepare.generate import generate_model
from prepare.requantize import requantize_checkpoint

CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n\n",
    "Speculative decoding drafts tokens that the target model verifies.\n\n",
    "def main():\n    print('hello, world')\n    return 0\n\n",
] * 40


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate_model(tmp_path_factory.mktemp("tiny") / "bf16", "tiny-vl", "qwen3.8-27b-bf16")


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def read_files(out: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    document = json.loads((out / VOCAB_JSON).read_text())
    with safe_open(str(out / VOCAB_TENSORS), "pt") as f:
        return document, f.get_tensor("d2t"), f.get_tensor("t2d")


def test_text_files_are_read_as_paragraphs(tmp_path):
    from prepare.draft_vocab import iter_records

    path = tmp_path / "c.txt"
    path.write_text("".join(CORPUS[:3]))
    assert list(iter_records(path)) == CORPUS[:3]


def test_select_ids_keeps_special_then_most_frequent_then_lowest():
    counts = [0, 5, 9, 9, 0, 1, 0, 0]
    assert select_ids(counts, 3, always=[7]) == [2, 3, 7]
    assert select_ids(counts, 4) == [1, 2, 3, 5]  # every counted id, ties broken by the lower id
    assert select_ids(counts, 6) == [0, 1, 2, 3, 4, 5]  # corpus too small: filled with the lowest ids
    with pytest.raises(PrepareError, match="--size 9"):
        select_ids(counts, 9)


def test_corpus_vocab_holds_the_corpus_tokens_and_reports_heldout_coverage(model, tokenizer, tmp_path):
    corpus = tmp_path / "outputs.txt"
    corpus.write_text("".join(CORPUS))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(
        json.dumps({"text": "The lazy dog verifies tokens.\n"}) + "\n" + json.dumps("zebra quartz!\n") + "\n"
    )
    result = build_draft_vocab(model, tmp_path / "vocab", corpus=[corpus], heldout=[heldout], size=160)
    document, d2t, t2d = read_files(tmp_path / "vocab")

    ids = document["token_ids"]
    assert len(ids) == 160 == document["draft_vocab_size"] and ids == sorted(ids)
    seen = {t for text in CORPUS for t in tokenizer(text, add_special_tokens=False)["input_ids"]}
    assert seen <= set(ids)  # fewer distinct corpus tokens than 160: all of them are in
    assert set(tokenizer.all_special_ids) <= set(ids)
    assert result.coverage["corpus"] == 1.0
    held = [
        t
        for text in ("The lazy dog verifies tokens.\n", "zebra quartz!\n")
        for t in tokenizer(text, add_special_tokens=False)["input_ids"]
    ]
    assert result.coverage["heldout_tokens"] == len(held)
    assert result.coverage["heldout"] == pytest.approx(sum(t in set(ids) for t in held) / len(held))
    assert 0 < result.coverage["heldout"] < 1

    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(160) + d2t).tolist() == ids
    assert t2d.shape == (512,) and t2d.nonzero().flatten().tolist() == ids


def test_without_heldout_files_every_tenth_record_is_held_out(model, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(CORPUS))
    result = build_draft_vocab(model, tmp_path / "vocab", corpus=[corpus], size=64)
    assert (
        result.coverage["heldout_tokens"] > 0 and result.coverage["corpus_tokens"] > result.coverage["heldout_tokens"]
    )


def test_pinned_ids_are_written_as_given_and_bad_lists_refused(model, tmp_path):
    pinned = tmp_path / "ids.json"
    pinned.write_text(json.dumps({"ids": [300, 2, 17, 0]}))
    build_draft_vocab(model, tmp_path / "vocab", ids_file=pinned)
    document, d2t, _ = read_files(tmp_path / "vocab")
    assert document["token_ids"] == [0, 2, 17, 300] and (torch.arange(4) + d2t).tolist() == [0, 2, 17, 300]
    for bad, message in (([1, 1], "duplicate"), ([512], "outside"), ("x", "list of token ids")):
        pinned.write_text(json.dumps(bad))
        with pytest.raises(PrepareError, match=message):
            build_draft_vocab(model, tmp_path / "other", ids_file=pinned)


def test_rerun_is_idempotent_and_output_deterministic(model, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(CORPUS))
    first = build_draft_vocab(model, tmp_path / "a", corpus=[corpus], size=80)
    again = build_draft_vocab(model, tmp_path / "a", corpus=[corpus], size=80)
    build_draft_vocab(model, tmp_path / "b", corpus=[corpus], size=80)
    assert not first.up_to_date and again.up_to_date
    for name in (VOCAB_JSON, VOCAB_TENSORS, "qwen38-manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_vllm_dflash_logit_mapping_reads_our_d2t_as_intended(model, tmp_path):
    """vLLM 0.28.0's own draft->target logit scatter (qwen3_dflash.py) places each drafted
    logit at the target id we listed, and leaves every other id at -inf."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    pinned = tmp_path / "ids.json"
    ids = [3, 9, 10, 200, 511]
    pinned.write_text(json.dumps(ids))
    build_draft_vocab(model, tmp_path / "vocab", ids_file=pinned)
    _, d2t, _ = read_files(tmp_path / "vocab")
    fake = types.SimpleNamespace(
        logits_processor=lambda head, hidden: hidden,
        lm_head=None,
        draft_id_to_target_id=d2t,
        config=types.SimpleNamespace(draft_vocab_size=len(ids), vocab_size=512),
    )
    draft_logits = torch.tensor([[0.5, 1.5, 2.5, 3.5, 4.5]])
    full = DFlashQwen3ForCausalLM.compute_logits(fake, draft_logits)
    assert full.shape == (1, 512)
    assert full[0, ids].tolist() == draft_logits[0].tolist()
    assert torch.isinf(full[0, [i for i in range(512) if i not in ids]]).all()


def test_requantize_carries_the_draft_vocab_into_the_model_directory(model, tmp_path):
    pinned = tmp_path / "ids.json"
    pinned.write_text(json.dumps(list(range(64))))
    build_draft_vocab(model, tmp_path / "vocab", ids_file=pinned)
    requantize_checkpoint(model, tmp_path / "prepared", ["lm_head"], draft_vocab=tmp_path / "vocab")
    for name in (VOCAB_JSON, VOCAB_TENSORS):
        assert (tmp_path / "prepared" / name).read_bytes() == (tmp_path / "vocab" / name).read_bytes()
    identity = read_manifest(tmp_path / "prepared").identity
    vocab = read_manifest(tmp_path / "vocab")
    assert [ref.role for ref in identity.inputs] == ["model", "draft_vocab"]
    assert identity.inputs[1].identity.transform == "draft-vocab"
    assert identity.inputs[1].manifest_digest == vocab.digest
    # vLLM only loads the safetensors files the index names: the mapping is not a weight.
    index = json.loads((tmp_path / "prepared" / "model.safetensors.index.json").read_text())
    assert VOCAB_TENSORS not in set(index["weight_map"].values())
