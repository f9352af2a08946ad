"""Images in, end to end (issue 58): `qwen38 serve` with VISION=true serves the tiny vision model
on vLLM 0.28.0's CPU build (`cpu-vision`: the `cpu` profile with the tiny-vision target and its
rank-1 adapter as the second id, built by `qwen38 adapter build`'s converter from that target:
tests/support/vision_serving.py), and the official SDKs see the answers and the 400s.

- OpenAI chat completions and Responses with a PNG data URL are answered; the prompt grows by the
  image's tokens (64 x 64: 4, 128 x 128: 16, plus the vision start and end tokens); prefix caching
  reuses a prompt's blocks only with the same image;
- the adapter id answers an image chat with the adapter applied (other tokens and logprobs than the
  base id's for the same prompt, the same image tokens in it), and the image reaches it; prefix
  caching never carries an image prompt's blocks from the base id to the adapter id, while a repeat
  to either id reuses them (`cached_tokens` and vLLM's prefix-cache hit counter);
- not an image, too many pixels, too many images, an http URL on a host not listed: 400 with the
  reason, and the server answers the next request;
- image URLs (VISION_URL_DOMAINS=127.0.0.1, a web server of the test's): a PNG there is fetched
  and answered with the data URL's prompt tokens (OpenAI and Anthropic `url` sources), one above
  the pixel cap shrunk to it; another host is the guard's 400 with nothing fetched; a redirect
  (not followed), a 404, not an image, a timeout and a refused connection are 4xx with the reason
  (never vLLM's empty 500), and the server keeps serving;
- Anthropic messages (the official SDK): a base64 image block is answered, its image tokens in
  the prompt (patch 0086: the engine's processor choice reaches every route); a bad one is a 400
  in Anthropic's shape;
- `qwen38 validate apis` and `validate clients` (the official SDKs) run their image checks against its base id;
- the shipped `cpu` profile (a target without a tower) refuses VISION=true in one line;
- `qwen38 plan` refuses `single`'s own pool with VISION=true and names the pool that fits;
- `qwen38 bench image` (distinct noise PNGs, then the text alone) against it, read by the full-scale
  run's figures; opt-in, the full-scale run's measurement of a copy served with VISION=true.
"""

from __future__ import annotations

import json
import os
import re
import time

import anthropic
import openai
import pytest

from tests.conftest import CACHE_PREFIX_TOKENS, clean_env, free_port, launch_server, run_cli, stop_server, wait_ready
from tests.support.vision_serving import (
    ADAPTER_MODEL,
    BAD_IMAGE_BLOCKS,
    BAD_IMAGES,
    IMAGE_HOST,
    MAX_PIXELS,
    MODEL,
    URL_REFUSED,
    anthropic_refused,
    cached_image_prompt,
    chat,
    check_adapter_applied_to_images,
    check_image_cache_isolation,
    check_url_fetched_like_data_url,
    image_block,
    image_cache_isolation,
    image_host,
    image_part,
    image_url_part,
    message,
    png,
    refused_then_answered,
    respond,
    vision_models,
    vision_profiles,
)

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_root, api_key_file):
    tmp = tmp_path_factory.mktemp("vision-serving")
    models = vision_models(tmp / "models", tiny_root)
    profiles = vision_profiles(tmp / "profiles", adapter=True)
    launched = launch_server(tmp, models, api_key_file, "cpu-vision", PROFILES_DIR=str(profiles), VISION="true",
                             VISION_MAX_PIXELS=str(MAX_PIXELS), VISION_URL_DOMAINS=IMAGE_HOST,
                             # vLLM's 5 s fetch timeout, tried thrice (x 4 each time), would hold the
                             # timeout test 110 s: 1 s makes it 26 s, and tests the same path.
                             VLLM_IMAGE_FETCH_TIMEOUT="1")
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


def test_the_adapter_id_answers_an_image_chat_with_the_adapter_applied(server, openai_client):
    assert server.status()["model_ids"] == [MODEL, ADAPTER_MODEL]
    check_adapter_applied_to_images(openai_client)


