"""`qwen38 validate clients`: what the official `openai` and `anthropic` SDKs get, for every id.

`validate apis` proves the HTTP surface with raw requests; this drives the deployment the way
agent harnesses do, through the SDKs, with nothing but what those clients send:

- OpenAI: chat (plain and streamed), responses (plain and streamed), a forced tool call and a
  tool-result round trip on chat and on responses, ``tools: []`` as "no tools", and the
  thinking switch the SDK has (``reasoning_effort``: "none" answers in ``content``, "high"
  reasons);
- Anthropic: messages (plain and streamed), a forced ``tool_use`` plain and streamed
  (``stop_reason: "tool_use"``, a ``tool_use`` block streamed as ``input_json_delta``), a
  ``tool_result`` round trip, ``tools: []``, and the ``thinking`` switch;
- on a server that takes images (VISION on): a PNG through each SDK (an ``image_url`` data URL,
  an ``image`` block), answered, and through each a picture that is not one, refused with 400.
  A server that takes none refuses the first image and gets no image rows.

No request carries ``chat_template_kwargs``: a check passes only if the server's defaults and
its mapping of the clients' own switches make it pass. The Anthropic client sends the key as
Anthropic clients do by default, in ``x-api-key`` (its ``api_key``; the server's key guard,
entrypoint/auth.py, accepts it beside ``Authorization: Bearer``, which `validate apis` uses).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from core.errors import SettingsError
from entrypoint.validate.apis import (
    IMAGE_PROMPT,
    NOT_AN_IMAGE,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_PROMPT,
    TOOL_SCHEMA,
    VISION_OFF,
    png_base64,
    tool_args_ok,
)
from entrypoint.validate.report import Report

PROMPT = "Name three things a cache is good for."
MAX_TOKENS = 16
TOOL_MAX_TOKENS = 64
TOOL_RESULT = "Paris: 18 degrees celsius, light rain, wind 12 km/h from the west."
# A forced call's arguments are closed by the grammar; "high" only has to turn reasoning on.
THINKING_ON = "high"

OPENAI_TOOL = {"type": "function",
               "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_SCHEMA}}
RESPONSES_TOOL = {"type": "function", "name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_SCHEMA}
ANTHROPIC_TOOL = {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}


def sdk_clients(base_url: str, api_key: str | None) -> tuple[Any, Any]:
    """The official SDK clients for a deployment (no retries: a failure shows at once)."""
    try:
        import anthropic
        import openai
    except ImportError as exc:
        raise SettingsError(f"validate clients needs the {exc.name} SDK: pip install openai anthropic") from None
    root = base_url.rstrip("/")
    # The OpenAI SDK insists on a key; an open server ignores the placeholder.
    oai = openai.OpenAI(base_url=f"{root}/v1", api_key=api_key or "no-key", max_retries=0, timeout=300)
    ant = anthropic.Anthropic(base_url=root, api_key=api_key or "no-key", max_retries=0, timeout=300)
    return oai, ant


def _errors() -> tuple[type[BaseException], ...]:
    import anthropic
    import jsonschema
    import openai

    return (openai.APIError, anthropic.APIError, jsonschema.ValidationError)


def _reasoning(message: Any) -> str:
    """vLLM's ``reasoning`` field on an OpenAI chat message (an extra field to the SDK)."""
    extra = getattr(message, "model_extra", None) or {}
    return getattr(message, "reasoning", None) or extra.get("reasoning") or ""


# ---- OpenAI SDK -------------------------------------------------------------------------


def _chat(oai: Any, model: str) -> str:
    done = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=MAX_TOKENS, temperature=0)
    message = done.choices[0].message
    assert message.content, f"no content (reasoning: {len(_reasoning(message))} chars)"
    return f"{done.usage.completion_tokens} tokens, finish {done.choices[0].finish_reason}"


def _chat_stream(oai: Any, model: str) -> str:
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text, "no content deltas"
    assert usage and usage.completion_tokens > 0, "no usage chunk"
    return f"{len(text)} chars, {usage.completion_tokens} tokens"


def _responses(oai: Any, model: str) -> str:
    done = oai.responses.create(model=model, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0)
    assert done.output_text, f"no output_text in {[item.type for item in done.output]}"
    return f"{done.usage.output_tokens} tokens, status {done.status}"


