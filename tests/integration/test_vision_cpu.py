"""The tiny vision model (`qwen38 generate --size tiny-vision`) on vLLM 0.28.0's CPU build: a
chat carrying a PNG is answered, the image reaching the language model through the generated
ViT; the same directory with ``language_model_only=True`` refuses the image (docs/vision.md).
One child process runs both engines (`tests/integration/vision_cpu_probe.py`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from prepare.generate import generate_model
from prepare.synthetic import TINY_VISION, TINY_VISION_PRESET
from tests.support.vllm_views import last_json_line, run_python

pytestmark = pytest.mark.integration

PROBE = "import json; from tests.integration.vision_cpu_probe import probe; print(json.dumps(probe({!r})))"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate_model(tmp_path_factory.mktemp("vision") / "target", TINY_VISION_PRESET, "qwen3.8-27b-bf16")


@pytest.fixture(scope="module")
def probed(model) -> dict:
    began = time.perf_counter()
    done = run_python(PROBE.format(str(model)), None, timeout=600)
    result = last_json_line(done)
    result["child_s"] = round(time.perf_counter() - began, 1)
    return result


def test_the_tiny_vision_model_is_small_and_names_its_tower(model):
    config = json.loads((model / "config.json").read_text())
    vision = config["vision_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"]) == (2, 64, TINY_VISION.target.hidden_size)
    assert vision["deepstack_visual_indexes"] == [] and vision["patch_size"] == 16
    assert sum(f.stat().st_size for f in model.iterdir()) < 8 << 20
    assert (model / "preprocessor_config.json").is_file() and (model / "video_preprocessor_config.json").is_file()


def test_an_image_chat_is_answered_through_the_tower(probed):
    vision, image_id = probed["vision"], probed["image_token_id"]
    red, blue, large = vision["answers"]
    # 64 x 64 -> 4 x 4 patches -> 4 tokens after the 2 x 2 merge; 128 x 128 -> 16, between
    # <|vision_start|> and <|vision_end|> as the template placed them.
    assert [a["image_tokens"] for a in (red, blue, large)] == [4, 4, 16]
    start = red["prompt_ids"].index(image_id) - 1
    assert red["prompt_ids"][start] == probed["image_token_id"] - 2  # <|vision_start|>
    assert red["prompt_ids"][start + 5] == probed["image_token_id"] - 1  # <|vision_end|>
    assert all(len(a["ids"]) == 8 for a in (red, blue, large))
    # Same prompt ids, different pixels: the first step's logprobs differ, so the tower's
    # embeddings reached the language model.
    assert red["prompt_ids"] == blue["prompt_ids"] and red["top"] != blue["top"]


def test_language_model_only_refuses_the_image(probed):
    text = probed["text"]
    assert text["answer"]["image_tokens"] == 0 and len(text["answer"]["ids"]) == 8
    assert text["refused"] and "At most 0 image(s)" in text["refused"]
