"""Images in requests, checked before vLLM reads them: one clear 400 instead of a fetch, a
silent shrink or an engine error.

vLLM 0.28.0 fetches any http(s) image URL a request names (``--allowed-media-domains`` only
narrows the hosts; empty, it allows every one), shrinks an image above the processor's pixel
cap instead of refusing it, and (stock) fails inside its image processor on the CPU build (patch 0086 and
`entrypoint.resolve.processor_kwargs` mend that in the engine).
`ImageRequestGuard`, a layer of `entrypoint.asgi.StackMiddleware`, reads the JSON body of the
routes that take images (OpenAI chat completions and Responses, Anthropic messages) and
answers 400, in the shape of the route's API, for:

- an image that is not a base64 ``data:`` URL (an http(s) or file URL: the server fetches
  nothing), or an Anthropic ``url`` source;
- bytes that are not a PNG, JPEG, WebP or GIF image;
- more pixels (width x height) than VISION_MAX_PIXELS;
- more images in one request than VISION_IMAGES_PER_PROMPT;
- any image while VISION is off (vLLM would say "At most 0 image(s)").

A request without images passes untouched, and one whose images pass goes on as it came. The
limits reach the API server as the `VISION_ENV` variable (JSON of `ResolvedVision`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import os
from dataclasses import dataclass
from typing import Any

from entrypoint.auth import ASGIApp, Message, Receive, Scope, Send

VISION_ENV = "QWEN38_VISION"
VISION_OFF_MESSAGE = "this server takes no images (VISION is off)"
FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}
CHAT_PATHS = ("/v1/chat/completions", "/v1/responses")  # OpenAI's
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class ImageRefused(ValueError):
    """A request's image that the server will not read; the message says why and what to send."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry (None in `ImageRequestGuard`: vision is off)."""

    images_per_prompt: int
    max_pixels: int

    @classmethod
    def from_env(cls, value: str | None) -> ImageLimits | None:
        if not value:
            return None
        data = json.loads(value)
        return cls(data["images_per_prompt"], data["max_pixels"])


# ---- where a request names its images ---------------------------------------------------


def _part_image(part: Any) -> str | None:
    """The URL an OpenAI content part (chat's ``image_url``, Responses' ``input_image``) names."""
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image"):
        return None
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    return url if isinstance(url, str) else ""


def _block_image(block: Any) -> str | None:
    """An Anthropic ``image`` block as the data URL vLLM makes of it (a ``url`` source as its URL)."""
    if not isinstance(block, dict) or block.get("type") != "image":
        return None
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if source.get("type") == "url":
        return str(source.get("url") or "")
    return f"data:{source.get('media_type') or 'image/jpeg'};base64,{source.get('data') or ''}"


def _contents(items: Any) -> list[Any]:
    """Every content part of a list of messages (or Responses input items), tool results' too."""
    parts: list[Any] = []
    for item in items if isinstance(items, list) else []:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            for part in content:
                parts.append(part)
                inner = part.get("content") if isinstance(part, dict) else None
                if isinstance(inner, list):  # an Anthropic tool_result's own blocks
                    parts.extend(inner)
    return parts


def request_images(path: str, body: dict[str, Any]) -> list[str]:
    """The URLs of the images a request to ``path`` carries, in order."""
    if path in ANTHROPIC_PATHS:
        found = [_block_image(block) for block in _contents(body.get("messages"))]
    elif path == "/v1/responses":
        found = [_part_image(part) for part in _contents(body.get("input"))]
    else:
        found = [_part_image(part) for part in _contents(body.get("messages"))]
    return [url for url in found if url is not None]


# ---- one image ----------------------------------------------------------------------------


def image_bytes(url: str) -> bytes:
    """The bytes of a base64 ``data:`` URL; any other URL is refused (the server fetches nothing)."""
    if not url:
        raise ImageRefused("an image part carries no URL: send data:image/png;base64,<data>")
    if not url.lower().startswith("data:"):
        scheme = url.partition(":")[0] if ":" in url else "no scheme"
        raise ImageRefused(
            f"image URLs are not fetched by this server ({scheme}): send the image inline, as a base64 data URL "
            "(OpenAI: data:image/png;base64,...) or an Anthropic base64 source"
        )
    spec, comma, data = url[5:].partition(",")
    if not comma or not spec.lower().endswith(";base64"):
        raise ImageRefused("an image data URL must be base64: data:image/png;base64,<data>")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the image's base64 data does not decode") from None


def check_image(url: str, max_pixels: int) -> None:
    """Refuse an image that is not inline, not a PNG/JPEG/WebP/GIF, or above ``max_pixels``.

    Reads the header only (width and height are there); the pixels are decoded by vLLM."""
    from PIL import Image, UnidentifiedImageError

    raw = image_bytes(url)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            kind, (width, height) = image.format, image.size
    except Image.DecompressionBombError:  # a header declaring hundreds of megapixels
        raise ImageRefused(
            f"the image declares far more pixels than this server's {max_pixels:,}: send it smaller"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageRefused(
            f"the image data ({len(raw):,} bytes) is not an image: send a PNG, JPEG, WebP or GIF"
        ) from None
    if kind not in FORMATS:
        raise ImageRefused(f"image format {kind} is not accepted: send a PNG, JPEG, WebP or GIF")
    if width * height > max_pixels:
        raise ImageRefused(
            f"the image has {width} x {height} = {width * height:,} pixels, above this server's "
            f"{max_pixels:,} (VISION_MAX_PIXELS): send it smaller"
        )


def check_request(path: str, body: dict[str, Any], limits: ImageLimits | None) -> None:
    """Refuse a request's images (`ImageRefused`)."""
    images = request_images(path, body)
    if not images:
        return
    if limits is None:
        raise ImageRefused(f"{VISION_OFF_MESSAGE}: send text only, or ask its owner")
    if len(images) > limits.images_per_prompt:
        raise ImageRefused(
            f"{len(images)} images in one request, above this server's {limits.images_per_prompt} "
            "(VISION_IMAGES_PER_PROMPT): send fewer"
        )
    for url in images:
        check_image(url, limits.max_pixels)


# ---- the ASGI layer ----------------------------------------------------------------------


def refusal_body(path: str, message: str) -> bytes:
    """A 400's body in the shape of the route's API."""
    if path.startswith("/v1/messages"):
        return json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": message}}).encode()
    error = {"message": message, "type": "invalid_request_error", "param": "messages", "code": 400}
    return json.dumps({"error": error}).encode()


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


class ImageRequestGuard:
    """Pure ASGI middleware: the checks above on POSTs to the image routes; the rest untouched."""

    def __init__(self, app: ASGIApp, limits: ImageLimits | None = None) -> None:
        self.app = app
        self.limits = limits if limits is not None else ImageLimits.from_env(os.environ.get(VISION_ENV))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in CHAT_PATHS + ANTHROPIC_PATHS:
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        body = None
        # A request naming no image (every image part's type says "image"; a \u escape could
        # spell it otherwise) goes on unparsed: one JSON parse per request is vLLM's alone.
        if b"image" in raw or b"\\u" in raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # vLLM answers a body that is not JSON itself
        if isinstance(body, dict):
            try:
                # Header reads of a few images: off the event loop, which serves every stream.
                await asyncio.to_thread(check_request, path, body, self.limits)
            except ImageRefused as refused:
                await _send_400(send, refusal_body(path, str(refused)))
                return
        await self.app(scope, _replay(raw, receive), send)


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A receive that hands vLLM the body once, then whatever the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


async def _send_400(send: Send, payload: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