def test_prefix_caching_keeps_an_image_prompt_of_the_base_id_from_the_adapter_id(server, openai_client):
    steps = image_cache_isolation(openai_client, server.base_url, server.api_key, CACHE_PREFIX_TOKENS)
    print(f"\nan image prompt's (cached tokens, prefix-cache hits) by step: {steps}")
    check_image_cache_isolation(steps)


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_a_bad_image_is_a_400_with_the_reason_and_the_server_keeps_serving(openai_client, case):
    after = refused_then_answered(openai_client, *BAD_IMAGES[case])
    assert after.usage.completion_tokens == 8


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("case", BAD_IMAGE_BLOCKS)
def test_a_bad_anthropic_image_block_is_a_400_in_anthropics_shape(anthropic_client, case):
    anthropic_refused(anthropic_client, *BAD_IMAGE_BLOCKS[case])
    assert message(anthropic_client).usage.output_tokens > 0


def test_an_anthropic_image_block_is_answered_with_its_image_tokens(anthropic_client):
    """The CPU build reads the image with the PIL processor the engine was given (patch 0086),
    so the Anthropic route, which carries no per-request processor options, is answered too."""
    text, image = message(anthropic_client), message(anthropic_client, image_block(png((64, 64))))
    assert image.usage.output_tokens > 0 and image.content[0].type == "text"
    assert image.usage.input_tokens - text.usage.input_tokens == 4 + 2  # 64 x 64: 4 tokens, start and end


# The validators check the base id alone here: each check again for the adapter id cost ~30 s of the
# 2-core machine and proves what test_cpu_profile proves per id; the adapter id's images are the tests above.
def test_validate_apis_checks_images_on_a_server_with_vision_on(server):
    done = run_cli("validate", "apis", "--base-url", server.base_url, "--json", "--model", MODEL,
                   env={**server.env, "VLLM_API_KEY": server.api_key, "API_KEY_FILE": ""})
    report = json.loads(done.stdout)
    outcomes = {check["name"]: check["outcome"] for check in report["checks"]}
    assert done.returncode == 0, [c for c in report["checks"] if c["outcome"] != "pass"]
    for name in ("image chat", "image messages", "not an image -> 400", "image URL -> 400"):
        assert outcomes[name] == "pass", name


def test_validate_clients_sends_images_through_both_sdks(server):
    done = run_cli("validate", "clients", "--base-url", server.base_url, "--json", "--model", MODEL,
                   env={**server.env, "VLLM_API_KEY": server.api_key, "API_KEY_FILE": ""})
    report = json.loads(done.stdout)
    outcomes = {check["name"]: check for check in report["checks"]}
    for name in ("openai image chat", "anthropic image message", "openai not an image -> 400",
                 "anthropic not an image -> 400"):
        assert outcomes[name]["outcome"] == "pass", outcomes[name]
    assert outcomes["openai image chat"]["detail"].endswith("prompt tokens with the image")
    assert done.returncode == 0, [c for c in report["checks"] if c["outcome"] != "pass"]


def test_bench_image_measures_an_images_first_token_beside_the_texts(server, tmp_path):
    """`qwen38 bench image` (the full-scale run's `image` workload, at the tiny dry run's sizes):
    each request's own noise PNG, then the same text alone; the document is consistent (the
    prompt tokens /tokenize counts with the image are vLLM's usage) and the full-scale figures
    read it: 64 x 64 is 4 image tokens + the vision start and end."""
    from bench import fullscale_figures as figures
    from bench import fullscale_steps as fs

    out = tmp_path / "image.json"
    argv = fs.workload_argv(tmp_path, "cpu-vision", fs.Served("cpu", None, settings=(("VISION", "true"),)),
                            "image", 4096, "tiny")
    done = run_cli("bench", "image", "--base-url", server.base_url, "--model", MODEL, "--out", str(out), *argv,
                   env=clean_env(VLLM_API_KEY=server.api_key))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["workload"] == "image" and doc["consistent"] is True, [c for c in doc["checks"] if not c["ok"]]
    assert [p["label"] for p in doc["points"]] == ["image 64x64", "text only"]
    got = figures.image_figures(doc)
    assert got["image_tokens"] == 4 + 2 and (got["width"], got["height"]) == (64, 64)
    for kind in ("image", "text"):
        assert got[kind]["requests"] == 2 and 0 < got[kind]["ttft_s"]["min"] <= got[kind]["ttft_s"]["max"]
    # A new image each request: nothing of an image prompt came from the prefix cache.
    assert all((r.get("cached_tokens") or 0) == 0 for r in doc["requests"] if r["point"] == 0)
    row = figures.image_markdown({"cpu-vision": {"image": got}})[-1]
    assert row.startswith("| cpu-vision | - | - / - / - | 64 x 64 | 6 | ")