def _responses_stream(oai: Any, model: str) -> str:
    types, text = [], ""
    for event in oai.responses.create(model=model, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0,
                                      stream=True):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert text, f"no output_text deltas in {sorted(set(types))}"
    assert types[-1] in ("response.completed", "response.incomplete"), f"last event {types[-1]!r}"
    return f"{len(types)} events, {len(text)} chars"


def _forced_chat_call(oai: Any, model: str) -> tuple[Any, Any]:
    messages = [{"role": "user", "content": TOOL_PROMPT}]
    done = oai.chat.completions.create(model=model, messages=messages, tools=[OPENAI_TOOL],
                                       tool_choice={"type": "function", "function": {"name": TOOL_NAME}},
                                       max_tokens=TOOL_MAX_TOKENS, temperature=0)
    calls = done.choices[0].message.tool_calls or []
    assert calls, f"no tool_calls (finish {done.choices[0].finish_reason})"
    assert calls[0].function.name == TOOL_NAME, f"called {calls[0].function.name!r}"
    return done, calls[0]


def _tool_chat(oai: Any, model: str) -> str:
    _, call = _forced_chat_call(oai, model)
    return tool_args_ok(call.function.arguments)


def _tool_result_chat(oai: Any, model: str) -> str:
    first, call = _forced_chat_call(oai, model)
    messages = [
        {"role": "user", "content": TOOL_PROMPT},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    done = oai.chat.completions.create(model=model, messages=messages, tools=[OPENAI_TOOL], tool_choice="none",
                                       max_tokens=MAX_TOKENS, temperature=0)
    grew = done.usage.prompt_tokens - first.usage.prompt_tokens
    assert grew > 0, f"the tool result did not reach the prompt ({first.usage.prompt_tokens} -> " \
                     f"{done.usage.prompt_tokens} tokens)"
    assert done.choices[0].message.content, "no answer after the tool result"
    return f"prompt +{grew} tokens, answered {done.usage.completion_tokens} tokens"


def _forced_responses_call(oai: Any, model: str) -> Any:
    done = oai.responses.create(model=model, input=TOOL_PROMPT, tools=[RESPONSES_TOOL],
                                tool_choice={"type": "function", "name": TOOL_NAME},
                                max_output_tokens=TOOL_MAX_TOKENS, temperature=0)
    calls = [item for item in done.output if item.type == "function_call"]
    assert calls, f"no function_call in {[item.type for item in done.output]}"
    assert calls[0].name == TOOL_NAME, f"called {calls[0].name!r}"
    return done, calls[0]


def _tool_responses(oai: Any, model: str) -> str:
    _, call = _forced_responses_call(oai, model)
    return tool_args_ok(call.arguments)


def _tool_result_responses(oai: Any, model: str) -> str:
    first, call = _forced_responses_call(oai, model)
    items = [
        {"role": "user", "content": TOOL_PROMPT},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
    ]
    done = oai.responses.create(model=model, input=items, tools=[RESPONSES_TOOL], tool_choice="none",
                                max_output_tokens=MAX_TOKENS, temperature=0)
    grew = done.usage.input_tokens - first.usage.input_tokens
    assert grew > 0, f"the tool output did not reach the prompt ({first.usage.input_tokens} -> " \
                     f"{done.usage.input_tokens} tokens)"
    assert done.output_text, f"no answer after the tool output: {[item.type for item in done.output]}"
    return f"prompt +{grew} tokens, status {done.status}"


def _no_tools_chat(oai: Any, model: str) -> str:
    done = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], tools=[],
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.content, "no content"
    assert not done.choices[0].message.tool_calls, "a tool call with no tools"
    return f"{done.usage.completion_tokens} tokens"


def _no_tools_responses(oai: Any, model: str) -> str:
    done = oai.responses.create(model=model, input=PROMPT, tools=[], max_output_tokens=MAX_TOKENS, temperature=0)
    assert done.output_text, f"no output_text in {[item.type for item in done.output]}"
    return f"{done.usage.output_tokens} tokens"


