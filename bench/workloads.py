"""The serving workloads: c1, c8, agent, users, depth, copy, image.

Each workload is a parameters dataclass (every size a field whose default is the value the
source articles published; the CLI flags and their help are generated from the fields) and
a function that turns parameters + the server's tokenizer into points: a point is one
concurrency or one context depth, holding jobs (sequences of requests sent one after the
other), run ``concurrency`` jobs at a time.

Every request: streamed chat completion, temperature 0, thinking off, EOS ignored (every
server generates exactly the same number of tokens), and a per-run ``cache_salt`` so that a
second run on the same server starts from a cold prefix cache, like the first.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import prompts
from bench.measurement import RequestSpec
from core.errors import BenchError


def knob(default: Any, help: str, minimum: int = 1) -> Any:
    """A workload parameter: its default is the published value; ``help`` becomes --help."""
    return field(default=default, metadata={"help": help, "min": minimum})


@dataclass(frozen=True)
class C1Params:
    input_tokens: int = knob(512, "random input tokens per request (the user message; the chat template adds a few)")
    output_tokens: int = knob(2048, "output tokens per request, EOS ignored")
    requests: int = knob(5, "requests, sent one after the other (the Spark article's baseline: five rounds)")


@dataclass(frozen=True)
class C8Params:
    input_tokens: int = knob(1024, "random input tokens per request")
    output_tokens: int = knob(256, "output tokens per request, EOS ignored")
    requests: int = knob(32, "requests per concurrency point")
    concurrency: tuple[int, ...] = knob((8,), "requests in flight; a comma list sweeps (e.g. 1,2,4,8)")


@dataclass(frozen=True)
class AgentParams:
    system_tokens: int = knob(5800, "tokens of the system prompt every thread shares")
    threads: tuple[int, ...] = knob((8,), "concurrent agent threads (the articles: 4-12); a comma list sweeps")
    turns: int = knob(4, "requests per thread, each carrying the thread's history")
    turn_tokens: int = knob(600, "mean tokens a turn adds (code, prose or a tool result; varies +-50 %%)")
    output_tokens: int = knob(256, "output tokens per request, EOS ignored")
    tool_choice: str = knob("auto", "tool_choice of every request: auto, or none for a server without a tool parser")


@dataclass(frozen=True)
class UsersParams:
    system_tokens: int = knob(5800, "tokens of the system prompt every user shares (the 3090 seed's 64-request test)")
    prompt_tokens: int = knob(1000, "mean tokens of each request's own message (code or prose; varies +-50 %%)")
    output_tokens: int = knob(256, "output tokens per request, EOS ignored")
    concurrency: tuple[int, ...] = knob((8, 32, 64), "users in flight, one point each (the owners' C8, C32, C64)")
    rounds: int = knob(2, "requests each user sends one after the other: every point keeps its users busy")
    tool_choice: str = knob("auto", "tool_choice of every request: auto, or none for a server without a tool parser")


@dataclass(frozen=True)
class DepthParams:
    depths: tuple[int, ...] = knob(
        (0, 10000, 43000, 100000), "context tokens before the question, one point each", minimum=0
    )
    output_tokens: int = knob(256, "output tokens per request, EOS ignored")
    repeats: int = knob(1, "requests per depth")


@dataclass(frozen=True)
class CopyParams:
    document_tokens: int = knob(25000, "tokens of the document to reproduce (= output tokens)")
    repeats: int = knob(1, "requests (one after the other)")


@dataclass(frozen=True)
class ImageParams:
    width: int = knob(1920, "image width in pixels")
    height: int = knob(1080, "image height in pixels (1920 x 1080 is within VISION_MAX_PIXELS' default 2,097,152)")
    requests: int = knob(4, "image requests, one after the other, each with an image of its own (then as many "
                            "text-only requests of the same text)")
    output_tokens: int = knob(8, "output tokens per request, EOS ignored")


@dataclass
class Point:
    """One measured window: a concurrency or a depth."""

    label: str
    x: float
    concurrency: int
    jobs: list[list[RequestSpec]]
    reference_text: str | None = None  # copy: what the answer should reproduce


@dataclass
class Context:
    """What building requests needs: the model, the seed, the server's tokenizer and limits."""

    model: str
    seed: int
    tokenizer: Any  # prompts.Tokenizer + prompts.ChatCounter (the server's, or a local one in tests)
    cache_salt: str | None
    max_model_len: int | None

    def salt(self, *parts: object) -> str | None:
        return None if self.cache_salt is None else "-".join([self.cache_salt, *map(str, parts)])

    def request(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int,
        label: str,
        *,
        salt: str | None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
    ) -> RequestSpec:
        count = self.tokenizer.count_chat(messages, tools)
        if self.max_model_len is not None and count + max_tokens > self.max_model_len:
            raise BenchError(
                f"{label}: {count} prompt + {max_tokens} output tokens exceed the server's max_model_len "
                f"{self.max_model_len}; choose smaller sizes (see `qwen38 bench WORKLOAD --help`)"
            )
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "chat_template_kwargs": dict(prompts.NO_THINKING),
        }
        if tools:
            body["tools"] = tools
            body["tool_choice"] = tool_choice or "auto"
        if salt is not None:
            body["cache_salt"] = salt
        return RequestSpec(body=body, expected_prompt_tokens=count, max_tokens=max_tokens, label=label)

    def warm_up_request(self) -> RequestSpec:
        # Several tokens in, several out: one-token prompts trip a vLLM CPU speculative bug.
        return self.request(
            [{"role": "user", "content": prompts.SHORT_QUESTION}], 16, "warm-up", salt=self.salt("warm-up")
        )


