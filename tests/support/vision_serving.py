"""The `cpu` profile serving the tiny vision model (issue 58), and images to send it.

The shipped `cpu` profile's target (`qwen38 tiny`'s `Qwen3_5ForCausalLM`) has no tower, so
VISION=true is refused there. `cpu-vision` is the `cpu` profile with one change of model: its
target is `qwen38 generate --size tiny-vision` (the same tiny text model as a
`Qwen3_5ForConditionalGeneration` with a generated 2-block ViT), and it serves no adapter (the
tiny adapter is bound to the text-only target). Everything else, the engine table included, is
the `cpu` profile's.

The requests both tiers send (tests/integration/test_vision_serving.py on the CPU build,
tests/gpu/test_vision_gpu.py on CUDA) live here too: a PNG as a chat part or an Anthropic block,
one chat or message through the official SDKs, and the bad images with the 400 each gets from a
server started with ``VISION_MAX_PIXELS=MAX_PIXELS`` and one image a prompt. `image_host` is a
web server on 127.0.0.1 for the image-URL tests (VISION_URL_DOMAINS=127.0.0.1): a PNG, one above
the pixel cap, a 404, a redirect to another host name, bytes that are not an image, a slow answer.
"""

from __future__ import annotations

import base64
import contextlib
import io
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from core.profiles import PROFILES_DIR
from prepare.generate import generate_model
from prepare.synthetic import TINY_VISION_PRESET

VISION_TARGET = "tiny/target-vision"
MODEL = "qwen3.8-27b"
MAX_PIXELS = 256 * 256  # the tiny processor's own largest image: the servers' VISION_MAX_PIXELS
QUESTION = "What is in the picture?"
URL_REFUSED = "image URLs are fetched only from hosts in VISION_URL_DOMAINS"


def vision_profiles(directory: Path) -> Path:
    """``directory`` with the repository's profiles plus `cpu-vision`."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in PROFILES_DIR.glob("*.toml"):
        shutil.copy(path, directory)
    text = (PROFILES_DIR / "cpu.toml").read_text()
    for old, new in (
        ('[models.target]\ndir = "tiny/target"', f'[models.target]\ndir = "{VISION_TARGET}"'),
        ('adapter = "qwen3.8-27b-mode-b"\n', ""),
        ('[models.adapter]\ndir = "tiny/adapter"\ngenerated = "tiny"\n', ""),
        ("[lora]\nmax_lora_rank = 1\nmax_loras = 1\n", ""),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (directory / "cpu-vision.toml").write_text(text)
    return directory


def vision_models(root: Path, tiny_root: Path) -> Path:
    """MODELS_DIR ``root``: the session's tiny models (linked) and the tiny vision target."""
    (root / "tiny").mkdir(parents=True, exist_ok=True)
    for part in (tiny_root / "tiny").iterdir():
        (root / "tiny" / part.name).symlink_to(part, target_is_directory=True)
    generate_model(root / VISION_TARGET, TINY_VISION_PRESET, "qwen3.8-27b-bf16")
    return root


def png(size: tuple[int, int], color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def image_part(raw: bytes) -> dict:
    """An OpenAI chat content part carrying ``raw`` as a data URL."""
    return {"type": "image_url", "image_url": {"url": data_url(raw)}}


def image_block(raw: bytes) -> dict:
    """An Anthropic content block carrying ``raw`` as base64."""
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(raw).decode()}}


def chat(client, *parts: dict, **extra):
    """One greedy chat completion (8 tokens) of ``parts`` and the question, through the OpenAI SDK."""
    content = [*parts, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=8, temperature=0, **extra)


def respond(client, raw: bytes):
    """One greedy Responses API answer (8 tokens) to an ``input_image`` of ``raw`` and the question."""
    content = [{"type": "input_image", "image_url": data_url(raw), "detail": "auto"},
               {"type": "input_text", "text": QUESTION}]
    return client.responses.create(model=MODEL, input=[{"role": "user", "content": content}],
                                   max_output_tokens=8, temperature=0)


