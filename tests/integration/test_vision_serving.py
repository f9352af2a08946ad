"""Images in, end to end (issue 58): `qwen38 serve` with VISION=true serves the tiny vision model
on vLLM 0.28.0's CPU build (`cpu-vision`: the `cpu` profile with the tiny-vision target,
tests/support/vision_serving.py), and the official SDKs see the answers and the 400s.

- OpenAI chat completions and Responses with a PNG data URL are answered; the prompt grows by the
  image's tokens (64 x 64: 4, 128 x 128: 16, plus the vision start and end tokens); prefix caching
  reuses a prompt's blocks only with the same image;
- not an image, too many pixels, too many images, an http URL: 400 with the reason, and the
  server answers the next request;
- Anthropic messages (the official SDK): a base64 image block is answered, its image tokens in
  the prompt (patch 0086: the engine's processor choice reaches every route); a bad one is a 400
  in Anthropic's shape;
- `qwen38 validate apis` and `validate clients` (the official SDKs) run their image checks against it;
- the shipped `cpu` profile (a target without a tower) refuses VISION=true in one line;
- `qwen38 plan` refuses `single`'s own pool with VISION=true and names the pool that fits.
"""

from __future__ import annotations

import json
import re
import time

import anthropic
import openai
import pytest

from tests.conftest import CACHE_PREFIX_TOKENS, clean_env, launch_server, run_cli, stop_server, wait_ready
from tests.support.vision_serving import (
    BAD_IMAGE_BLOCKS,
    BAD_IMAGES,
    MAX_PIXELS,
    MODEL,
    cached_image_prompt,
    chat,
    image_block,
    image_part,
    message,
    png,
    respond,
    vision_models,
    vision_profiles,
)

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_root, api_key_file):
    tmp = tmp_path_factory.mktemp("vision-serving")
    models = vision_models(tmp / "models", tiny_root)
    profiles = vision_profiles(tmp / "profiles")
    launched = launch_server(tmp, models, api_key_file, "cpu-vision", PROFILES_DIR=str(profiles), VISION="true",
                             VISION_MAX_PIXELS=str(MAX_PIXELS))
    yield wait_ready(launched)
    stop_server(launched)


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_an_image_through_the_openai_sdk_is_answered_with_its_tokens_in_the_prompt(openai_client):
    text = chat(openai_client).usage.prompt_tokens
    small = chat(openai_client, image_part(png((64, 64))))
    large = chat(openai_client, image_part(png((128, 128))))
    assert small.choices[0].message.content and small.usage.completion_tokens == 8
    # 16 x 16 patches merged 2 x 2: 64 x 64 is 4 image tokens, 128 x 128 is 16; + vision start/end
    assert small.usage.prompt_tokens - text == 4 + 2
    assert large.usage.prompt_tokens - text == 16 + 2


def test_an_image_through_the_responses_api_is_answered(openai_client):
    response = respond(openai_client, png((64, 64)))
    assert response.usage.output_tokens > 0 and response.output


def test_prefix_caching_reuses_a_prompt_only_with_the_same_image(server, openai_client):
    """Two images of one size give the same prompt ids; vLLM keys the cached blocks by the
    image's hash too, so the second image's prompt is computed afresh (0 cached tokens) while
    a repeat of either reuses its blocks."""
    from entrypoint.client import StackClient
    from entrypoint.validate.cache_isolation import unique_prefix

    with StackClient(server.base_url, server.api_key) as client:
        text = unique_prefix(client, MODEL, CACHE_PREFIX_TOKENS)

    def cached(color) -> tuple[int, int]:
        return cached_image_prompt(openai_client, png((64, 64), color), text)

    red, blue = (200, 0, 0), (0, 0, 200)
    first = [cached(red) for _ in range(3)]
    other = cached(blue)
    assert first[0][1] == 0 and max(hits for _, hits in first[1:]) > 0
    assert other == (first[0][0], 0)  # the same prompt length, nothing reused from the red image's blocks
    assert max(cached(blue)[1], cached(blue)[1]) > 0 and cached(red)[1] > 0


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_a_bad_image_is_a_400_with_the_reason_and_the_server_keeps_serving(openai_client, case):
    parts, reason = BAD_IMAGES[case]
    began = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        chat(openai_client, *parts)
    assert refused.value.status_code == 400
    assert reason in refused.value.message
    assert time.monotonic() - began < 10  # refused before anything is fetched or encoded
    after = chat(openai_client, image_part(png((64, 64))))
    assert after.usage.completion_tokens == 8


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("case", BAD_IMAGE_BLOCKS)
def test_a_bad_anthropic_image_block_is_a_400_in_anthropics_shape(anthropic_client, case):
    block, reason = BAD_IMAGE_BLOCKS[case]
    with pytest.raises(anthropic.BadRequestError) as refused:
        message(anthropic_client, block)
    assert refused.value.status_code == 400
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert reason in refused.value.body["error"]["message"]
    assert message(anthropic_client).usage.output_tokens > 0


