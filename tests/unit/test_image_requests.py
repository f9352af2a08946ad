"""Our API layer's image checks (entrypoint/image_requests.py): where each API names its images,
the refusals with their reasons, the CPU build's processor options added to OpenAI requests, and
the ASGI layer handing vLLM the (rewritten) body. The served end to end: test_vision_serving."""

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
    assert check_request("/v1/chat/completions", chat(), None) is None


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
        (chat("http://10.0.0.1/x.png"), CPU, "not fetched by this server (http)"),
        (chat("file:///etc/passwd"), CPU, "not fetched by this server (file)"),
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
        assert check_request("/v1/chat/completions", chat(url((256, 256), kind)), GPU) is None


def test_an_anthropic_base64_image_passes_like_an_openai_data_url():
    """Patch 0086 gives the engine its processor choice, so no route needs a request's own
    options: an image that passes the checks goes on by whichever API it came."""
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded()}}
    for limits in (CPU, GPU):
        assert check_request("/v1/messages", {"messages": [{"role": "user", "content": [block]}]}, limits) is None
        assert check_request("/v1/chat/completions", chat(url()), limits) is None


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