def cached_image_prompt(client, raw: bytes, text: str, **extra) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one chat of the image ``raw`` followed by ``text`` (OpenAI SDK)."""
    content = [image_part(raw), {"type": "text", "text": text}]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            max_tokens=2, temperature=0, **extra)
    return answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens


def message(client, *blocks: dict):
    """One message (8 tokens) of ``blocks`` and the question, through the Anthropic SDK."""
    content = [*blocks, {"type": "text", "text": QUESTION}]
    return client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": content}])


# case -> (chat content parts, an excerpt of the 400's message) on a server of MAX_PIXELS and one image a prompt
def refused_then_answered(client, parts: tuple[dict, ...], reason: str):
    """A chat with a bad image is a 400 naming ``reason``, refused before anything is fetched
    or encoded (within 10 s), and the server answers a good image right after; that answer."""
    import openai

    began = time.monotonic()
    try:
        chat(client, *parts)
    except openai.BadRequestError as refused:
        assert refused.status_code == 400 and reason in refused.message, refused.message
    else:
        raise AssertionError(f"a bad image was answered; expected a 400 saying {reason!r}")
    assert time.monotonic() - began < 10
    return chat(client, image_part(png((64, 64))))


def anthropic_refused(client, block: dict, reason: str) -> None:
    """An Anthropic message with a bad image block is a 400 in Anthropic's error shape naming ``reason``."""
    import anthropic

    try:
        message(client, block)
    except anthropic.BadRequestError as refused:
        error = refused.body["error"]
        assert refused.status_code == 400 and error["type"] == "invalid_request_error", refused.body
        assert reason in error["message"], error["message"]
    else:
        raise AssertionError(f"a bad image block was answered; expected a 400 saying {reason!r}")


BAD_IMAGES = {
    "not an image": ([image_part(b"GIF89a, then nothing an image has")], "is not an image: send a PNG, JPEG"),
    "too many pixels": ([image_part(png((300, 300)))],
                        "300 x 300 = 90,000 pixels, above this server's 65,536 (VISION_MAX_PIXELS)"),
    "too many images": ([image_part(png((64, 64))), image_part(png((64, 64), (0, 0, 200)))],
                        "2 images in one request, above this server's 1 (VISION_IMAGES_PER_PROMPT)"),
    "an http URL": ([{"type": "image_url", "image_url": {"url": "http://203.0.113.7/cat.png"}}],
                    "host 203.0.113.7 is not one: send the image inline"),
    "an https URL": ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                     "host example.com is not one: send the image inline"),
}
# case -> (an Anthropic content block, an excerpt of the 400's message), on the same server
BAD_IMAGE_BLOCKS = {
    "not an image": (image_block(b"plain text, not pixels"), "is not an image"),
    "too many pixels": (image_block(png((300, 300))), "above this server's 65,536 (VISION_MAX_PIXELS)"),
    "a URL source": ({"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
                     "host example.com is not one: send the image inline"),
}


# ---- a web server of images (VISION_URL_DOMAINS) ------------------------------------------

IMAGE_HOST = "127.0.0.1"  # the servers' VISION_URL_DOMAINS; "localhost", the same machine, is not listed
SLOW_S = 30.0  # how long /slow.png keeps its answer: longer than the engine's fetch timeout


class _ImageHandler(BaseHTTPRequestHandler):
    """GET /cat.png, /big.png, /text.png, /slow.png, /elsewhere.png (302 to "localhost"); else 404."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        if self.path == "/elsewhere.png":
            self._answer(302, b"", "text/plain", location=f"http://localhost:{port}/cat.png")
        elif self.path == "/slow.png":
            time.sleep(SLOW_S)
            self._answer(200, png((64, 64)), "image/png")
        elif self.path in self.server.files:
            self._answer(200, *self.server.files[self.path])
        else:
            self._answer(404, b"not here", "text/plain")
        self.server.requests.append(self.path)

    def _answer(self, status: int, body: bytes, media_type: str, location: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        if location:
            self.send_header("Location", location)
        self.end_headers()
        with contextlib.suppress(OSError):  # a client that gave up on /slow.png
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def image_host() -> Iterator[ThreadingHTTPServer]:
    """A web server on IMAGE_HOST (a free port) serving the images above; ``.requests``: the paths asked."""
    server = ThreadingHTTPServer((IMAGE_HOST, 0), _ImageHandler)
    server.daemon_threads = True
    server.files = {"/cat.png": (png((64, 64)), "image/png"), "/big.png": (png((300, 300)), "image/png"),
                    "/text.png": (b"plain text, not pixels", "image/png")}
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def image_url_part(url: str) -> dict:
    """An OpenAI chat content part naming the image at ``url``."""
    return {"type": "image_url", "image_url": {"url": url}}
