"""Images in requests, checked before vLLM reads them: one clear 400 instead of an unwanted
fetch, a silent shrink or an engine error.

vLLM 0.28.0 fetches any http(s) image URL a request names (``--allowed-media-domains`` only
narrows the hosts; empty, it allows every one), shrinks an image above the processor's pixel
cap instead of refusing it, and (stock) fails inside its image processor on the CPU build (patch 0086 and
`entrypoint.resolve.processor_kwargs` mend that in the engine).
`ImageRequestGuard`, a layer of `entrypoint.asgi.StackMiddleware`, reads the JSON body of the
routes that take images (OpenAI chat completions and Responses, Anthropic messages) and
answers 400, in the shape of the route's API, for:

- an image that is neither a base64 ``data:`` URL nor an http(s) URL on a host of
  VISION_URL_DOMAINS (its hostname as urllib3 parses it, the parser vLLM checks and fetches
  with, lower-cased, matched exactly; no user name or password), an Anthropic ``url`` source
  alike; with the setting unset, every URL (the server fetches nothing);
- inline bytes that are not a PNG, JPEG, WebP or GIF image;
- inline, more pixels (width x height) than VISION_MAX_PIXELS (a fetched image is vLLM's: its
  processor shrinks it to that cap, docs/vision.md);
- more images in one request than VISION_IMAGES_PER_PROMPT, URLs counted;
- any image while VISION is off (vLLM would say "At most 0 image(s)").

A request without images passes untouched, and one whose images pass goes on as it came. The
limits reach the API server as the `VISION_ENV` variable (JSON of `ResolvedVision`).

A request naming an image URL that vLLM then fails to fetch or read gets vLLM's 4xx with a hint
added (`fetch_error_message`), and, where vLLM 0.28.0's fetch raises past its handlers into a
500 (a timeout, a refused connection, a 5xx, 408 or 429 from the host), a 422 that says so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from core.progress import say
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
    url_domains: tuple[str, ...] = ()  # hosts image URLs may name (VISION_URL_DOMAINS); empty: none

    @classmethod
    def from_env(cls, value: str | None) -> ImageLimits | None:
        if not value:
            return None
        data = json.loads(value)
        return cls(data["images_per_prompt"], data["max_pixels"], tuple(data.get("url_domains", ())))


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
    """The bytes of a base64 ``data:`` URL (other URLs are `check_url`'s)."""
    if not url or not url.lower().startswith("data:"):
        raise ImageRefused("an image part carries no URL: send data:image/png;base64,<data>")
    spec, comma, data = url[5:].partition(",")
    if not comma or not spec.lower().endswith(";base64"):
        raise ImageRefused("an image data URL must be base64: data:image/png;base64,<data>")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the image's base64 data does not decode") from None


def check_url(url: str, url_domains: tuple[str, ...]) -> None:
    """Refuse an image URL vLLM is not to fetch: any but http(s) on a host of ``url_domains``.

    The host is read by urllib3's ``parse_url``, taken from the vLLM module that reads it for its
    own allow-list and for the fetch (it fetches the URL urllib3 re-serialises), so both agree on
    every odd spelling. (The API server has vLLM loaded; urllib3 is vLLM's, not ours.)"""
    from vllm.multimodal.media.connector import parse_url

    try:
        parsed = parse_url(url)
    except ValueError:  # urllib3's LocationParseError
        parsed = None
    scheme = url.partition(":")[0].lower() if ":" in url else "no scheme"
    if parsed is None or parsed.scheme not in ("http", "https"):
        what = f"a {scheme} URL is never fetched" if parsed is not None else "the URL does not parse"
    elif parsed.auth is not None:
        what = "a URL with a user name or password is never fetched"
    elif parsed.hostname in url_domains:
        return
    else:
        what = f"host {parsed.hostname or '(none)'} is not one"
    listed = ",".join(url_domains) if url_domains else "unset: none"
    raise ImageRefused(
        f"image URLs are fetched only from hosts in VISION_URL_DOMAINS ({listed}); {what}: send the image "
        "inline (OpenAI: data:image/png;base64,...; Anthropic: a base64 source) or ask the owner to add the host"
    )


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


def check_request(path: str, body: dict[str, Any], limits: ImageLimits | None) -> list[str]:
    """Refuse a request's images (`ImageRefused`); the image URLs vLLM will fetch."""
    images = request_images(path, body)
    if not images:
        return []
    if limits is None:
        raise ImageRefused(f"{VISION_OFF_MESSAGE}: send text only, or ask its owner")
    if len(images) > limits.images_per_prompt:
        raise ImageRefused(
            f"{len(images)} images in one request, above this server's {limits.images_per_prompt} "
            "(VISION_IMAGES_PER_PROMPT): send fewer"
        )
    for url in images:
        if url[:5].lower() == "data:" or not url:
            check_image(url, limits.max_pixels)
        else:  # vLLM fetches it, and its processor caps the pixels
            check_url(url, limits.url_domains)
    return [url for url in images if url[:5].lower() != "data:"]


def fetch_error_message(status: int, message: str, urls: list[str]) -> tuple[int, str]:
    """vLLM's answer (``status``, ``message``) to a request naming ``urls``, as the client gets it.

    vLLM 0.28.0 answers a fetched image that is not one (a redirect's body among them: redirects
    are off) with 400 "Failed to load image: ...", an HTTP 4xx from the host with 422, and lets
    a timeout, a refused connection or a 5xx (after its retries) become a 500 (``status`` 500,
    ``message`` the error)."""
    named = ", ".join(urls)
    if status >= 500:
        timeout = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5")
        return 422, (
            f"the image URL(s) {named} could not be fetched ({message or 'no reason given'}): no answer within "
            f"VLLM_IMAGE_FETCH_TIMEOUT ({timeout} s, one try), a refused connection or an "
            "error answer from the host: check that the host serves it to this server, or send the image inline"
        )
    if message.startswith("Failed to load image"):
        return status, (
            f"{message}; the answer from {named} is not an image: the URL must answer 200 with the image "
            "itself (redirects are not followed)"
        )
    return status, message


# ---- the ASGI layer ----------------------------------------------------------------------


def refusal_body(path: str, message: str, status: int = 400) -> bytes:
    """A 4xx's body in the shape of the route's API."""
    if path.startswith("/v1/messages"):
        return json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": message}}).encode()
    error = {"message": message, "type": "invalid_request_error", "param": "messages", "code": status}
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
        fetched: list[str] = []
        if isinstance(body, dict):
            try:
                # Header reads of a few images: off the event loop, which serves every stream.
                fetched = await asyncio.to_thread(check_request, path, body, self.limits)
            except ImageRefused as refused:
                await _send_refusal(send, refusal_body(path, str(refused)))
                return
        if not fetched:
            await self.app(scope, _replay(raw, receive), send)
            return
        guarded = _FetchErrors(send, path, fetched)
        try:
            await self.app(scope, _replay(raw, receive), guarded)
        except Exception as failed:
            # vLLM's fetch raised past its route's handlers (Starlette's outermost layer would
            # answer an empty 500): a request's URL that does not answer is the client's 4xx.
            if guarded.started or not _is_fetch_error(failed):
                raise
            reason = f"{type(failed).__name__}: {failed}".removesuffix(": ")
            say(f"qwen38: image fetch failed for {', '.join(fetched)}: {reason}", level="warning", file=sys.stderr)
            status, text = fetch_error_message(500, reason, fetched)
            await _send_refusal(send, refusal_body(path, text, status), status)


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


async def _send_refusal(send: Send, payload: bytes, status: int = 400) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class _FetchErrors:
    """A send that passes vLLM's answer to a request naming image URLs, but holds an error answer
    (status 400 or more) whole and sends it again as `fetch_error_message` words it."""

    def __init__(self, send: Send, path: str, urls: list[str]) -> None:
        self.send, self.path, self.urls = send, path, urls
        self.status: int | None = None
        self.held: list[bytes] = []
        self.started = False  # a response began: an error raised later is not ours to answer

    async def __call__(self, message: Message) -> None:
        self.started = True
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self.status = message["status"]
            return
        if self.status is None or message["type"] != "http.response.body":
            await self.send(message)
            return
        self.held.append(message.get("body", b""))
        if not message.get("more_body"):
            status, text = fetch_error_message(self.status, _error_text(b"".join(self.held)), self.urls)
            await _send_refusal(self.send, refusal_body(self.path, text, status), status)


def _is_fetch_error(error: Exception) -> bool:
    """What vLLM 0.28.0's media fetch raises for a host that does not answer with the image: a
    timeout, a connection error (both OSError or TimeoutError), an HTTP 5xx, 408 or 429 (aiohttp's
    ClientResponseError; aiohttp is vLLM's dependency, not ours, hence its module's name)."""
    return isinstance(error, (TimeoutError, OSError)) or type(error).__module__.split(".")[0] == "aiohttp"


def _error_text(payload: bytes) -> str:
    """The message of an OpenAI- or Anthropic-shaped error body ('' when there is none)."""
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("message") or "") if isinstance(error, dict) else ""
