"""Our API layer's image checks (entrypoint/image_requests.py): where each API names its images,
the refusals with their reasons, which image URLs pass (VISION_URL_DOMAINS' hosts only) and how
vLLM's failed fetches reach the client, the CPU build's processor options added to OpenAI
requests, and the ASGI layer handing vLLM the (rewritten) body. The served end to end:
test_vision_serving."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
from PIL import Image

from entrypoint.image_requests import (
    VISION_OFF_MESSAGE,
    ImageLimits,
    ImageRefused,
    ImageRequestGuard,
    check_request,
    request_images,
)

CPU = ImageLimits(images_per_prompt=1, max_pixels=65_536)  # the names of the two limits the tests use
GPU = ImageLimits(images_per_prompt=2, max_pixels=65_536)
LAN = ImageLimits(images_per_prompt=2, max_pixels=65_536, url_domains=("images.lan", "10.0.0.5"))
NOT_LISTED = "image URLs are fetched only from hosts in VISION_URL_DOMAINS"


def encoded(size=(64, 64), kind="PNG") -> str:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(out, format=kind)
    return base64.b64encode(out.getvalue()).decode()


def url(size=(64, 64), kind="PNG") -> str:
    return f"data:image/{kind.lower()};base64,{encoded(size, kind)}"


def chat(*urls: str, **extra) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}], **extra}


def test_every_api_names_its_images_where_we_look():
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url()}]}]}
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded()}}
    tool_result = {"type": "tool_result", "tool_use_id": "t", "content": [block]}
    anthropic = {"messages": [{"role": "user", "content": [block, tool_result]}]}
    assert request_images("/v1/chat/completions", chat(url(), "https://x/y.png")) == [url(), "https://x/y.png"]
    assert request_images("/v1/responses", responses) == [url()]
    assert request_images("/v1/messages", anthropic) == [url(), url()]
    assert request_images("/v1/chat/completions", {"messages": [{"role": "user", "content": "text only"}]}) == []


def test_a_request_without_images_passes_untouched_even_with_vision_off():
    assert check_request("/v1/chat/completions", chat(), None) == []


@pytest.mark.parametrize(
    "body, limits, reason",
    [
        (chat(url()), None, VISION_OFF_MESSAGE),
        (chat(url(), url()), CPU, "2 images in one request, above this server's 1 (VISION_IMAGES_PER_PROMPT)"),
        (chat(url((257, 256))), CPU, "257 x 256 = 65,792 pixels, above this server's 65,536 (VISION_MAX_PIXELS)"),
        (chat("data:image/png;base64," + base64.b64encode(b"%PDF-1.7").decode()), CPU, "is not an image"),
        (chat(url(kind="BMP")), CPU, "image format BMP is not accepted: send a PNG, JPEG, WebP or GIF"),
        (chat("data:image/png;base64,!!!"), CPU, "does not decode"),
        (chat("data:image/png,rawbytes"), CPU, "must be base64"),
        (chat("http://10.0.0.1/x.png"), CPU, f"{NOT_LISTED} (unset: none); host 10.0.0.1 is not one: send"),
        (chat("file:///etc/passwd"), CPU, f"{NOT_LISTED} (unset: none); a file URL is never fetched"),
    ],
    ids=["vision off", "too many", "too many pixels", "not an image", "bmp", "bad base64", "not base64", "http",
         "file"],
)
def test_a_bad_image_is_refused_with_its_reason(body, limits, reason):
    with pytest.raises(ImageRefused, match=".*") as refused:
        check_request("/v1/chat/completions", body, limits)
    assert reason in str(refused.value)


def test_jpeg_webp_and_gif_at_the_cap_are_taken():
    for kind in ("JPEG", "WEBP", "GIF"):
        assert check_request("/v1/chat/completions", chat(url((256, 256), kind)), GPU) == []


def test_an_anthropic_base64_image_passes_like_an_openai_data_url():
    """Patch 0086 gives the engine its processor choice, so no route needs a request's own
    options: an image that passes the checks goes on by whichever API it came."""
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded()}}
    for limits in (CPU, GPU):
        assert check_request("/v1/messages", {"messages": [{"role": "user", "content": [block]}]}, limits) == []
        assert check_request("/v1/chat/completions", chat(url()), limits) == []


def _call(guard: ImageRequestGuard, path: str, body: bytes) -> tuple[list[dict], list[dict]]:
    """One POST through ``guard``; what it sent back, and what the app behind it received."""
    seen: list[dict] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append({"headers": dict(scope["headers"]), "body": message["body"]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    chunks = [body[: len(body) // 2], body[len(body) // 2 :]]

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    guard.app = app
    asyncio.run(guard(scope, receive, send))
    return sent, seen


def test_the_layer_answers_400_in_each_apis_shape_and_vllm_never_sees_the_request():
    guard = ImageRequestGuard(None, CPU)
    sent, seen = _call(guard, "/v1/chat/completions", json.dumps(chat("https://x/y.png")).encode())
    assert sent[0]["status"] == 400 and not seen
    assert json.loads(sent[1]["body"])["error"]["type"] == "invalid_request_error"
    block = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    sent, seen = _call(guard, "/v1/messages", json.dumps({"messages": [{"role": "user", "content": [block]}]}).encode())
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 400 and not seen
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_the_layer_hands_vllm_an_accepted_image_request_as_it_came():
    raw = json.dumps(chat(url())).encode()
    sent, seen = _call(ImageRequestGuard(None, CPU), "/v1/chat/completions", raw)
    assert sent[0]["status"] == 200 and seen[0]["body"] == raw
    assert seen[0]["headers"][b"content-length"] == str(len(raw)).encode()


def test_the_layer_passes_a_text_request_through_byte_for_byte():
    raw = json.dumps(chat()).encode()
    sent, seen = _call(ImageRequestGuard(None, CPU), "/v1/chat/completions", raw)
    assert seen[0]["body"] == raw and sent[0]["status"] == 200


def test_an_image_part_spelled_with_json_escapes_is_still_read_and_refused():
    """The layer skips parsing a body that never says "image"; a \\u escape can spell it
    without those bytes, and vLLM decodes it: such a body is parsed and checked."""
    raw = json.dumps(chat("https://x/y.png")).encode().replace(b'"image_url"', b'"\\u0069mage_url"')
    assert b'"image_url"' not in raw and json.loads(raw) == chat("https://x/y.png")
    sent, seen = _call(ImageRequestGuard(None, CPU), "/v1/chat/completions", raw)
    assert sent[0]["status"] == 400 and not seen


def test_a_part_without_a_url_and_a_decompression_bomb_header_are_refused():
    with pytest.raises(ImageRefused, match="carries no URL"):
        check_request("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      CPU)
    # a 1-bit PNG of 20,000 x 20,000 pixels is a few kB; its header alone is refused
    out = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(out, format="PNG")
    with pytest.raises(ImageRefused, match=r"20000 x 20000 = 400,000,000 pixels|far more pixels"):
        check_request("/v1/chat/completions", chat("data:image/png;base64," + base64.b64encode(out.getvalue()).decode()),
                      CPU)


# ---- image URLs: VISION_URL_DOMAINS -------------------------------------------------------


@pytest.mark.parametrize("image", ["http://images.lan/cat.png", "https://images.lan:8443/a/b.jpg?x=1",
                                   "HTTPS://Images.LAN/cat.png", "http://10.0.0.5/cat.png"])
def test_a_url_on_a_listed_host_passes_whatever_its_case_port_or_path(image):
    assert check_request("/v1/chat/completions", chat(image), LAN) == [image]  # the URLs vLLM fetches


@pytest.mark.parametrize(
    "image, what",
    [
        ("http://cdn.images.lan/cat.png", "host cdn.images.lan is not one"),  # no subdomain matching
        ("http://images.lan.evil.example/cat.png", "host images.lan.evil.example is not one"),
        ("http://10.0.0.6/cat.png", "host 10.0.0.6 is not one"),
        ("http://[::1]/cat.png", "host [::1] is not one"),
        ("http://images.lan./cat.png", "host images.lan. is not one"),  # vLLM compares exactly too
        ("http://images.lan%2f@evil.example/x.png", "a URL with a user name or password is never fetched"),
        ("http://user:pw@images.lan/cat.png", "a URL with a user name or password is never fetched"),
        ("ftp://images.lan/cat.png", "a ftp URL is never fetched"),
        ("file://images.lan/etc/passwd", "a file URL is never fetched"),
        ("http://images lan/x.png", "the URL does not parse"),
    ],
)
def test_a_url_on_any_other_host_is_refused_naming_the_setting_and_its_value(image, what):
    with pytest.raises(ImageRefused) as refused:
        check_request("/v1/chat/completions", chat(image), LAN)
    assert str(refused.value).startswith(f"{NOT_LISTED} (images.lan,10.0.0.5); {what}: send the image inline")
    assert str(refused.value).endswith("or ask the owner to add the host")


def test_the_host_is_the_one_vllm_checks_and_fetches():
    """The layer reads a URL with urllib3's parse_url, as vLLM 0.28.0's allow-list and fetch do."""
    from vllm.multimodal.media.connector import parse_url

    for image in ("http://images.lan%2f@evil.example/x.png", "http://IMAGES.lan/x", "http://images.lan\\@e.x/"):
        passed = image in request_images("/v1/chat/completions", chat(image)) and _passes(image)
        assert passed == (parse_url(image).hostname in LAN.url_domains), image


def _passes(image: str) -> bool:
    try:
        check_request("/v1/chat/completions", chat(image), LAN)
    except ImageRefused:
        return False
    return True


def test_an_anthropic_url_source_follows_the_same_rule():
    def blocks(image: str) -> dict:
        return {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": image}}]}]}

    assert check_request("/v1/messages", blocks("https://images.lan/cat.png"), LAN) == ["https://images.lan/cat.png"]
    with pytest.raises(ImageRefused, match=r"VISION_URL_DOMAINS \(images.lan,10.0.0.5\); host example.com is not"):
        check_request("/v1/messages", blocks("https://example.com/cat.png"), LAN)
    with pytest.raises(ImageRefused, match=r"VISION_URL_DOMAINS \(unset: none\); host images.lan is not one"):
        check_request("/v1/messages", blocks("https://images.lan/cat.png"), GPU)


def test_urls_count_toward_the_images_per_prompt_limit():
    two = chat("http://images.lan/a.png", url())
    assert check_request("/v1/chat/completions", two, LAN) == ["http://images.lan/a.png"]
    with pytest.raises(ImageRefused, match=r"3 images in one request, above this server's 2"):
        check_request("/v1/chat/completions", chat("http://images.lan/a.png", "http://10.0.0.5/b.png", url()), LAN)


def test_the_layer_lets_a_listed_url_through_and_answers_400_for_another():
    guard = ImageRequestGuard(None, LAN)
    raw = json.dumps(chat("http://images.lan/cat.png")).encode()
    sent, seen = _call(guard, "/v1/chat/completions", raw)
    assert sent[0]["status"] == 200 and seen[0]["body"] == raw
    sent, seen = _call(guard, "/v1/chat/completions", json.dumps(chat("http://other.lan/cat.png")).encode())
    assert sent[0]["status"] == 400 and not seen
    assert "host other.lan is not one" in json.loads(sent[1]["body"])["error"]["message"]


def test_the_limits_reach_the_layer_through_its_environment_variable():
    env = json.dumps({"images_per_prompt": 2, "max_pixels": 65_536, "url_domains": ["images.lan", "10.0.0.5"]})
    assert ImageLimits.from_env(env) == LAN
    assert ImageLimits.from_env(json.dumps({"images_per_prompt": 1, "max_pixels": 65_536})) == CPU


def _answered_by_vllm(guard: ImageRequestGuard, path: str, body: dict, status: int, answer: dict) -> tuple[int, dict]:
    """One POST through ``guard`` to an app that answers ``status`` and ``answer``; what the client got."""
    sent: list[dict] = []

    async def app(scope, receive, send):
        await receive()
        payload = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": payload[:5], "more_body": True})
        await send({"type": "http.response.body", "body": payload[5:]})

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    guard.app = app
    asyncio.run(guard({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_500_answer_to_a_request_naming_a_url_becomes_a_422_that_says_so(monkeypatch):
    """Should vLLM answer a failed fetch with a 500 response of its own (0.28.0 raises instead:
    the test below), the client still gets a 422 naming the URL."""
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "5")
    guard = ImageRequestGuard(None, LAN)
    empty = {"error": {"message": "", "type": "InternalServerError", "param": None, "code": 500}}
    status, body = _answered_by_vllm(guard, "/v1/chat/completions", chat("http://images.lan/slow.png"), 500, empty)
    assert status == 422 and body["error"]["code"] == 422
    assert body["error"]["message"].startswith("the image URL(s) http://images.lan/slow.png could not be fetched "
                                               "(no reason given): no answer within VLLM_IMAGE_FETCH_TIMEOUT (5 s, ")
    block = {"type": "image", "source": {"type": "url", "url": "http://images.lan/slow.png"}}
    anthropic = {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    status, body = _answered_by_vllm(guard, "/v1/messages", {"messages": [{"role": "user", "content": [block]}]},
                                     500, anthropic)
    assert status == 422 and body["type"] == "error" and "could not be fetched" in body["error"]["message"]


def test_vllms_400_for_a_fetched_answer_that_is_not_an_image_says_what_the_url_must_answer():
    guard = ImageRequestGuard(None, LAN)
    load = {"error": {"message": "Failed to load image: cannot identify image file <_io.BytesIO object>",
                      "type": "BadRequestError", "param": None, "code": 400}}
    status, body = _answered_by_vllm(guard, "/v1/chat/completions", chat("http://images.lan/moved.png"), 400, load)
    assert status == 400
    assert body["error"]["message"] == (
        "Failed to load image: cannot identify image file <_io.BytesIO object>; the answer from "
        "http://images.lan/moved.png is not an image: the URL must answer 200 with the image itself (redirects "
        "are not followed)")
    not_found = {"error": {"message": "Failed to fetch media from URL: HTTP 404 error", "code": 422}}
    status, body = _answered_by_vllm(guard, "/v1/chat/completions", chat("http://images.lan/gone.png"), 422, not_found)
    assert (status, body["error"]["message"]) == (422, "Failed to fetch media from URL: HTTP 404 error")


def test_an_error_answer_to_a_request_with_inline_images_only_passes_untouched():
    answer = {"error": {"message": "", "code": 500}}
    status, body = _answered_by_vllm(ImageRequestGuard(None, LAN), "/v1/chat/completions", chat(url()), 500, answer)
    assert (status, body) == (500, answer)


def test_a_fetch_that_raises_past_vllms_handlers_becomes_a_422_that_names_the_url():
    """vLLM 0.28.0 lets a timeout and a refused connection (after its retries) out of its route as
    an exception, which Starlette's outermost layer answers with an empty 500 (measured in
    test_vision_serving): our layer answers 422 instead; any other error still propagates."""

    def raising(error: Exception):
        async def app(scope, receive, send):
            await receive()
            raise error
        return app

    async def receive():
        return {"type": "http.request", "body": json.dumps(chat("http://images.lan/x.png")).encode()}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    guard = ImageRequestGuard(raising(ConnectionRefusedError("Connect call failed")), LAN)
    asyncio.run(guard(scope, receive, send))
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert sent[0]["status"] == 422
    assert message.startswith("the image URL(s) http://images.lan/x.png could not be fetched (ConnectionRefusedError: "
                              "Connect call failed): no answer within VLLM_IMAGE_FETCH_TIMEOUT")
    guard = ImageRequestGuard(raising(KeyError("a bug")), LAN)
    with pytest.raises(KeyError):
        asyncio.run(guard(scope, receive, send))
