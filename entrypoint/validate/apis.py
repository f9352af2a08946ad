"""`qwen38 validate apis`: prove the API surface of a deployment, for every model id.

For each id: OpenAI chat completions, completions and responses, and Anthropic messages,
each non-streaming and streaming; a forced (named) tool call on chat, responses and
messages whose arguments parse as JSON matching the tool's schema; and the error paths
(unknown model -> 404, invalid parameters -> 400, missing or wrong key -> 401). Where the
server takes images (VISION on, docs/vision.md), a chat carrying a PNG is answered and a
Messages request carrying one is answered or refused with a 400 naming why, and bytes that
are not an image or an http URL are refused with a 400. A server that takes none says so to
the first image, and adds no row: its report is the text-only one.
Thinking is switched off per request so a real model answers in `content`.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import httpx
import jsonschema

from entrypoint.client import StackClient
from entrypoint.image_requests import VISION_OFF_MESSAGE
from entrypoint.validate.report import CHECK_ERRORS, Report

PROMPT = "Name three things a cache is good for."
MAX_TOKENS = 16
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

# Enumerated values keep the arguments short and closed even for a random tiny model;
# the check is that the server forces a schema-valid call, not what the model prefers.
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL_NAME = "get_weather"
TOOL_DESCRIPTION = "Current weather for a city."
TOOL_PROMPT = "What is the weather in Paris? Use the tool."
TOOL_MAX_TOKENS = 64


def tool_args_ok(arguments: Any) -> str:
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(parsed, TOOL_SCHEMA)
    return json.dumps(parsed, sort_keys=True)


# ---- per-endpoint checks --------------------------------------------------------------


def _chat(client: StackClient, model: str, stream: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **NO_THINKING}
    if not stream:
        data = client.post_json("/v1/chat/completions", body)
        message = data["choices"][0]["message"]
        text = (message.get("content") or "") + (message.get("reasoning") or "")
        assert data["usage"]["completion_tokens"] > 0, "no completion tokens"
        assert text, "empty answer"
        return f"{data['usage']['completion_tokens']} tokens"
    result = client.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert result.done, "stream did not end with [DONE]"
    deltas = [e["choices"][0]["delta"] for e in result.events if e.get("choices")]
    pieces = [(d.get("content") or "") + (d.get("reasoning") or "") for d in deltas]
    usage = next((e["usage"] for e in reversed(result.events) if e.get("usage")), None)
    assert any(pieces), "no content in the stream"
    assert usage and usage["completion_tokens"] > 0, "no usage in the stream"
    return f"{len(result.events)} events, {usage['completion_tokens']} tokens"


def _completions(client: StackClient, model: str, stream: bool) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        data = client.post_json("/v1/completions", body)
        assert data["choices"][0]["text"], "empty text"
        assert data["usage"]["completion_tokens"] > 0, "no completion tokens"
        return f"{data['usage']['completion_tokens']} tokens"
    result = client.stream("/v1/completions", body)
    assert result.done, "stream did not end with [DONE]"
    text = "".join(e["choices"][0].get("text") or "" for e in result.events if e.get("choices"))
    assert text, "no text in the stream"
    return f"{len(result.events)} events"


def _responses(client: StackClient, model: str, stream: bool) -> str:
    body = {"model": model, "input": PROMPT, "max_output_tokens": MAX_TOKENS, "temperature": 0, **NO_THINKING}
    if not stream:
        data = client.post_json("/v1/responses", body)
        assert data["object"] == "response", f"object is {data.get('object')!r}"
        assert data["output"], "empty output"
        assert data["usage"]["output_tokens"] > 0, "no output tokens"
        return f"{data['usage']['output_tokens']} tokens, status {data['status']}"
    result = client.stream("/v1/responses", body)
    types = [e.get("type") for e in result.events]
    assert "response.created" in types, "no response.created event"
    assert types[-1] in ("response.completed", "response.incomplete"), f"last event is {types[-1]!r}"
    assert any(t and t.endswith(".delta") for t in types), "no delta events"
    return f"{len(types)} events"


def _messages(client: StackClient, model: str, stream: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **NO_THINKING}
    if not stream:
        data = client.post_json("/v1/messages", body)
        assert data["type"] == "message" and data["role"] == "assistant", "not an assistant message"
        assert data["content"], "empty content"
        assert data["usage"]["output_tokens"] > 0, "no output tokens"
        return f"{data['usage']['output_tokens']} tokens, stop {data['stop_reason']}"
    result = client.stream("/v1/messages", body)
    types = [e.get("type") for e in result.events]
    assert types and types[0] == "message_start", f"first event is {types[:1]}"
    assert "content_block_delta" in types, "no content_block_delta"
    assert types[-1] == "message_stop", f"last event is {types[-1]!r}"
    return f"{len(types)} events"


# ---- forced tool calls ------------------------------------------------------------------


def _tool_chat(client: StackClient, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": TOOL_PROMPT}],
        "tools": [{"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                                                     "parameters": TOOL_SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": TOOL_NAME}},
        "max_tokens": TOOL_MAX_TOKENS, "temperature": 0, **NO_THINKING,
    }
    calls = client.post_json("/v1/chat/completions", body)["choices"][0]["message"].get("tool_calls") or []
    assert calls, "no tool_calls"
    assert calls[0]["function"]["name"] == TOOL_NAME, f"called {calls[0]['function']['name']!r}"
    return tool_args_ok(calls[0]["function"]["arguments"])


def _tool_responses(client: StackClient, model: str) -> str:
    body = {
        "model": model,
        "input": TOOL_PROMPT,
        "tools": [{"type": "function", "name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_SCHEMA}],
        "tool_choice": {"type": "function", "name": TOOL_NAME},
        "max_output_tokens": TOOL_MAX_TOKENS, "temperature": 0, **NO_THINKING,
    }
    output = client.post_json("/v1/responses", body)["output"]
    calls = [item for item in output if item.get("type") == "function_call"]
    assert calls, f"no function_call in output types {[i.get('type') for i in output]}"
    assert calls[0]["name"] == TOOL_NAME, f"called {calls[0]['name']!r}"
    return tool_args_ok(calls[0]["arguments"])


def _tool_messages(client: StackClient, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": TOOL_PROMPT}],
        "tools": [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}],
        "tool_choice": {"type": "tool", "name": TOOL_NAME},
        "max_tokens": TOOL_MAX_TOKENS, "temperature": 0, **NO_THINKING,
    }
    content = client.post_json("/v1/messages", body)["content"]
    uses = [block for block in content if block.get("type") == "tool_use"]
    assert uses, f"no tool_use block in {[b.get('type') for b in content]}"
    assert uses[0]["name"] == TOOL_NAME, f"called {uses[0]['name']!r}"
    return tool_args_ok(uses[0]["input"])


# ---- images (VISION on) ------------------------------------------------------------------

IMAGE_SIDE = 64  # pixels: 4 tokens of the real tower (patch 16, merged 2 x 2), and of the tiny one
IMAGE_PROMPT = "What colour is this picture?"
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"not an image, only text").decode()
REMOTE_IMAGE = "https://example.com/picture.png"
# What a server that takes no images answers the first one (ours, and vLLM's own limit).
VISION_OFF = (VISION_OFF_MESSAGE, "At most 0 image(s)")


def png_base64(side: int = IMAGE_SIDE) -> str:
    """A ``side`` x ``side`` PNG, two colours (a diagonal split), as base64."""
    from PIL import Image

    image = Image.new("RGB", (side, side), (30, 110, 200))
    image.paste((230, 180, 40), (0, 0, side // 2, side // 2))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def _image_chat_body(model: str, url: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": IMAGE_PROMPT}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **NO_THINKING}


def _answered_chat(response: httpx.Response) -> str:
    assert response.status_code == 200, f"expected 200, got {response.status_code}: {response.text[:200]}"
    data = response.json()
    assert data["usage"]["completion_tokens"] > 0, "no completion tokens"
    return f"{data['usage']['prompt_tokens']} prompt tokens with the image, {data['usage']['completion_tokens']} out"


def _image_messages(client: StackClient, model: str) -> str:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64()}}
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **NO_THINKING,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": IMAGE_PROMPT}]}]}
    response = client.post("/v1/messages", body)
    assert response.status_code == 200, f"expected 200, got {response.status_code}: {response.text[:200]}"
    data = response.json()
    assert data["content"] and data["usage"]["output_tokens"] > 0, "empty answer"
    return f"{data['usage']['input_tokens']} input tokens with the image"


def _image_checks(report: Report, client: StackClient, model: str) -> None:
    try:
        first = client.post("/v1/chat/completions", _image_chat_body(model, f"data:image/png;base64,{png_base64()}"))
    except CHECK_ERRORS as exc:
        report.add("image chat", model, False, f"{type(exc).__name__}: {exc}"[:300])
        return
    if first.status_code == 400 and any(said in first.text for said in VISION_OFF):
        return  # VISION off: no image checks, the text-only report
    report.run("image chat", model, lambda: _answered_chat(first))
    report.run("image messages", model, lambda: _image_messages(client, model))
    for label, url in (("not an image -> 400", NOT_AN_IMAGE), ("image URL -> 400", REMOTE_IMAGE)):
        report.run(label, model,
                   lambda url=url: _expect_status(client.post("/v1/chat/completions", _image_chat_body(model, url)), 400))


# ---- error paths ------------------------------------------------------------------------


def _expect_status(response: httpx.Response, expected: int) -> str:
    assert response.status_code == expected, f"expected {expected}, got {response.status_code}: {response.text[:160]}"
    return f"{response.status_code}"


def _chat_body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def validate_apis(client: StackClient, models: list[str] | None = None, *, has_key: bool) -> Report:
    report = Report("validate apis", client.base_url)
    try:
        listed = client.model_ids()
    except httpx.HTTPStatusError as exc:
        report.add("list models", "-", False, f"/v1/models answered {exc.response.status_code} (wrong or missing key?)")
        return report
    models = models or listed
    for model in models:
        if model not in listed:
            report.add("listed in /v1/models", model, False, f"/v1/models lists {listed}")
            continue
        for label, call in (("chat", _chat), ("completions", _completions), ("responses", _responses),
                            ("messages", _messages)):
            report.run(label, model, lambda call=call: call(client, model, False))
            report.run(f"{label} stream", model, lambda call=call: call(client, model, True))
        report.run("tool call chat", model, lambda: _tool_chat(client, model))
        report.run("tool call responses", model, lambda: _tool_responses(client, model))
        report.run("tool call messages", model, lambda: _tool_messages(client, model))
        _image_checks(report, client, model)
        report.run("invalid parameters -> 400", model,
             lambda: _expect_status(client.post("/v1/chat/completions", _chat_body(model, temperature=-1)), 400))
        if has_key:
            report.run("missing key -> 401", model,
                 lambda: _expect_status(client.post("/v1/chat/completions", _chat_body(model), api_key=None), 401))
            report.run("wrong key -> 401", model, lambda: _expect_status(
                client.post("/v1/chat/completions", _chat_body(model), api_key="wrong-key-" + "x" * 16), 401))
        else:
            report.skip("missing/wrong key -> 401", model, "no API key given: cannot tell an open server from a bug")
    report.run("unknown model -> 404", "qwen38-no-such-model",
         lambda: _expect_status(client.post("/v1/chat/completions", _chat_body("qwen38-no-such-model")), 404))
    return report
