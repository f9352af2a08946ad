"""The planner's count of what VISION=true adds (issue 58): the tower's bytes from the
checkpoint's own tensors (the tiny vision model's, read back with the safetensors library) or its
vision_config, the encoder cache by vLLM 0.28.0's budget rule, and the refusal of a GPU
profile's text-sized pool that names the pool and context that fit."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from core.profiles import load_profile
from entrypoint.model_configs import MODEL_CONFIGS_DIR
from entrypoint.resolve import resolve
from entrypoint.vision_memory import (
    checkpoint_tower_bytes,
    config_tower_bytes,
    image_tokens,
    pool_for_vision,
    vision_memory,
    vision_refusal,
)
from prepare.generate import generate_model
from prepare.synthetic import TINY_VISION_PRESET
from tests.support.plans import user_settings

FULL_CONFIG = MODEL_CONFIGS_DIR / "qwen3.8-27b-w4a16" / "config.json"


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    return generate_model(tmp_path_factory.mktemp("tiny-vision") / "target", TINY_VISION_PRESET, "qwen3.8-27b-bf16")


def _visual_bytes_read_back(directory) -> int:
    total = 0
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        for name in handle.keys():
            if name.startswith("model.visual."):
                tensor = handle.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


def test_the_tower_is_the_bytes_of_the_checkpoints_visual_tensors(tiny_vision):
    counted = checkpoint_tower_bytes(tiny_vision)
    assert counted == _visual_bytes_read_back(tiny_vision) == 561_024
    config = json.loads((tiny_vision / "config.json").read_text())
    # the config's arithmetic (what a GPU profile is planned with before its download) agrees
    assert config_tower_bytes(config["vision_config"]) == counted


def test_a_config_only_copy_has_no_weights_to_count(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_tower_bytes(tmp_path) is None


def test_the_real_tower_is_921_mb_in_bf16():
    vision_config = json.loads(FULL_CONFIG.read_text())["vision_config"]
    assert config_tower_bytes(vision_config) == 921_460_192
    # the seed's successor's 2,097,152-pixel cap: 2,048 tokens of 32 x 32 pixels
    assert image_tokens(2_097_152, vision_config) == 2048


def test_single_with_vision_counts_the_tower_and_a_2048_token_encoder_cache(tmp_path):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True))
    memory = vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, batched_tokens=2048)
    assert memory.tower_bytes == 921_460_192 and memory.tower_source.startswith("vision_config of ")
    assert memory.encoder_cache_tokens == 2048
    assert memory.encoder_cache_bytes == 2048 * 5120 * 2  # out_hidden_size 5120, bf16
    assert memory.total_bytes == 921_460_192 + 20_971_520


def test_the_encoder_cache_is_the_batch_when_the_batch_is_larger(tmp_path):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True,
                                                             vision_max_pixels=65_536))
    memory = vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, batched_tokens=8192)
    assert memory.image_tokens == 64 and memory.encoder_cache_tokens == 8192


def test_vision_off_counts_nothing(tmp_path):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path))
    assert vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, 2048) is None


def test_a_gpu_profiles_own_pool_is_refused_naming_the_pool_and_context_that_fit(tmp_path):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True))
    memory = vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, 2048)
    smaller = pool_for_vision(resolved.kv_cache_memory_bytes, memory)
    assert smaller == resolved.kv_cache_memory_bytes - 942_431_712
    line = vision_refusal(resolved, memory, longest_with_less=40_000)
    assert line.startswith("VISION=true: profile single's KV pool (5,583,457,484 bytes) is sized for the text model")
    assert f"set KV_CACHE_MEMORY_BYTES={smaller} (it holds requests of up to 40,000 tokens at this layout, " \
           "so set MAX_MODEL_LEN=40,000 too)" in line
    assert "\n" not in line


def test_an_owner_set_pool_and_the_cpu_platform_are_not_refused(tmp_path):
    config = json.loads(FULL_CONFIG.read_text())
    owned = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True,
                                                          kv_cache_memory_bytes=4 << 30))
    cpu = resolve(load_profile("cpu"), user_settings("cpu", models_dir=tmp_path, vision=True))
    for resolved in (owned, cpu):
        assert vision_refusal(resolved, vision_memory(resolved, config, FULL_CONFIG, 2048), 10) is None
