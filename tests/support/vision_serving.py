"""The `cpu` profile serving the tiny vision model (issue 58), and images to send it.

The shipped `cpu` profile's target (`qwen38 tiny`'s `Qwen3_5ForCausalLM`) has no tower, so
VISION=true is refused there. `cpu-vision` is the `cpu` profile with one change of model: its
target is `qwen38 generate --size tiny-vision` (the same tiny text model as a
`Qwen3_5ForConditionalGeneration` with a generated 2-block ViT), and it runs eager. Its adapter
slot is either gone (``vision_profiles(..., adapter=False)``: the base id alone) or the vision
target's own rank-1 adapter (``adapter=True``; the cpu profile's tiny adapter is bound to the
text-only target), which `vision_models` builds with the converter an owner's `qwen38 prepare
--profile spark-lora` runs. Everything else, the rest of the engine table included, is the `cpu`
profile's. (Without an adapter vLLM's CPU platform no longer turns graph compilation off, as it
does for every LoRA engine: the cold torch.compile warm-up of the tower and the text model held
the start ~55 s on the 2-core machine; nothing the CPU tests prove depends on it, and the GPU
tier serves the model compiled, tests/gpu/test_vision_gpu.py.)

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
from prepare.adapter import TRANSFORM, build_adapter
from prepare.generate import DEFAULT_SEED, TINY_ADAPTER_STRENGTH, generate_model, write_directions
from prepare.synthetic import TINY_VISION, TINY_VISION_PRESET

VISION_TARGET = "tiny/target-vision"
VISION_DIRECTIONS = "tiny/directions-vision"  # the tiny directions, drawn for the vision target's modules
VISION_ADAPTER = "tiny/adapter-vision"  # `qwen38 adapter build` of the vision target and those directions
MODEL = "qwen3.8-27b"
ADAPTER_MODEL = "qwen3.8-27b-mode-b"  # the adapter's id (the cpu profile's)
MAX_PIXELS = 256 * 256  # the tiny processor's own largest image: the servers' VISION_MAX_PIXELS
QUESTION = "What is in the picture?"
URL_REFUSED = "image URLs are fetched only from hosts in VISION_URL_DOMAINS"


def vision_profiles(directory: Path, *, adapter: bool = False) -> Path:
    """``directory`` with the repository's profiles plus `cpu-vision`: without ``adapter`` it serves
    the base id alone; with it, also the cpu profile's adapter id from VISION_ADAPTER, a slot of
    `adapter-build` over generated inputs (`vision_models` builds it), as `spark-lora`'s slot is over
    pinned ones."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in PROFILES_DIR.glob("*.toml"):
        shutil.copy(path, directory)
    text = (PROFILES_DIR / "cpu.toml").read_text()
    slot = '[models.adapter]\ndir = "tiny/adapter"\ngenerated = "tiny"\n'
    if adapter:
        built = f'[models.adapter]\ndir = "{VISION_ADAPTER}"\ngenerated = "tiny"\ntransform = "{TRANSFORM}"\n'
        edits = [(slot, built)]
    else:
        edits = [(f'adapter = "{ADAPTER_MODEL}"\n', ""), (slot, ""), ("[lora]\nmax_lora_rank = 1\nmax_loras = 1\n", "")]
    for old, new in (
        ('[models.target]\ndir = "tiny/target"', f'[models.target]\ndir = "{VISION_TARGET}"'),
        *edits,
        ("\n[engine]\n", "\n[engine]\nenforce_eager = true  # uncompiled, as the cpu profile's LoRA engines run\n"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (directory / "cpu-vision.toml").write_text(text)
    return directory


def vision_models(root: Path, tiny_root: Path) -> Path:
    """MODELS_DIR ``root``: the session's tiny models (linked), the tiny vision target and its adapter.

    The adapter is made as an owner makes `spark-lora`'s (`qwen38 prepare` -> `build_adapter`, the
    converter of `qwen38 adapter build`), from the vision target's checkpoint (its modules under
    `model.language_model.*`, as the hub checkpoint's) and directions drawn for it as `qwen38 tiny`
    draws the cpu profile's (c = 100 each); ~0.1 s."""
    (root / "tiny").mkdir(parents=True, exist_ok=True)
    for part in (tiny_root / "tiny").iterdir():
        (root / "tiny" / part.name).symlink_to(part, target_is_directory=True)
    target = generate_model(root / VISION_TARGET, TINY_VISION_PRESET, "qwen3.8-27b-bf16")
    write_directions(root / VISION_DIRECTIONS, target, TINY_VISION, DEFAULT_SEED, name="directions",
                     strength=TINY_ADAPTER_STRENGTH)
    build_adapter(target, root / VISION_DIRECTIONS, root / VISION_ADAPTER)
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


def chat(client, *parts: dict, model: str = MODEL, **extra):
    """One greedy chat completion (8 tokens) of ``parts`` and the question, through the OpenAI SDK."""
    content = [*parts, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=8, temperature=0, **extra)


def respond(client, raw: bytes):
    """One greedy Responses API answer (8 tokens) to an ``input_image`` of ``raw`` and the question."""
    content = [{"type": "input_image", "image_url": data_url(raw), "detail": "auto"},
               {"type": "input_text", "text": QUESTION}]
    return client.responses.create(model=MODEL, input=[{"role": "user", "content": content}],
                                   max_output_tokens=8, temperature=0)


def cached_image_prompt(client, raw: bytes, text: str, model: str = MODEL, **extra) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one chat of the image ``raw`` followed by ``text`` (OpenAI SDK)."""
    content = [image_part(raw), {"type": "text", "text": text}]
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=2, temperature=0, **extra)
    return answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens



def check_adapter_applied_to_images(client) -> None:
    """On a server of MODEL and ADAPTER_MODEL: an image chat to the adapter id is answered with the
    adapter applied (the converter's `model.language_model.layers.N...` names reached the VL model's
    language model through its `hf_to_vllm_mapper`: an adapter that loaded nothing answers as the
    base), with the same image tokens in the prompt, and the image reaches the adapted model."""
    red, blue = image_part(png((64, 64), (200, 0, 0))), image_part(png((64, 64), (0, 0, 200)))
    base, adapted, other = (chat(client, image, model=model, logprobs=True)
                            for image, model in ((red, MODEL), (red, ADAPTER_MODEL), (blue, ADAPTER_MODEL)))
    assert adapted.model == ADAPTER_MODEL and adapted.usage.completion_tokens == 8
    assert adapted.usage.prompt_tokens == base.usage.prompt_tokens == other.usage.prompt_tokens
    assert adapted.choices[0].message.content != base.choices[0].message.content
    first = [answer.choices[0].logprobs.content[0] for answer in (base, adapted, other)]
    assert first[0].token != first[1].token or abs(first[0].logprob - first[1].logprob) > 0.05
    assert first[1].logprob != first[2].logprob  # the image's embeddings reach the adapted model too


def image_cache_isolation(client, base_url: str, api_key: str, prefix_tokens: int) -> dict[str, tuple[int, float]]:
    """`validate cache-isolation`'s four steps with an image first in the prompt (a text of
    ``prefix_tokens`` after it): step -> (cached tokens, prefix-cache hits the server counted).
    vLLM keys the blocks by the image's hash and the adapter, so the adapter's first sending
    reuses none of the base's blocks, and each repeat reuses its own; the caller asserts that."""
    from entrypoint.client import StackClient
    from entrypoint.validate.cache_isolation import settled_hits, unique_prefix

    raw = png((64, 64), (30, 160, 60))
    with StackClient(base_url, api_key) as stack:
        text = unique_prefix(stack, MODEL, prefix_tokens)

        def sent(model: str) -> tuple[int, float]:
            before = settled_hits(stack)
            _, cached = cached_image_prompt(client, raw, text, model=model)
            return cached, settled_hits(stack, before) - before

        return {step: sent(model) for step, model in (("base first", MODEL), ("base repeat", MODEL),
                                                       ("adapter first", ADAPTER_MODEL),
                                                       ("adapter repeat", ADAPTER_MODEL))}


def check_image_cache_isolation(steps: dict[str, tuple[int, float]]) -> None:
    """`image_cache_isolation`'s steps: nothing crosses from the base id to the adapter id, and a
    repeat to either id reuses the same blocks' worth, its own."""
    assert steps["base first"] == (0, 0) and steps["adapter first"] == (0, 0), steps
    assert min(steps["base repeat"]) > 0 and min(steps["adapter repeat"]) > 0, steps
    assert steps["adapter repeat"][0] == steps["base repeat"][0], steps

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


def check_url_fetched_like_data_url(openai_client, anthropic_client, images) -> None:
    """/cat.png from `image_host` (on VISION_URL_DOMAINS' IMAGE_HOST) through an OpenAI
    `image_url` and an Anthropic `url` source: fetched, answered, and its prompt the data URL's
    (the same image tokens)."""
    url = f"http://{IMAGE_HOST}:{images.server_address[1]}/cat.png"
    inline = chat(openai_client, image_part(png((64, 64))))
    fetched = chat(openai_client, image_url_part(url))
    assert fetched.usage.completion_tokens > 0 and fetched.choices[0].message.content, fetched
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens  # 4 image tokens + start and end
    by_url = message(anthropic_client, {"type": "image", "source": {"type": "url", "url": url}})
    by_data = message(anthropic_client, image_block(png((64, 64))))
    assert by_url.usage.input_tokens == by_data.usage.input_tokens and by_url.usage.output_tokens > 0
    assert images.requests.count("/cat.png") >= 2
