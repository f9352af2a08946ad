"""Images in on the GPU (issue 58): tiny copies of `single` and `spark-lora` served with VISION=true.

Each copy keeps its profile's engine settings (tests/gpu/tiny_profiles.py: DFlash2 K=7, KV dtype,
prefix caching, CUDA graphs, the GDN Triton prefill, a shared GPU) with the tiny target that has a
tower (`qwen38 generate --size tiny-vision`, tests/support/vision_serving.py) and the tiny DFlash2
drafter. `spark-lora`'s copy serves its adapter id too: the tiny vision target's rank-1 adapter, built
by the converter an owner's `qwen38 prepare --profile spark-lora` runs (`derive_vision`).

The pool is the one `qwen38 plan` names: with VISION=true it refuses the copy's own pinned pool
(sized for text alone) and says the pool that leaves room for the tower and the encoder cache; each
server is started with that KV_CACHE_MEMORY_BYTES, as an owner would, and `qwen38 serve` then runs
verify, plan, launch and the readiness gate. Checked on each server:

- the gate passes, the engine profiled the tower's encoder, and the pool `qwen38 serve` planned is
  the pool the CUDA engine logs;
- a PNG data URL through the official OpenAI SDK (chat completions, Responses) and a base64 image
  block through the official Anthropic SDK are answered, the image's tokens in the prompt;
- an image URL on the one host VISION_URL_DOMAINS lists (a web server of the test's) is fetched
  and answered with its data URL's prompt (OpenAI `image_url`, Anthropic `url` source);
- the bad images of the CPU suite (tests/support/vision_serving.py) are 400s with the reason, and
  the server answers the next image;
- `qwen38 validate apis` and `validate clients` pass with their image rows;
- a repeated image prompt hits the prefix cache on its second sending, and the same text with
  another image reuses nothing;
- on `spark-lora`, the adapter id answers an image chat with the adapter applied, and an image
  prompt's blocks never pass from the base id to the adapter id (each id's repeat reuses its own);
- `single`'s copy keeps the tower's blocks and merger in host memory (VISION_TOWER=host, its RTX
  3090 default, patch 0087): a third server, the same copy with the tower on the device, answers a
  noise image with the same greedy tokens and log-probabilities.

Figures (tests/gpu/conftest.py `record`, under ``vision.``): ready seconds, the pool the planner
named, the tower and encoder cache it counted, the encoder budget the engine logged, and the time
to first token of an image chat beside a text one.
"""

from __future__ import annotations

import json
import re
import statistics
import time

import anthropic
import openai
import pytest

from entrypoint.client import StackClient
from entrypoint.validate.cache_isolation import unique_prefix
from tests.conftest import clean_env, run_cli
from tests.gpu.conftest import record
from tests.gpu.tiny_profiles import (
    SHARE,
    TINY_KV_BYTES,
    TinyServers,
    check_plan_is_engine_pool,
    derive_vision,
    write_profiles,
)
from tests.support.prefix_cache import kv_block_tokens
from tests.support.vision_serving import (
    ADAPTER_MODEL,
    BAD_IMAGE_BLOCKS,
    BAD_IMAGES,
    IMAGE_HOST,
    MAX_PIXELS,
    MODEL,
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
    message,
    png,
    refused_then_answered,
    respond,
    vision_models,
)

pytestmark = pytest.mark.gpu

