"""The planner's count of what VISION=true adds (issue 58): the tower's bytes from the
checkpoint's own tensors (the tiny vision model's, read back with the safetensors library) or its
vision_config, the encoder cache by vLLM 0.28.0's budget rule, and the refusal of a GPU
profile's text-sized pool that names the pool and context that fit."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from core.errors import SettingsError
from core.profiles import load_profile
from entrypoint.launch import _engine_env
from entrypoint.model_configs import MODEL_CONFIGS_DIR
from entrypoint.resolve import resolve
from entrypoint.vision_memory import (
    TOWER_HOST_ENV,
    checkpoint_tower_bytes,
    config_tower_bytes,
    config_tower_tensors,
    device_tower_bytes,
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
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True,
                                                             vision_tower="gpu"))
    memory = vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, batched_tokens=2048)
    assert memory.tower_bytes == 921_460_192 and memory.tower_source.startswith("vision_config of ")
    assert memory.tower_place == "gpu" and memory.device_tower_bytes == 921_460_192
    assert memory.encoder_cache_tokens == 2048
    assert memory.encoder_cache_bytes == 2048 * 5120 * 2  # out_hidden_size 5120, bf16
    assert memory.total_bytes == 921_460_192 + 20_971_520


# What stays on the device with the tower in host memory (patch 0087): the patch embedding
# (1152 x 3 x 2 x 16 x 16 + bias) and the 48 x 48 position table, bf16; and, while an image is
# encoded, the largest module copied over: the merger (4608 x 4608 and 4608 -> 5120, with norm
# and biases; a block is 30.5 MB).
RESIDENT = 1152 * 3 * 2 * 16 * 16 * 2 + 1152 * 2 + 2304 * 1152 * 2
MERGER = (4608 * 4608 + 4608 + 4608 * 5120 + 5120 + 2 * 1152) * 2


def test_an_rtx3090_profile_keeps_the_tower_in_host_memory_and_the_device_holds_a_module_at_a_time(tmp_path):
    config = json.loads(FULL_CONFIG.read_text())
    for name in ("single", "long", "huge"):  # the RTX 3090's default; the Spark's memory is one pool
        resolved = resolve(load_profile(name), user_settings(name, models_dir=tmp_path, vision=True))
        assert resolved.vision.tower == "host", name
    spark = resolve(load_profile("spark-lora"), user_settings("spark-lora", models_dir=tmp_path, vision=True))
    assert spark.vision.tower == "gpu"
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True))
    memory = vision_memory(resolved, config, FULL_CONFIG, batched_tokens=2048)
    assert memory.tower_place == "host" and memory.tower_bytes == 921_460_192
    assert memory.device_tower_bytes == RESIDENT + MERGER == 98_526_976
    assert memory.total_bytes == 98_526_976 + 20_971_520
    # The same rule over the checkpoint's own names (the hub's `model.visual.*`).
    tensors = config_tower_tensors(config["vision_config"])
    assert device_tower_bytes(tensors, "host") == 98_526_976 and device_tower_bytes(tensors, "gpu") == 921_460_192
    # On the CPU platform the tower is host memory whatever the setting: counted whole.
    cpu = resolve(load_profile("cpu"), user_settings("cpu", models_dir=tmp_path, vision=True, vision_tower="host"))
    assert vision_memory(cpu, config, FULL_CONFIG, 2048).tower_place == "gpu"


def test_the_tower_setting_without_vision_is_one_clear_error(tmp_path):
    with pytest.raises(SettingsError, match="VISION_TOWER=host: vision is off for profile single; set VISION=true "
                                            "or unset VISION_TOWER"):
        resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision_tower="host"))


def test_the_encoder_cache_is_the_batch_when_the_batch_is_larger(tmp_path):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True,
                                                             vision_max_pixels=65_536))
    memory = vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, batched_tokens=8192)
    assert memory.image_tokens == 64 and memory.encoder_cache_tokens == 8192


def test_vision_off_counts_nothing(tmp_path):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path))
    assert vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, 2048) is None


@pytest.mark.parametrize("tower, takes", [("gpu", 942_431_712), ("host", 119_498_496)])
def test_a_gpu_profiles_own_pool_is_refused_naming_the_pool_and_context_that_fit(tmp_path, tower, takes):
    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True,
                                                             vision_tower=tower))
    memory = vision_memory(resolved, json.loads(FULL_CONFIG.read_text()), FULL_CONFIG, 2048)
    smaller = pool_for_vision(resolved.kv_cache_memory_bytes, memory)
    assert smaller == resolved.kv_cache_memory_bytes - takes
    line = vision_refusal(resolved, memory, longest_with_less=40_000)
    assert line.startswith("VISION=true: profile single's KV pool (5,583,457,484 bytes) is sized for the text model")
    host = "the vision tower's part on the device (98,526,976 of its 921,460,192 bytes with VISION_TOWER=host,"
    assert ("the vision tower (921,460,192 bytes," if tower == "gpu" else host) in line
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


def test_the_engine_gets_the_host_memory_switch_only_for_a_cuda_tower_in_host_memory(tmp_path):
    def engine_env(name: str, **settings) -> dict[str, str]:
        user = user_settings(name, models_dir=tmp_path, **settings)
        return _engine_env(resolve(load_profile(name), user), user, None)

    assert engine_env("single", vision=True)[TOWER_HOST_ENV] == "1"
    assert TOWER_HOST_ENV not in engine_env("single", vision=True, vision_tower="gpu")
    assert TOWER_HOST_ENV not in engine_env("single")
    assert TOWER_HOST_ENV not in engine_env("cpu", vision=True, vision_tower="host")