def _thinking_switch_chat(oai: Any, model: str) -> str:
    """``reasoning_effort`` as the SDK sends it: "none" answers, "high" reasons first."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    off = oai.chat.completions.create(**body, reasoning_effort="none").choices[0].message
    on = oai.chat.completions.create(**body, reasoning_effort=THINKING_ON).choices[0].message
    assert off.content and not _reasoning(off), f"effort none: content {off.content!r}, reasoning {_reasoning(off)!r}"
    assert _reasoning(on), f"effort {THINKING_ON}: no reasoning (content {on.content!r})"
    return f"none -> content, {THINKING_ON} -> {len(_reasoning(on))} chars of reasoning"


# ---- Anthropic SDK ----------------------------------------------------------------------
# No `temperature`: the SDK (2.x) no longer takes it, as Anthropic's current models do not.


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _messages(ant: Any, model: str) -> str:
    done = ant.messages.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                               max_tokens=MAX_TOKENS)
    assert _text(done), f"no text in blocks {[b.type for b in done.content]}"
    assert done.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {done.stop_reason!r}"
    return f"{done.usage.output_tokens} tokens, stop {done.stop_reason}"


def _messages_stream(ant: Any, model: str) -> str:
    with ant.messages.stream(model=model, messages=[{"role": "user", "content": PROMPT}],
                             max_tokens=MAX_TOKENS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text, f"no text events (blocks {[b.type for b in final.content]})"
    assert text == _text(final), "streamed text differs from the final message"
    return f"{len(text)} chars, stop {final.stop_reason}"


def _forced_tool_use(ant: Any, model: str) -> tuple[Any, Any]:
    done = ant.messages.create(model=model, messages=[{"role": "user", "content": TOOL_PROMPT}],
                               tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": TOOL_NAME},
                               max_tokens=TOOL_MAX_TOKENS)
    uses = [block for block in done.content if block.type == "tool_use"]
    assert uses, f"no tool_use block in {[b.type for b in done.content]}"
    assert uses[0].name == TOOL_NAME, f"called {uses[0].name!r}"
    return done, uses[0]


def _tool_use(ant: Any, model: str) -> str:
    done, use = _forced_tool_use(ant, model)
    assert done.stop_reason == "tool_use", f"stop_reason {done.stop_reason!r} after a tool_use block"
    return tool_args_ok(use.input)


def _tool_use_stream(ant: Any, model: str) -> str:
    started, partial = [], []
    with ant.messages.stream(model=model, messages=[{"role": "user", "content": TOOL_PROMPT}],
                             tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": TOOL_NAME},
                             max_tokens=TOOL_MAX_TOKENS) as stream:
        for event in stream:
            if event.type == "content_block_start":
                started.append(event.content_block.type)
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert "tool_use" in started, f"no tool_use content_block_start (blocks started: {started})"
    assert partial, "no input_json_delta"
    assert final.stop_reason == "tool_use", f"stop_reason {final.stop_reason!r} after a tool_use block"
    use = next(block for block in final.content if block.type == "tool_use")
    assert json.loads("".join(partial)) == use.input, "the streamed input differs from the final block"
    return f"{len(partial)} input_json_delta, " + tool_args_ok(use.input)


def _tool_result_messages(ant: Any, model: str) -> str:
    first, use = _forced_tool_use(ant, model)
    messages = [
        {"role": "user", "content": TOOL_PROMPT},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]},
    ]
    done = ant.messages.create(model=model, messages=messages, tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"},
                               max_tokens=MAX_TOKENS)
    grew = done.usage.input_tokens - first.usage.input_tokens
    assert grew > 0, f"the tool result did not reach the prompt ({first.usage.input_tokens} -> " \
                     f"{done.usage.input_tokens} tokens)"
    assert _text(done), f"no answer after the tool result: {[b.type for b in done.content]}"
    return f"prompt +{grew} tokens, stop {done.stop_reason}"


def _no_tools_messages(ant: Any, model: str) -> str:
    done = ant.messages.create(model=model, messages=[{"role": "user", "content": PROMPT}], tools=[],
                               max_tokens=MAX_TOKENS)
    assert _text(done), f"no text in blocks {[b.type for b in done.content]}"
    return f"{done.usage.output_tokens} tokens"


def _thinking_switch_messages(ant: Any, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}
    off = ant.messages.create(**body, thinking={"type": "disabled"})
    on = ant.messages.create(**body, thinking={"type": "enabled", "budget_tokens": 1024})
    assert _text(off) and all(b.type != "thinking" for b in off.content), \
        f"disabled: blocks {[b.type for b in off.content]}"
    assert any(b.type == "thinking" for b in on.content), f"enabled: blocks {[b.type for b in on.content]}"
    return "disabled -> text, enabled -> thinking block"


OPENAI_CHECKS: tuple[tuple[str, Callable[[Any, str], str]], ...] = (
    ("openai chat", _chat),
    ("openai chat stream", _chat_stream),
    ("openai responses", _responses),
    ("openai responses stream", _responses_stream),
    ("openai tool call chat", _tool_chat),
    ("openai tool result chat", _tool_result_chat),
    ("openai tool call responses", _tool_responses),
    ("openai tool result responses", _tool_result_responses),
    ("openai tools [] chat", _no_tools_chat),
    ("openai tools [] responses", _no_tools_responses),
    ("openai reasoning_effort switch", _thinking_switch_chat),
)
ANTHROPIC_CHECKS: tuple[tuple[str, Callable[[Any, str], str]], ...] = (
    ("anthropic messages", _messages),
    ("anthropic messages stream", _messages_stream),
    ("anthropic tool_use", _tool_use),
    ("anthropic tool_use stream", _tool_use_stream),
    ("anthropic tool result", _tool_result_messages),
    ("anthropic tools []", _no_tools_messages),
    ("anthropic thinking switch", _thinking_switch_messages),
)


def _image_content(url: str) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": IMAGE_PROMPT}]


def _image_block(data: str) -> list[dict[str, Any]]:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    return [image, {"type": "text", "text": IMAGE_PROMPT}]


def _refused(call: Callable[[], Any]) -> str:
    """The SDK's 400 for a call that must be refused, with the server's reason."""
    import anthropic
    import openai

    try:
        call()
    except (openai.BadRequestError, anthropic.BadRequestError) as exc:
        return f"400: {str(exc)[:120]}"
    raise AssertionError("answered; expected a 400")


def _image_checks(report: Report, oai: Any, ant: Any, model: str, errors: tuple[type[BaseException], ...]) -> None:
    """The image rows, on a server that takes images (the first image's answer says which)."""
    import openai

    def chat(url: str) -> Any:
        return oai.chat.completions.create(model=model, messages=[{"role": "user", "content": _image_content(url)}],
                                           max_tokens=MAX_TOKENS, reasoning_effort="none")

    try:
        first = chat(f"data:image/png;base64,{png_base64()}")
    except openai.BadRequestError as exc:
        if any(said in str(exc) for said in VISION_OFF):
            return  # VISION off: the text-only report
        report.add("openai image chat", model, False, f"{type(exc).__name__}: {exc}"[:300])
        return
    except errors as exc:
        report.add("openai image chat", model, False, f"{type(exc).__name__}: {exc}"[:300])
        return

    def answered_chat() -> str:
        assert first.choices[0].message.content or _reasoning(first.choices[0].message), "empty answer"
        return f"{first.usage.prompt_tokens} prompt tokens with the image"

    def answered_message() -> str:
        message = ant.messages.create(model=model, max_tokens=MAX_TOKENS, thinking={"type": "disabled"},
                                      messages=[{"role": "user", "content": _image_block(png_base64())}])
        assert message.usage.output_tokens > 0, "empty answer"
        return f"{message.usage.input_tokens} input tokens with the image"

    report.run("openai image chat", model, answered_chat, errors)
    report.run("anthropic image message", model, answered_message, errors)
    report.run("openai not an image -> 400", model, lambda: _refused(lambda: chat(NOT_AN_IMAGE)), errors)
    not_png = NOT_AN_IMAGE.split(",", 1)[1]
    report.run("anthropic not an image -> 400", model, lambda: _refused(lambda: ant.messages.create(
        model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": _image_block(not_png)}])), errors)


def validate_clients(base_url: str, api_key: str | None, models: list[str] | None = None) -> Report:
    report = Report("validate clients", base_url)
    oai, ant = sdk_clients(base_url, api_key)
    errors = _errors()
    try:
        listed = [entry.id for entry in oai.models.list()]
    except errors as exc:
        report.add("list models", "-", False, f"{type(exc).__name__}: {exc}"[:300])
        return report
    for model in models or listed:
        if model not in listed:
            report.add("listed in /v1/models", model, False, f"/v1/models lists {listed}")
            continue
        for name, check in OPENAI_CHECKS:
            report.run(name, model, lambda check=check: check(oai, model), errors)
        for name, check in ANTHROPIC_CHECKS:
            report.run(name, model, lambda check=check: check(ant, model), errors)
        _image_checks(report, oai, ant, model, errors)
    return report