@pytest.mark.skipif(os.environ.get("QWEN38_FULLSCALE_TEST") != "1",
                    reason="opt-in like tests/integration/test_fullscale_run.py (QWEN38_FULLSCALE_TEST=1): the "
                    "full-scale run's measurement of a vision copy, ~50 s here (two planner runs, two benchmarks)")
def test_the_full_scale_runs_measurement_of_a_vision_copy_reads_c1_image_and_the_tower(server, tmp_path):
    """`bench fullscale measure` of a copy served with VISION=true (what `single-vision-full` gets on
    the GPU), at the dry run's sizes against this server: `c1` and `image` through the real
    benchmarks, the planner's view of the copy as served, the tower's bytes from the served
    checkpoint, and the report's image table. (The copy's start would first ask `qwen38 plan`
    for its pool, `fs.vision_settings`: on the CPU platform it names none; its reading of a GPU
    profile's refusal is tests/unit/test_fullscale_vision.py's. Kept as if asked: one planner
    run less, ~20 s here; the measurement's own plan, with the stock engine compared, stays.)"""
    import shutil

    from bench import fullscale_steps as fs

    root, profile = tmp_path / "run", "cpu-vision"
    shutil.copytree(server.env["PROFILES_DIR"], root / "profiles")
    (root / "models").symlink_to(server.env["MODELS_DIR"])
    (root / "api_key").write_text(server.api_key)
    port = int(server.base_url.rsplit(":", 1)[1])
    fs._write(root, f"{profile}.start", {"pid": server.process.pid, "port": port, "started": server.started_at})
    fs._write(root, f"{profile}.ready", {"ready": True, "ready_s": server.seconds_to_ready, "log": {}})
    fs._write(root, f"{profile}.vision", {"settings": {}, "refusal": None, "vision": None})
    copy = fs.Served("cpu", None, speculation=False, settings=(("VISION", "true"),), workloads=("c1", "image"))
    measure = fs.step_measure(root, profile, "tiny", copy=copy)
    assert measure["done"] and [b["exit"] for b in measure["bench"].values()] == [0, 0], measure["bench"]
    assert measure["image"]["image_tokens"] == 4 + 2 and measure["decode"]["c1"]["step_ms"] > 0
    vision = measure["vision"]
    assert vision["settings"] == {} and vision["text_only_copy"] is None
    assert vision["tower"]["tower_checkpoint_bytes"] == 561_024  # the tiny tower, counted in the served target
    assert measure["pool"]["plan_tokens"] > 0 and server.process.poll() is None
    report = fs.step_report(root, tmp_path / "out" / "fullscale.json", {profile: copy})
    text = (tmp_path / "out" / "fullscale.md").read_text()
    assert report["steps"] and "| cpu-vision | - | 0.00 / - / - | 64 x 64 | 6 | " in text, text


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
    """`qwen38 plan` (vLLM's own arithmetic in its child) on the 3090 profile: the tower's part on
    the device (VISION_TOWER=host, the 3090's default: 8.8 MB kept, the 89.7 MB merger while an image
    is encoded) and the encoder cache come out of the text-sized pool, and the line names the pool
    and context that fit (tests/unit/test_vision_memory.py: the whole tower with VISION_TOWER=gpu)."""
    env = {"VISION": "true", "CACHE_DIR": str(tmp_path / "cache"), "MODELS_DIR": str(tmp_path / "models")}
    refused = run_cli("plan", "--profile", "single", "--no-compare", env=clean_env(**env), cwd=tmp_path)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0
    assert last.startswith("qwen38: plan: VISION=true: profile single's KV pool (5,583,457,484 bytes) is sized "
                           "for the text model alone; the vision tower's part on the device (98,526,976 of its "
                           "921,460,192 bytes with VISION_TOWER=host, "), last
    named = re.search(r"set KV_CACHE_MEMORY_BYTES=(\d+) \(it holds requests of up to ([\d,]+) tokens", last)
    pool, context = named.group(1), int(named.group(2).replace(",", ""))
    assert int(pool) == 5_583_457_484 - 98_526_976 - 2048 * 5120 * 2
    # 120 MB less pool still holds `single`'s whole 65,536-token context: no MAX_MODEL_LEN to set.
    assert "set MAX_MODEL_LEN=" not in last and context >= 65_536, last
    fits = run_cli("plan", "--profile", "single", "--no-compare", "--json", cwd=tmp_path,
                   env=clean_env(**env, KV_CACHE_MEMORY_BYTES=pool))
    plan = json.loads(fits.stdout)
    assert fits.returncode == 0 and plan["fits"] and plan["vision"]["tower_bytes"] == 921_460_192
    assert plan["vision"]["device_tower_bytes"] == 98_526_976 and plan["vision"]["tower_place"] == "host"
    assert plan["serving"]["max_model_len_that_fits"] >= 65_536


