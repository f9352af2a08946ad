"""`qwen38 plan`: the planner's inputs, its report, and the launcher's refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from entrypoint.errors import PlanError
from entrypoint.plan import MODEL_CONFIGS_DIR, _engine_values, _shape_only_copy, build_request, config_source
from entrypoint.profiles import load_profile
from tests.support.plans import seed_plans  # noqa: F401
from tests.support.vllm_views import child_pythonpath


def test_served_config_is_preferred_over_the_config_only_copy(tmp_path):
    slot = load_profile("single").models.target
    assert config_source(slot, tmp_path) == MODEL_CONFIGS_DIR / "qwen3.8-27b-w4a16" / "config.json"
    served = tmp_path / slot.dir / "config.json"
    served.parent.mkdir(parents=True)
    served.write_text("{}")
    assert config_source(slot, tmp_path) == served


def test_generated_model_without_its_directory_is_a_plan_error(tmp_path):
    from entrypoint.profiles import ModelSlot

    with pytest.raises(PlanError, match="prepare the model first"):
        config_source(ModelSlot(dir="tiny-hybrid", generated="tiny"), tmp_path)


def test_weight_quantization_is_dropped_from_the_copy_vllm_reads(tmp_path):
    source = MODEL_CONFIGS_DIR / "qwen3.8-27b-w4a16" / "config.json"
    copy = json.loads((Path(_shape_only_copy(source, tmp_path / "t")) / "config.json").read_text())
    assert "quantization_config" not in copy
    assert copy["text_config"]["layer_types"] == json.loads(source.read_text())["text_config"]["layer_types"]


def test_overrides_from_settings_win_and_unpinned_pool_is_refused():
    profile = load_profile("single")
    values = _engine_values(
        profile, SimpleNamespace(max_model_len=32768, max_num_seqs=None, prefix_caching=False)
    )
    assert values["max_model_len"] == 32768 and values["max_num_seqs"] == 8
    assert values["enable_prefix_caching"] is False
    unpinned = profile.model_copy(
        update={"engine": profile.engine.model_copy(update={"kv_cache_memory_bytes": None})}
    )
    with pytest.raises(PlanError, match="kv_cache_memory_bytes"):
        _engine_values(unpinned, None)


def test_request_carries_the_drafter_and_the_gpu(tmp_path):
    request, sources = build_request(
        load_profile("long"), SimpleNamespace(models_dir=tmp_path), tmp_path / "w"
    )
    assert request["platform"] == "cuda" and request["device_capability"] == [8, 6]
    assert (
        request["speculative"]["method"] == "dflash" and request["speculative"]["num_speculative_tokens"] == 7
    )
    assert sources["drafter"].endswith("qwen3.8-27b-dflash2-w4a16/config.json")
    no_spec, _ = build_request(
        load_profile("long"), SimpleNamespace(models_dir=tmp_path, speculation=False), tmp_path / "x"
    )
    assert no_spec["speculative"] is None


@pytest.mark.slow
def test_plan_json_has_the_fields_the_launcher_reads(seed_plans):
    data = json.loads(seed_plans[("single", True)].model_dump_json())
    assert isinstance(data["pool_tokens"], int)
    assert isinstance(data["max_concurrency"], float)
    assert isinstance(data["fits"], bool) and isinstance(data["patched"], bool)
    assert set(data["variants"]) == {"patched", "stock"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["single", "long"])
def test_profile_capacity_records_what_the_planner_finds(seed_plans, name):
    capacity = load_profile(name).capacity
    assert seed_plans[(name, False)].pool_tokens == capacity.pool_tokens
    assert seed_plans[(name, True)].pool_tokens == capacity.pool_tokens_prefix_caching


@pytest.mark.slow
def test_all_slots_busy_is_reported_not_assumed(seed_plans):
    """With DFlash2 K=7 every slot holds 8 GDN state copies (9 with prefix caching):
    ~0.7 GB per slot, so the 5.2 GiB pool cannot keep 8 slots resident at once."""
    single = seed_plans[("single", True)].serving
    assert single.state_bytes_per_request == 6 * 9 * single.bytes_per_block
    assert single.slots_resident < 8 and not single.fits_with_all_slots_busy
    assert single.slots_resident_with_max_context == 1


@pytest.mark.slow
def test_spark_lora_fits_its_16_gib_fp8_pool(seed_plans):
    plan = seed_plans[("spark-lora", None)]
    assert plan.fits and plan.max_model_len == 131072
    assert plan.serving.block_size % 16 == 0
    # the drafter's layers are planned with the backend the profile pins for them
    assert plan.serving.drafter_backend == "TRITON_ATTN"


@pytest.mark.slow
def test_refusal_line_names_context_pool_and_what_fits(seed_plans):
    plan = seed_plans[("long", False)]
    refused = plan.model_copy(update={"patched": False, "fits": False, "serving": plan.variants["stock"]})
    line = refused.refusal_line()
    assert "131,072-token request does not fit" in line and "5,583,457,484-byte" in line
    assert f"{plan.variants['stock'].max_model_len_that_fits:,}" in line and "\n" not in line


@pytest.mark.slow
def test_cli_refuses_a_context_that_does_not_fit(tmp_path):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), MODELS_DIR=str(tmp_path), MAX_MODEL_LEN="262144")
    done = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "plan", "--profile", "long", "--json", "--no-compare"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode != 0
    plan = json.loads(done.stdout[done.stdout.index("{") :])
    assert plan["fits"] is False and plan["patched"] is True and list(plan["variants"]) == ["patched"]
    assert "262,144-token request does not fit" in done.stderr and "Traceback" not in done.stderr


def test_lookup_widens_the_speculative_width_the_planner_reserves(tiny_root, tmp_path):
    """Each slot keeps state/KV for every verify position: drafter depth + lookup tokens."""
    cpu = load_profile("cpu")
    off, _ = build_request(cpu, SimpleNamespace(models_dir=tiny_root, speculation=True), tmp_path / "a")
    on, _ = build_request(cpu, SimpleNamespace(models_dir=tiny_root, speculation=True, lookup=True,
                                               verify_block=16), tmp_path / "b")
    assert off["speculative"]["num_speculative_tokens"] == 4
    assert on["speculative"]["num_speculative_tokens"] == 15
    assert "lookup_tokens" not in on["speculative"]  # stock trees plan the same width
    with pytest.raises(PlanError, match="VERIFY_BLOCK=8"):
        build_request(load_profile("single"), SimpleNamespace(models_dir=tmp_path, lookup=True, verify_block=8),
                      tmp_path / "c")


def test_lookup_with_a_dflash2_drafter_is_refused_before_loading(tmp_path):
    """DFlash2 runs on vLLM's V2 runner, where patch 0070 has no lookup drafting yet."""
    with pytest.raises(PlanError, match="DFlash2DraftModel.*set LOOKUP=false"):
        build_request(load_profile("single"), SimpleNamespace(models_dir=tmp_path, lookup=True), tmp_path / "w")