# key (the real profile) -> its tiny vision copy's profile file
PROFILES = {"single": "single-vision-tiny", "spark-lora": "spark-lora-vision-tiny"}
# Image URLs from a web server of the test's (`image_host`) only.
VISION = {"VISION": "true", "VISION_MAX_PIXELS": str(MAX_PIXELS), "VISION_URL_DOMAINS": IMAGE_HOST}
# Answers in `content`, as the `cpu` profile gives them: the tiny model never closes a reasoning
# block, so with the GPU profiles' default (thinking on) every answer would be all reasoning, and
# `validate clients` wants content from a plain chat. Per request, thinking still switches on.
THINKING_OFF = {"ENABLE_THINKING": "false"}
# `qwen38 plan`'s refusal of a text-sized pool (entrypoint/vision_memory.py `vision_refusal`)
# (the first figure: the tower's bytes on the device, all of it or, with VISION_TOWER=host, its part)
REFUSAL = re.compile(
    r"the vision tower(?:'s part on the device)? \(([\d,]+) (?:of its [\d,]+ )?bytes[, ].*\) and the encoder cache "
    r"\(([\d,]+) bytes: ([\d,]+) tokens\) need "
    r"[\d,]+ of it: set KV_CACHE_MEMORY_BYTES=(\d+) \((?:it holds requests of up to ([\d,]+) tokens)?"
)
# Patch 0087's line (`single`'s copy keeps the tower in host memory, the RTX 3090 default).
TOWER_IN_HOST = re.compile(r"qwen38: vision tower in host memory: (\d+) bytes of its blocks and merger")
# `single`'s copy again with the tower on the device: the reference the host-memory tower answers as.
# A profile file of its own: `qwen38 serve` refuses a second server of one profile on one
# CACHE_DIR (the 2026-12-07 lease: "already being served from this CACHE_DIR").
TOWER_ON_DEVICE = {"VISION_TOWER": "gpu"}
TOWER_ON_DEVICE_PROFILE = "single-vision-tower-gpu-tiny"
ENCODER_BUDGET = re.compile(r"Encoder cache will be initialized with a budget of (\d+) tokens")
MODEL_LOADING = re.compile(r"Model loading took ([\d.]+) GiB memory")


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def vision_pool(profiles_dir, models, tmp, name: str, **extra: str) -> tuple[dict[str, str], dict[str, int]]:
    """`qwen38 plan`'s refusal of ``name``'s own pool with VISION=true (and ``extra`` settings),
    read into the settings it says to add (KV_CACHE_MEMORY_BYTES, and MAX_MODEL_LEN where the
    smaller pool holds less) and what it counted (the tower's bytes on the device, the encoder
    cache's bytes and tokens)."""
    env = clean_env(**VISION, **extra, PROFILES_DIR=str(profiles_dir), MODELS_DIR=str(models),
                    CACHE_DIR=str(tmp / "plan"))
    done = run_cli("plan", "--profile", name, "--no-compare", env=env, cwd=tmp)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert done.returncode != 0, f"plan took {name}'s own pool with VISION=true:\n{done.stdout[-2000:]}"
    assert last.startswith(f"qwen38: plan: VISION=true: profile {name}'s KV pool ({TINY_KV_BYTES:,} bytes) is "
                           "sized for the text model alone; "), done.stderr[-3000:]
    found = REFUSAL.search(last)
    assert found, last
    settings = {"KV_CACHE_MEMORY_BYTES": found[4]}
    if "set MAX_MODEL_LEN=" in last:
        settings["MAX_MODEL_LEN"] = str(_number(found[5]))
    counted = {"device_tower_bytes": _number(found[1]), "encoder_cache_bytes": _number(found[2]),
               "encoder_cache_tokens": _number(found[3]), "kv_cache_memory_bytes": int(found[4])}
    return settings, counted


def torchvision_version() -> str:
    """torchvision's version, recorded; without it no engine here could start. On CUDA the stack
    leaves vLLM's Qwen3-VL processing the fast image processor (`entrypoint.resolve.processor_kwargs`
    chooses PIL on the CPU platform only), which transformers builds on torchvision, and the engine's
    start-up encoder profiling runs it: fail in one line before two engines are started for nothing."""
    try:
        import torchvision
    except Exception as exc:  # absent, or built for another torch (its operators fail to register)
        pytest.fail(f"torchvision does not import on this GPU machine ({type(exc).__name__}: {exc}): the CUDA "
                    "image processor needs it; install the torchvision wheel matching this torch", pytrace=False)
    record("vision.torchvision", torchvision.__version__)
    return torchvision.__version__


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_root, api_key_file):
    """`single`'s copy first, alone (it fills the JIT caches both share), then `spark-lora`'s,
    which starts while `single` is checked."""
    torchvision_version()
    tmp = tmp_path_factory.mktemp("vision-gpu")
    models = vision_models(tmp / "models", tiny_root)
    profiles = {name: derive_vision(key, extra_engine=SHARE) for key, name in PROFILES.items()}
    profiles[TOWER_ON_DEVICE_PROFILE] = derive_vision("single", extra_engine=SHARE)
    planned = write_profiles(tmp / "profiles", profiles)
    served = {}
    for key, name in PROFILES.items():
        settings, counted = vision_pool(planned, models, tmp, name)
        record(f"vision.{key}.planned", counted)
        served[key] = (name, {**VISION, **THINKING_OFF, **settings})
    settings, counted = vision_pool(planned, models, tmp, TOWER_ON_DEVICE_PROFILE, **TOWER_ON_DEVICE)
    record("vision.single-tower-gpu.planned", counted)
    served["single-tower-gpu"] = (TOWER_ON_DEVICE_PROFILE,
                                  {**VISION, **THINKING_OFF, **TOWER_ON_DEVICE, **settings})
    s = TinyServers(tmp_path_factory, models, api_key_file, profiles, served, label="vision.")
    with s.started("single", "spark-lora", "single-tower-gpu"):
        yield s


@pytest.fixture
def server(servers, request):
    return servers.gated(request.param)