# ---- image URLs from VISION_URL_DOMAINS' hosts ---------------------------------------------


@pytest.fixture(scope="module")
def images():
    with image_host() as host:
        yield host


def _url(images, path: str) -> str:
    return f"http://{IMAGE_HOST}:{images.server_address[1]}{path}"


def _fetch(server, url: str, path: str = "/v1/chat/completions", **extra) -> tuple[int, dict, float]:
    """One chat naming the image at ``url`` (raw HTTP: the status as sent); status, body, seconds."""
    import httpx

    content = [image_url_part(url), {"type": "text", "text": "What is in the picture?"}]
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    began = time.monotonic()
    answer = httpx.post(f"{server.base_url}{path}", json=body, timeout=300,
                        headers={"Authorization": f"Bearer {server.api_key}"})
    return answer.status_code, answer.json(), time.monotonic() - began


def test_an_image_url_on_the_listed_host_is_fetched_and_answered_like_its_data_url(openai_client, anthropic_client,
                                                                                    images):
    check_url_fetched_like_data_url(openai_client, anthropic_client, images)


def test_a_fetched_image_above_the_pixel_cap_is_shrunk_to_it_not_refused(openai_client, images):
    """The cap of a fetched image cannot be checked before vLLM fetches it: the processor
    (max_pixels 65,536) resizes 300 x 300 to 256 x 256, 64 image tokens, as it would any image."""
    text = chat(openai_client).usage.prompt_tokens
    fetched = chat(openai_client, image_url_part(_url(images, "/big.png")))
    assert fetched.usage.prompt_tokens - text == 64 + 2


def test_an_image_url_on_a_host_not_listed_is_a_400_from_the_guard(server, images):
    before = list(images.requests)
    status, body, _ = _fetch(server, f"http://localhost:{images.server_address[1]}/cat.png")
    assert status == 400
    assert body["error"]["message"].startswith(f"{URL_REFUSED} ({IMAGE_HOST}); host localhost is not one: send the "
                                               "image inline (OpenAI: data:image/png;base64,...")
    assert images.requests == before  # nothing fetched


@pytest.mark.parametrize(
    "path, status, reason",
    [
        ("/elsewhere.png", 400, "is not an image: the URL must answer 200 with the image itself (redirects are not "
                                "followed)"),
        ("/missing.png", 422, "Failed to fetch media from URL: HTTP 404 error"),
        ("/text.png", 400, "Failed to load image: cannot identify image file"),
        ("/slow.png", 422, "): no answer within VLLM_IMAGE_FETCH_TIMEOUT (1 s, one try)"),
        ("a port nothing listens on", 422, "could not be fetched (ClientConnectorError: Cannot connect to host"),
    ],
)
def test_a_failed_fetch_is_a_4xx_with_the_reason_and_the_server_keeps_serving(server, openai_client, images, path,
                                                                              status, reason):
    """vLLM 0.28.0 reads a redirect's body as the image (redirects are off: the host named in the
    redirect is never asked), answers a 404 with 422, and a timeout or a refused connection (after
    its three tries: 1 + 4 + 16 s of timeouts and 1 + 4 s of pauses here) with an empty 500, which
    our layer turns into a 422 that says so."""
    url = f"http://{IMAGE_HOST}:{free_port()}/cat.png" if " " in path else _url(images, path)
    answered, body, _ = _fetch(server, url)
    assert answered == status and reason in body["error"]["message"] and url in body["error"]["message"], body
    if path == "/elsewhere.png":
        assert images.requests[-1] == "/elsewhere.png"  # its target, /cat.png on "localhost", never asked
    assert chat(openai_client, image_url_part(_url(images, "/cat.png"))).usage.completion_tokens == 8
