"""Patches 0080, 0082, 0084: what agent clients send and expect back, in vLLM's own request
models and Anthropic converters, on the patched tree and on stock 0.28.0 (child processes with
a view of the installed tree; no engine). The same behaviour against the real server, through
the official SDKs: tests/integration/test_agent_clients.py."""

from __future__ import annotations

import pytest

from tests.support.vllm_views import json_in_views

pytestmark = pytest.mark.slow  # imports vLLM in child processes

PROBE = r'''
import asyncio
import json

from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse)

out = {}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(**extra):
    try:
        request = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **extra})
    except Exception as exc:
        return {"ok": False, "error": str(exc)[:300]}
    return {"ok": True, "tools": request.tools, "tool_choice": request.tool_choice}


out["chat_tools_empty"] = chat(tools=[])
out["chat_tools_empty_auto"] = chat(tools=[], tool_choice="auto")
out["chat_tools_empty_required"] = chat(tools=[], tool_choice="required")
out["chat_tools_empty_named"] = chat(tools=[], tool_choice={"type": "function", "function": {"name": "get_weather"}})
out["chat_one_tool"] = {k: str(v) for k, v in chat(tools=[TOOL]).items()}


def anthropic(**extra):
    request = AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": USER, **extra})
    chat_request = AnthropicServingMessages._convert_anthropic_to_openai_request(request)
    choice = chat_request.tool_choice
    return {"kwargs": chat_request.chat_template_kwargs, "tools": chat_request.tools,
            "tool_choice": choice if choice is None or isinstance(choice, str) else "named"}


out["messages_tools_empty"] = anthropic(tools=[])
out["thinking_enabled"] = anthropic(thinking={"type": "enabled", "budget_tokens": 1024})["kwargs"]
out["thinking_adaptive"] = anthropic(thinking={"type": "adaptive"})["kwargs"]
out["thinking_disabled"] = anthropic(thinking={"type": "disabled"}, chat_template_kwargs={"x": 1})["kwargs"]
out["thinking_explicit_kwargs_win"] = anthropic(
    thinking={"type": "enabled"}, chat_template_kwargs={"enable_thinking": False})["kwargs"]
out["thinking_absent"] = anthropic()["kwargs"]

# A forced call as the chat side answers it: OpenAI's convention, finish_reason "stop".
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
converter = AnthropicServingMessages.__new__(AnthropicServingMessages)
converter.stop_reason_map = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def full(finish, calls):
    response = ChatCompletionResponse.model_validate({
        "id": "c1", "object": "chat.completion", "created": 0, "model": "m", "usage": USAGE,
        "choices": [{"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": None if calls else "hello", "tool_calls": calls}}]})
    message = converter.messages_full_converter(response)
    return {"stop_reason": message.stop_reason, "blocks": [b.type for b in message.content]}


out["full_named_call"] = full("stop", [CALL])
out["full_text"] = full("stop", [])
out["full_cut"] = full("length", [CALL])


def chunk(choices, usage=None):
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices}
    if usage:
        body["usage"] = usage
    return "data: " + ChatCompletionStreamResponse.model_validate(body).model_dump_json() + "\n\n"


async def stream(finish, with_call):
    async def chat_stream():
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        if with_call:
            yield chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, **CALL}]}}])
        else:
            yield chunk([{"index": 0, "delta": {"content": "hello"}}])
        yield chunk([{"index": 0, "delta": {}, "finish_reason": finish}])
        yield chunk([], usage=USAGE)
        yield "data: [DONE]\n\n"

    events = []
    async for item in converter.message_stream_converter(chat_stream()):
        data = json.loads(item.split("data: ", 1)[1])
        events.append(data)
    stop = [e["delta"].get("stop_reason") for e in events if e["type"] == "message_delta"]
    started = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    partial = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    return {"stop_reason": stop, "started": started, "partial_json": partial}


out["stream_named_call"] = asyncio.run(stream("stop", True))
out["stream_text"] = asyncio.run(stream("stop", False))
out["stream_cut"] = asyncio.run(stream("length", True))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def probes(vllm_views) -> dict[str, dict]:
    return json_in_views(PROBE, vllm_views, timeout=600)


def test_patched_chat_takes_an_empty_tools_array_as_no_tools(probes):
    patched = probes["patched"]
    for case in ("chat_tools_empty", "chat_tools_empty_auto"):
        assert patched[case] == {"ok": True, "tools": None, "tool_choice": "none"}, case
    assert patched["chat_one_tool"]["tool_choice"] == "auto"  # one tool: unchanged


def test_patched_chat_still_refuses_a_forced_choice_with_no_tool(probes):
    for case in ("chat_tools_empty_required", "chat_tools_empty_named"):
        result = probes["patched"][case]
        assert result["ok"] is False and "`tools` must be set" in result["error"], result


def test_stock_chat_refuses_an_empty_tools_array(probes):
    result = probes["stock"]["chat_tools_empty"]
    assert result["ok"] is False and "must not be an empty array" in result["error"]


def test_patched_messages_with_an_empty_tools_array_are_a_request_without_tools(probes):
    assert probes["patched"]["messages_tools_empty"] == {"kwargs": None, "tools": None, "tool_choice": None}
    assert probes["stock"]["messages_tools_empty"]["tools"] == []  # handed on, with "auto"
    assert probes["stock"]["messages_tools_empty"]["tool_choice"] == "auto"


def test_patched_anthropic_thinking_field_sets_enable_thinking(probes):
    patched = probes["patched"]
    assert patched["thinking_enabled"] == {"enable_thinking": True}
    assert patched["thinking_adaptive"] == {"enable_thinking": True}
    assert patched["thinking_disabled"] == {"x": 1, "enable_thinking": False}
    assert patched["thinking_explicit_kwargs_win"] == {"enable_thinking": False}
    assert patched["thinking_absent"] is None


def test_stock_anthropic_ignores_the_thinking_field(probes):
    assert probes["stock"]["thinking_enabled"] is None
    assert probes["stock"]["thinking_disabled"] == {"x": 1}


def test_patched_named_tool_call_ends_with_tool_use(probes):
    patched = probes["patched"]
    assert patched["full_named_call"] == {"stop_reason": "tool_use", "blocks": ["tool_use"]}
    assert patched["stream_named_call"]["stop_reason"] == ["tool_use"]
    assert patched["stream_named_call"]["started"] == ["tool_use"]
    assert patched["stream_named_call"]["partial_json"] == '{"city": "Paris"}'


def test_patched_text_and_cut_turns_keep_their_stop_reason(probes):
    patched = probes["patched"]
    assert patched["full_text"]["stop_reason"] == "end_turn"
    assert patched["stream_text"]["stop_reason"] == ["end_turn"]
    assert patched["full_cut"]["stop_reason"] == "max_tokens"
    assert patched["stream_cut"]["stop_reason"] == ["max_tokens"]


def test_stock_named_tool_call_ends_with_end_turn(probes):
    assert probes["stock"]["full_named_call"]["stop_reason"] == "end_turn"
    assert probes["stock"]["stream_named_call"]["stop_reason"] == ["end_turn"]