def test_an_anthropic_image_block_is_answered_with_its_image_tokens(anthropic_client):
    """The CPU build reads the image with the PIL processor the engine was given (patch 0086),
    so the Anthropic route, which carries no per-request processor options, is answered too."""
    text, image = message(anthropic_client), message(anthropic_client, image_block(png((64, 64))))
    assert image.usage.output_tokens > 0 and image.content[0].type == "text"
    assert image.usage.input_tokens - text.usage.input_tokens == 4 + 2  # 64 x 64: 4 tokens, start and end


def test_validate_apis_checks_images_on_a_server_with_vision_on(server):
    done = run_cli("validate", "apis", "--base-url", server.base_url, "--json",
                   env={**server.env, "VLLM_API_KEY": server.api_key, "API_KEY_FILE": ""})
    report = json.loads(done.stdout)
    outcomes = {check["name"]: check["outcome"] for check in report["checks"]}
    assert done.returncode == 0, [c for c in report["checks"] if c["outcome"] != "pass"]
    for name in ("image chat", "image messages", "not an image -> 400", "image URL -> 400"):
        assert outcomes[name] == "pass", name


def test_validate_clients_sends_images_through_both_sdks(server):
    done = run_cli("validate", "clients", "--base-url", server.base_url, "--json",
                   env={**server.env, "VLLM_API_KEY": server.api_key, "API_KEY_FILE": ""})
    report = json.loads(done.stdout)
    outcomes = {check["name"]: check for check in report["checks"]}
    for name in ("openai image chat", "anthropic image message", "openai not an image -> 400",
                 "anthropic not an image -> 400"):
        assert outcomes[name]["outcome"] == "pass", outcomes[name]
    assert outcomes["openai image chat"]["detail"].endswith("prompt tokens with the image")
    assert done.returncode == 0, [c for c in report["checks"] if c["outcome"] != "pass"]


def test_the_shipped_cpu_profile_refuses_vision_in_one_line(tmp_path, tiny_root, api_key_file):
    launched = launch_server(tmp_path, tiny_root, api_key_file, "cpu", VISION="true")
    try:
        launched.process.wait(timeout=300)
    finally:
        stop_server(launched)
    lines = [line for line in launched.log.read_text().splitlines() if line.startswith("qwen38: ")]
    assert launched.process.returncode != 0
    assert lines[-1].startswith("qwen38: settings: VISION=true: profile cpu's target has no vision tower "
                                "(no vision_config in "), lines
    assert lines[-1].endswith("tiny/target/config.json); serve a vision-language checkpoint "
                              "(Qwen3_5ForConditionalGeneration) or unset VISION"), lines


def test_plan_refuses_singles_own_pool_with_vision_and_the_pool_it_names_fits(tmp_path):
    """`qwen38 plan` (vLLM's own arithmetic in its child) on the 3090 profile: the tower and the
    encoder cache come out of the text-sized pool, and the line names the pool and context that fit."""
    env = {"VISION": "true", "CACHE_DIR": str(tmp_path / "cache"), "MODELS_DIR": str(tmp_path / "models")}
    refused = run_cli("plan", "--profile", "single", "--no-compare", env=clean_env(**env), cwd=tmp_path)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0
    assert last.startswith("qwen38: plan: VISION=true: profile single's KV pool (5,583,457,484 bytes) is sized "
                           "for the text model alone; the vision tower (921,460,192 bytes, ")
    named = re.search(r"set KV_CACHE_MEMORY_BYTES=(\d+) \(it holds requests of up to ([\d,]+) tokens", last)
    pool, context = named.group(1), named.group(2).replace(",", "")
    assert int(pool) == 5_583_457_484 - 921_460_192 - 2048 * 5120 * 2
    fits = run_cli("plan", "--profile", "single", "--no-compare", "--json", cwd=tmp_path,
                   env=clean_env(**env, KV_CACHE_MEMORY_BYTES=pool, MAX_MODEL_LEN=context))
    plan = json.loads(fits.stdout)
    assert fits.returncode == 0 and plan["fits"] and plan["vision"]["tower_bytes"] == 921_460_192
    assert plan["serving"]["max_model_len_that_fits"] >= int(context)