@pytest.fixture
def openai_client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=300)


@pytest.fixture
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


def _key(server) -> str:
    return next(key for key, name in PROFILES.items() if name == server.profile)


def _colour(i: int) -> tuple[int, int, int]:
    """A colour no other request of this module sends (a fresh image: nothing cached for it)."""
    return (17 + 13 * i) % 256, (101 + 29 * i) % 256, (7 + 53 * i) % 256


def _validate(server, validator: str, image_rows: tuple[str, ...]) -> None:
    """`qwen38 validate VALIDATOR --json` against ``server``: its image rows pass, then all of it."""
    done = run_cli("validate", validator, "--json", "--base-url", server.base_url, "--api-key", server.api_key,
                   env=server.env, timeout=600)
    try:
        checks = json.loads(done.stdout)["checks"]
    except (ValueError, KeyError):
        raise AssertionError(f"validate {validator}: no report\n{done.stdout[-2000:]}{done.stderr[-3000:]}") from None
    outcomes = {check["name"]: check["outcome"] for check in checks}
    for name in image_rows:
        assert outcomes.get(name) == "pass", (name, [c for c in checks if c["name"] == name] or sorted(outcomes))
    assert done.returncode == 0, [check for check in checks if check["outcome"] != "pass"]


def _first_token_seconds(client, *parts: dict) -> float:
    """Seconds from sending a streamed chat to its first chunk (vLLM sends it with the first token)."""
    began, first = time.perf_counter(), None
    for chunk in chat(client, *parts, stream=True):
        if first is None and chunk.choices:
            first = time.perf_counter() - began
    assert first is not None, "the stream carried no choice"
    return first


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_profile_passes_the_gate_with_vision_on_and_plans_the_pool_the_engine_builds(server):
    status = server.status()
    assert status["ready"] is True
    log = server.log.read_text(errors="replace")
    assert "(patched vLLM)" in log, log[-3000:]
    budget, loading = ENCODER_BUDGET.search(log), MODEL_LOADING.search(log)
    assert budget, f"the engine did not profile the vision encoder:\n{log[-3000:]}"
    with StackClient(server.base_url, server.api_key) as client:
        assert client.model_ids() == ([MODEL, ADAPTER_MODEL] if server.profile == PROFILES["spark-lora"] else [MODEL])
    key = _key(server)
    record(f"vision.{key}.engine", {"encoder_budget_tokens": int(budget[1]),
                                    "model_loading_gib": float(loading[1]) if loading else None})
    check_plan_is_engine_pool(log, f"vision.{key}")


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_an_image_through_the_openai_sdk_is_answered_with_its_tokens_in_the_prompt(server, openai_client):
    text = chat(openai_client)
    image = chat(openai_client, image_part(png((64, 64), _colour(0))))
    assert image.usage.completion_tokens > 0 and image.choices[0].message.content, image
    # 16 x 16 patches merged 2 x 2: 64 x 64 is 4 image tokens; + vision start and end
    assert image.usage.prompt_tokens - text.usage.prompt_tokens == 4 + 2


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_an_image_through_the_responses_api_is_answered(server, openai_client):
    response = respond(openai_client, png((64, 64), _colour(1)))
    assert response.usage.output_tokens > 0 and response.output


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_an_anthropic_image_block_is_answered_with_its_image_tokens(server, anthropic_client):
    text, image = message(anthropic_client), message(anthropic_client, image_block(png((64, 64), _colour(2))))
    assert image.usage.output_tokens > 0 and image.content[0].type == "text", image
    assert image.usage.input_tokens - text.usage.input_tokens == 4 + 2


@pytest.mark.parametrize("case", BAD_IMAGES)
@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_a_bad_image_is_a_400_with_the_reason_and_the_server_keeps_serving(server, openai_client, case):
    assert refused_then_answered(openai_client, *BAD_IMAGES[case]).usage.completion_tokens > 0


@pytest.mark.parametrize("case", BAD_IMAGE_BLOCKS)
@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_a_bad_anthropic_image_block_is_a_400_in_anthropics_shape(server, anthropic_client, case):
    anthropic_refused(anthropic_client, *BAD_IMAGE_BLOCKS[case])
    assert message(anthropic_client, image_block(png((64, 64)))).usage.output_tokens > 0