def _random_prompt(ctx: Context, workload: str, index: int, tokens: int) -> str:
    return prompts.fit_tokens(
        prompts.random_words(prompts.SeededStream(workload, ctx.seed, index)), tokens, ctx.tokenizer
    ).text


def build_c1(p: C1Params, ctx: Context) -> list[Point]:
    job = [
        ctx.request(
            [{"role": "user", "content": _random_prompt(ctx, "c1", i, p.input_tokens)}],
            p.output_tokens,
            f"c1 request {i}",
            salt=ctx.salt("c1", i),
        )
        for i in range(p.requests)
    ]
    return [Point("concurrency 1", 1, 1, [job])]


def build_c8(p: C8Params, ctx: Context) -> list[Point]:
    contents = [_random_prompt(ctx, "c8", i, p.input_tokens) for i in range(p.requests)]
    points = []
    for n in p.concurrency:
        jobs = [
            [
                ctx.request(
                    [{"role": "user", "content": text}],
                    p.output_tokens,
                    f"c8 c={n} request {i}",
                    salt=ctx.salt("c8", n, i),
                )
            ]
            for i, text in enumerate(contents)
        ]
        points.append(Point(f"concurrency {n}", n, n, jobs))
    return points


def build_agent(p: AgentParams, ctx: Context) -> list[Point]:
    if p.tool_choice not in ("auto", "none"):
        raise BenchError(f"--tool-choice {p.tool_choice!r}: use auto or none")
    system = prompts.fit_tokens(
        prompts.agent_system(prompts.SeededStream("agent-system", ctx.seed)), p.system_tokens, ctx.tokenizer
    ).text
    threads = [
        prompts.agent_thread(ctx.seed, i, p.turns, p.turn_tokens, p.output_tokens, ctx.tokenizer)
        for i in range(max(p.threads))
    ]
    points = []
    for n in p.threads:
        # One salt per point: the threads of a point share their prefix, points do not.
        salt = ctx.salt("agent", n)
        jobs = [
            [
                ctx.request(
                    thread.request_messages(system, t),
                    p.output_tokens,
                    f"agent n={n} thread {thread.index} turn {t} ({thread.turns[t].kind})",
                    salt=salt,
                    tools=prompts.AGENT_TOOLS,
                    tool_choice=p.tool_choice,
                )
                for t in range(p.turns)
            ]
            for thread in threads[:n]
        ]
        points.append(Point(f"{n} threads", n, n, jobs))
    return points


