"""When the server starts to exit, every response still open is ended by `ShutdownDrain`: a
stream gets a final error event that the official SDKs raise, an unanswered request a 503;
requests that finished are untouched. Against the real vLLM server: tests/integration/test_faults.py."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from entrypoint.drain import SHUTDOWN_MESSAGE, ShutdownDrain, terminal_event

CHAT_CHUNK = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
              "choices": [{"index": 0, "delta": {"content": "hel"}, "finish_reason": None}]}  # fmt: skip
MESSAGE_START = {"type": "message_start", "message": {
    "id": "m1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
    "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}  # fmt: skip


def _endless(first: bytes):
    async def endpoint(request):
        async def body():
            yield first
            await asyncio.Event().wait()  # an engine that is gone never answers again

        return StreamingResponse(body(), media_type="text/event-stream")

    return endpoint


async def _never(request):
    await asyncio.Event().wait()


async def _quick(request):
    return JSONResponse({"answer": 42})


@pytest.fixture
def app() -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _endless(b"data: " + json.dumps(CHAT_CHUNK).encode() + b"\n\n"), methods=["POST"]),
            Route("/v1/messages", _endless(b"event: message_start\ndata: " + json.dumps(MESSAGE_START).encode() + b"\n\n"),
                  methods=["POST"]),
            Route("/v1/completions", _never, methods=["POST"]),
            Route("/quick", _quick),
        ]
    )
    app.state.server = SimpleNamespace(should_exit=False)  # what vLLM's serve_http keeps there
    app.add_middleware(ShutdownDrain)
    return app


def _exit_soon(app: Starlette, after: float = 0.5) -> None:
    threading.Timer(after, lambda: setattr(app.state.server, "should_exit", True)).start()


def test_an_open_openai_stream_ends_with_an_error_the_sdk_raises(app):
    _exit_soon(app)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=TestClient(app), max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    seen = []
    with pytest.raises(openai.APIError, match="shutting down"):
        for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["hel"]


def test_an_open_anthropic_stream_ends_with_an_error_the_sdk_raises(app):
    _exit_soon(app)
    client = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=TestClient(app), max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="shutting down"):
        with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as stream:
            for _ in stream:
                pass


def test_a_request_not_yet_answered_gets_503(app):
    _exit_soon(app)
    response = TestClient(app).post("/v1/completions", json={})
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["message"] == SHUTDOWN_MESSAGE


def test_a_request_answered_before_the_exit_is_untouched_one_after_it_gets_503(app):
    client = TestClient(app)
    assert client.get("/quick").json() == {"answer": 42}
    app.state.server.should_exit = True
    assert client.get("/quick").status_code == 503  # the engine is gone: nothing may wait on it


def test_terminal_events_match_each_api():
    assert terminal_event("/v1/messages").startswith(b"event: error\n")
    assert terminal_event("/v1/responses").startswith(b"event: error\n")
    data = json.loads(terminal_event("/v1/chat/completions").removeprefix(b"data: "))
    assert data["error"]["code"] == 503