@pytest.fixture(scope="module")
def images():
    with image_host() as host:
        yield host


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_an_image_url_on_the_listed_host_is_fetched_and_answered_like_its_data_url(server, openai_client,
                                                                                    anthropic_client, images):
    check_url_fetched_like_data_url(openai_client, anthropic_client, images)


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_validate_apis_passes_its_image_checks(server):
    _validate(server, "apis", ("image chat", "image messages", "not an image -> 400", "image URL -> 400"))


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_validate_clients_sends_images_through_both_sdks(server):
    _validate(server, "clients", ("openai image chat", "anthropic image message", "openai not an image -> 400",
                                  "anthropic not an image -> 400"))


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_a_repeated_image_prompt_hits_the_cache_on_its_second_sending(server, openai_client):
    """An image and text of four blocks and a part: the repeat reuses whole blocks on its second
    sending (as a text prompt does, test_profiles_gpu), and the same text after another image of
    the same size (the same prompt ids) reuses nothing: vLLM keys the blocks by the image's hash."""
    block = kv_block_tokens(server.log.read_text(errors="replace"))
    with StackClient(server.base_url, server.api_key) as client:
        text = unique_prefix(client, MODEL, 4 * block + 130)
    first, other = png((64, 64), _colour(3)), png((64, 64), _colour(4))
    sent = [cached_image_prompt(openai_client, first, text) for _ in range(3)]
    another = cached_image_prompt(openai_client, other, text)
    hits = [cached for _, cached in sent]
    record(f"vision.{_key(server)}.repeat_hits", {"prompt": sent[0][0], "block": block, "cached": hits,
                                                   "another_image": another[1]})
    assert hits[0] == 0 and hits[1] == hits[2] > 0 and hits[1] % block == 0, hits
    assert another == (sent[0][0], 0), another


@pytest.mark.parametrize("server", PROFILES, indirect=True)
def test_time_to_first_token_of_an_image_chat(server, openai_client):
    """Figures, with one assertion: a fresh 256 x 256 image (64 image tokens, the largest the tiny
    processor takes) is answered by stream. Each image is new, so its encoder runs every time."""
    text = [_first_token_seconds(openai_client) for _ in range(3)]
    image = [_first_token_seconds(openai_client, image_part(png((256, 256), _colour(10 + i)))) for i in range(3)]
    record(f"vision.{_key(server)}.ttft_s", {
        "text": [round(s, 4) for s in text], "image_256x256": [round(s, 4) for s in image],
        "text_median": round(statistics.median(text), 4), "image_median": round(statistics.median(image), 4),
    })
    assert all(s > 0 for s in image)


@pytest.mark.parametrize("server", ["spark-lora"], indirect=True)
def test_the_adapter_id_answers_an_image_chat_with_the_adapter_applied(server, openai_client):
    check_adapter_applied_to_images(openai_client)


@pytest.mark.parametrize("server", ["spark-lora"], indirect=True)
def test_prefix_caching_keeps_an_image_prompt_of_the_base_id_from_the_adapter_id(server, openai_client):
    block = kv_block_tokens(server.log.read_text(errors="replace"))
    steps = image_cache_isolation(openai_client, server.base_url, server.api_key, 4 * block + 130)
    record("vision.spark-lora.adapter_cache_isolation", {step: list(v) for step, v in steps.items()})
    check_image_cache_isolation(steps)


def _noise_png(size: tuple[int, int], seed: int) -> bytes:
    """A PNG of seeded noise: every patch differs, so the tower's output depends on all of it."""
    import io
    import random

    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3)).save(out, format="PNG")
    return out.getvalue()


def test_the_tower_in_host_memory_answers_as_on_the_device(servers):
    """`single`'s copy serves with the tower's blocks and merger in host memory (VISION_TOWER=host,
    its RTX 3090 default; patch 0087), the other copy with all of it on the device: the engine says
    how many bytes it moved (what the planner left off the device), and a noise image's greedy
    answer is the same tokens with the same log-probabilities on both."""
    host, device = servers.gated("single"), servers.gated("single-tower-gpu")
    host_log, device_log = (server.log.read_text(errors="replace") for server in (host, device))
    moved = TOWER_IN_HOST.search(host_log)
    assert moved and int(moved[1]) > 0, host_log[-3000:]
    assert TOWER_IN_HOST.search(device_log) is None
    loading = {name: MODEL_LOADING.search(log) for name, log in (("host", host_log), ("device", device_log))}
    record("vision.tower_in_host", {"moved_bytes": int(moved[1]), **{
        f"model_loading_gib_{name}": float(found[1]) if found else None for name, found in loading.items()}})
    answers = []
    for server in (host, device):
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=300)
        reply = chat(client, image_part(_noise_png((256, 192), 5)), logprobs=True, top_logprobs=3)
        answers.append([(t.token, t.logprob) for t in reply.choices[0].logprobs.content])
    assert [token for token, _ in answers[0]] == [token for token, _ in answers[1]], answers
    assert max(abs(a[1] - b[1]) for a, b in zip(*answers)) < 1e-3, answers
