"""The roofline's arithmetic: bytes per decode step from the real shapes, ceilings from bandwidth."""

from __future__ import annotations

import pytest

from bench import roofline as rf
from prepare.synthetic import PRESETS, drafter_tensors, target_tensors


def test_a_step_reads_weights_once_and_kv_and_state_per_sequence():
    s = rf.Serving("p", "m", target_weights=1000, drafter_weights=100, kv_per_token=10, drafter_kv_per_token=2,
                   drafter_window=50, gdn_state=7, k=3)
    assert s.step_bytes(context=20, batch=1, speculative=False) == 1000 + 20 * 10 + 7 * 2
    # speculation: the drafter, its windowed KV, and one state written per verified position
    assert s.step_bytes(context=100, batch=2, speculative=True) == 1000 + 100 + 2 * (100 * 10 + 7 * 5 + 50 * 2)


def test_the_ceiling_is_bandwidth_over_bytes_times_the_acceptance_length():
    s = rf.Serving("p", "m", 1000, 0, 0, 0, 1, 0, 7)
    assert rf.ceiling_tok_s(s, 1e6, 0, 1, None) == pytest.approx(1000.0)
    assert rf.ceiling_tok_s(s, 1e6, 0, 1, 5.15) == pytest.approx(5150.0)


def test_target_weights_are_the_stored_layers_and_lm_head_not_embed_or_mtp():
    full = PRESETS["full"]
    single = rf.servings()["single"]
    tensors = target_tensors(full, "w4a16")
    layers = sum(t.nbytes for t in tensors if ".layers." in t.name and not t.name.startswith("mtp."))
    norm = 5120 * 2
    assert single.target_weights == layers + norm + rf.int8_table_bytes(248320, 5120)
    assert rf.int8_table_bytes(248320, 5120) == 248320 * 5120 + 248320 * 40 * 2
    assert single.drafter_weights == sum(t.nbytes for t in drafter_tensors(full, "gptq")) + rf.int8_table_bytes(248320, 5120)
    assert single.kv_per_token == 65536 and rf.servings()["spark-lora"].kv_per_token == 32768


def test_every_row_is_a_labelled_projection_with_the_articles_acceptance():
    rows = rf.table(contexts=(512,), batches=(1,))
    assert {r["machine"] for r in rows} == {"RTX 3090", "DGX Spark", "H200 (nominal)"}
    text = rf.markdown(rows)
    assert "projected tok/s" in text and "tau 5.15" in text and "tau 3.74" in text


def test_each_serving_takes_its_profiles_kv_dtype_state_dtype_and_depth():
    servings = rf.servings()
    text = rf.model_config("qwen3.8-27b-w4a16")["text_config"]
    assert servings["long"].kv_per_token == rf.attention_kv_bytes_per_token(text, "int8_per_token_head")
    assert servings["single"].gdn_state == rf.gdn_state_bytes_per_slot(text, 2)  # mamba_ssm_cache_dtype float16
    assert servings["spark-lora"].gdn_state == rf.gdn_state_bytes_per_slot(text, 4)  # auto: the config's float32
    assert {s.k for s in servings.values()} == {7} and servings["spark-lora"].machine == "DGX Spark"


def test_a_profile_whose_target_is_not_a_known_artifact_is_one_clear_error():
    from core.errors import BenchError
    from core.profiles import load_profile

    with pytest.raises(BenchError, match="target artifact None is not one the roofline knows"):
        rf.serving(load_profile("cpu"))


def test_huge_reads_the_k4v2_format_bytes_and_projects_only_the_batches_and_contexts_it_serves():
    from entrypoint.kv_capacity import k4v2_format

    text = rf.model_config("qwen3.8-27b-w4a16")["text_config"]
    huge = rf.servings()["huge"]
    # 16 attention layers x 4 KV heads x (128 B of 4-bit keys + 64 B of 2-bit values + 16 B of
    # group scales and minimums): 2.5 times fewer than `long`'s int8 with its per-token scales.
    assert huge.kv_per_token == 16 * 4 * k4v2_format().TOKEN_HEAD_BYTES == 13_312
    assert huge.kv_per_token * 5 == 2 * rf.attention_kv_bytes_per_token(text, "int8_per_token_head")
    rows = [r for r in rf.table() if r["profile"] == "huge"]
    assert {r["batch"] for r in rows} == {1} and max(r["context"] for r in rows) == 245_000
    assert {r["batch"] for r in rf.table() if r["profile"] == "single"} == {1, 8}