def build_users(p: UsersParams, ctx: Context) -> list[Point]:
    """Many users at once, as an agent harness with sub-agents or an evaluation job sends them:
    each request is the shared system prompt and tool list plus a first turn of its own (code
    or prose, `prompts.agent_thread`), so the system prompt is cached once per point and every
    request prefills only its own message."""
    if p.tool_choice not in ("auto", "none"):
        raise BenchError(f"--tool-choice {p.tool_choice!r}: use auto or none")
    system = prompts.fit_tokens(
        prompts.agent_system(prompts.SeededStream("users-system", ctx.seed)), p.system_tokens, ctx.tokenizer
    ).text
    # One first turn per request of the largest point; a smaller point takes the first ones.
    firsts = [
        prompts.agent_thread(ctx.seed, i, 1, p.prompt_tokens, 1, ctx.tokenizer).request_messages(system, 0)
        for i in range(max(p.concurrency) * p.rounds)
    ]
    points = []
    for n in p.concurrency:
        salt = ctx.salt("users", n)  # the users of a point share the system prompt, points do not
        jobs = [
            [
                ctx.request(
                    firsts[user * p.rounds + r],
                    p.output_tokens,
                    f"users c={n} user {user} request {r}",
                    salt=salt,
                    tools=prompts.AGENT_TOOLS,
                    tool_choice=p.tool_choice,
                )
                for r in range(p.rounds)
            ]
            for user in range(n)
        ]
        points.append(Point(f"concurrency {n}", n, n, jobs))
    return points


def build_depth(p: DepthParams, ctx: Context) -> list[Point]:
    points = []
    for depth in p.depths:
        if depth == 0:
            content = prompts.SHORT_QUESTION
        else:
            doc = prompts.fit_tokens(
                prompts.document(prompts.SeededStream("depth", ctx.seed, depth)), depth, ctx.tokenizer
            ).text
            content = doc + prompts.DEPTH_QUESTION
        job = [
            ctx.request(
                [{"role": "user", "content": content}],
                p.output_tokens,
                f"depth {depth} request {i}",
                salt=ctx.salt("depth", depth, i),
            )
            for i in range(p.repeats)
        ]
        points.append(Point(f"depth {depth}", depth, 1, [job]))
    return points


# The text beside each image (and, alone, the text-only point's prompt).
IMAGE_QUESTION = "Describe this image in one short sentence."


def noise_png(width: int, height: int, seed: str) -> bytes:
    """An RGB PNG of ``width`` x ``height`` uniform random pixels, drawn from ``seed``: no two
    seeds give the same image, so neither vLLM's encoder cache nor its prefix cache (both keyed
    by the image's hash) ever holds one. Written with the standard library (zlib at level 1:
    noise does not compress; a 1920 x 1080 image is ~6.2 MB)."""
    if width < 1 or height < 1:
        raise BenchError(f"image {width} x {height}: both sides must be at least 1 pixel")
    pixels = random.Random(seed).randbytes(width * height * 3)
    row = width * 3
    # Each scanline: filter type 0 (none), then its pixels.
    raw = b"".join(b"\x00" + pixels[y * row:(y + 1) * row] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")


def image_message(png: bytes, text: str) -> dict[str, Any]:
    """A user turn of one inline image (an OpenAI ``image_url`` data URL) and a text part."""
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def _image_request(p: ImageParams, ctx: Context, tag: str, label: str) -> RequestSpec:
    png = noise_png(p.width, p.height, f"image-{ctx.seed}-{ctx.cache_salt}-{tag}")
    return ctx.request([image_message(png, IMAGE_QUESTION)], p.output_tokens, label, salt=ctx.salt("image", tag))


def build_image(p: ImageParams, ctx: Context) -> list[Point]:
    """Two points of ``requests`` requests each, one at a time: each with a distinct noise image
    of width x height and a short question, then the same question alone (the text-only time to
    first token, for comparison). Each request has a salt of its own, so nothing is cached."""
    size = f"{p.width}x{p.height}"
    images = [_image_request(p, ctx, str(i), f"image {size} request {i}") for i in range(p.requests)]
    texts = [
        ctx.request([{"role": "user", "content": IMAGE_QUESTION}], p.output_tokens, f"text only request {i}",
                    salt=ctx.salt("image-text", i))
        for i in range(p.requests)
    ]
    return [Point(f"image {size}", p.width * p.height, 1, [images]), Point("text only", 0, 1, [texts])]


def warm_up_image(p: ImageParams, ctx: Context) -> list[RequestSpec]:
    """One image of the measured size first (an image the measured ones never repeat): the first
    image after a start pays one-off costs of the encoder's path."""
    return [_image_request(p, ctx, "warm-up", "warm-up image")]


def build_copy(p: CopyParams, ctx: Context) -> list[Point]:
    doc = prompts.fit_tokens(
        prompts.document(prompts.SeededStream("copy", ctx.seed)), p.document_tokens, ctx.tokenizer
    ).text
    content = prompts.COPY_INSTRUCTION + doc + prompts.COPY_END
    job = [
        ctx.request(
            [{"role": "user", "content": content}], p.document_tokens, f"copy request {i}", salt=ctx.salt("copy", i)
        )
        for i in range(p.repeats)
    ]
    return [Point(f"document {p.document_tokens}", p.document_tokens, 1, [job], reference_text=doc)]


@dataclass(frozen=True)
class Workload:
    name: str
    help: str
    description: str
    params: type
    build: Callable[[Any, Context], list[Point]]
    x_axis: str  # what a plot puts on x: "concurrency" or "context tokens"
    # Unmeasured requests of the workload's own kind, after the text warm-up (None: that alone).
    warm_up: Callable[[Any, Context], list[RequestSpec]] | None = None


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "c1",
            "single-stream decode: 512 random tokens in, 2,048 out, concurrency 1 (the Spark C1)",
            "The DGX Spark article's C1: random input, 2,048 output tokens with EOS ignored, one request "
            "at a time, temperature 0, thinking off.",
            C1Params,
            build_c1,
            "concurrency",
        ),
        Workload(
            "c8",
            "aggregate throughput: 32 requests of 1,024 in / 256 out at concurrency 8 (the Spark C8)",
            "The DGX Spark article's C8: 32 random requests, 1,024 input and 256 output tokens each, eight in flight.",
            C8Params,
            build_c8,
            "concurrency",
        ),
        Workload(
            "agent",
            "agent traffic: a shared ~5.8k-token system prompt, 4-12 threads, code/prose/tool turns",
            "Concurrent agent threads sharing one system prompt and tool list; each thread sends its turns "
            "in order, carrying its history (code listings, prose, tool calls and results), so prefix "
            "caching shows in TTFT and in the hit rate.",
            AgentParams,
            build_agent,
            "concurrency",
        ),
        Workload(
            "users",
            "many users at once: a shared ~5.8k-token system prompt, ~1k-token requests, 8, 32 and 64 in flight",
            "Agent-like traffic from many users (sub-agents, evaluation jobs): every request carries the "
            "same system prompt and tool list and a medium message of its own; each point keeps its "
            "users busy for a few requests. Reports aggregate and per-request tok/s, TTFT percentiles "
            "and the requests vLLM preempted for want of KV pages.",
            UsersParams,
            build_users,
            "concurrency",
        ),
        Workload(
            "depth",
            "single-request decode at ~0, 10k, 43k and 100k tokens of context",
            "One request at a time after a long document: decode speed as the context grows (the RTX 3090 "
            "article: ~107 / 78 / 38 / 31 tok/s).",
            DepthParams,
            build_depth,
            "context tokens",
        ),
        Workload(
            "copy",
            "reproduce a 25k-token document from the prompt",
            "The model is asked to reproduce a long document from its prompt (where lookup drafting "
            "shines: 381 tok/s in the RTX 3090 article).",
            CopyParams,
            build_copy,
            "context tokens",
        ),
        Workload(
            "image",
            "time to first token of an image: 4 distinct 1920 x 1080 noise PNGs, then the same text alone",
            "One request at a time, each a user turn of one inline PNG of random noise (a new image every "
            "request, so no encoder or prefix cache hits) and a short question, a few output tokens; then the "
            "same question without an image. The points' time to first token is the image's cost (decode, "
            "preprocessing, the vision encoder, the prefill of its tokens) beside the text's. Needs a server "
            "with VISION=true.",
            ImageParams,
            build_image,
            "context tokens",
            warm_up=warm_up_image,
        ),
    )
}


def params_from_args(workload: Workload, values: dict[str, Any]) -> Any:
    """The workload's parameters from parsed CLI values (defaults for those not given)."""
    given = {f.name: values[f.name] for f in dataclasses.fields(workload.params) if values.get(f.name) is not None}
    params = workload.params(**given)
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        minimum = f.metadata.get("min", 1)
        items = value if isinstance(value, tuple) else (value,)
        if not items:
            raise BenchError(f"--{f.name.replace('_', '-')}: give at least one value")
        for item in items:
            if isinstance(item, int) and item < minimum:
                raise BenchError(f"--{f.name.replace('_', '-')} {item}: must be >= {minimum}")
    return params
