"""End every open response at shutdown, with a clear message, so no client waits on a dead engine.

On SIGTERM vLLM 0.28.0 stops its engine first (``--shutdown-timeout`` seconds of drain, then
the engine core is killed), then asks uvicorn to exit; uvicorn waits, without a limit, for
every connection to close. A request still open then waits on an engine that is gone (its
stream gets no more data and no end), or gets whatever error the engine's death surfaces as
(``EngineCore encountered an issue``, or an internal validation error on /v1/messages).

`ShutdownDrain` ends open responses itself, in two ways:

- the supervisor (`entrypoint.supervise`) sends `STOP_SIGNAL` (SIGUSR1) just before it
  forwards SIGTERM: from then on a new request gets 503, and whatever is still open
  `DRAIN_ENV` seconds later (the drain; 0: at once) is ended. vLLM's own drain is rendered
  `ENGINE_GRACE_S` longer, so this happens while its engine still runs and the cancelled
  requests are aborted cleanly there;
- as a fallback (SIGTERM sent to vLLM directly, or the engine died), when uvicorn's
  ``should_exit`` is set, which vLLM does once the engine has stopped.

Ending a response: a stream (``text/event-stream``) gets one final error event in its API's
format (the OpenAI SDK raises ``APIError``, the Anthropic SDK ``APIStatusError``) and its end;
a response not yet started gets 503 with ``Retry-After``; anything else half-sent is cut (the
client sees an incomplete body, not a hang). The request's own task is then cancelled, so
uvicorn's shutdown finishes at once. A request that completes in time is untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from typing import Any

from entrypoint.auth import ASGIApp, Message, Receive, Scope, Send

DRAIN_ENV = "QWEN38_DRAIN_S"
STOP_SIGNAL = signal.SIGUSR1
ENGINE_GRACE_S = 3  # vLLM's drain runs this much longer than ours: we end streams first, its
# engine then tears down (workers, memory) before vLLM would kill it
POLL_S = 0.1
SHUTDOWN_MESSAGE = "the server is shutting down: this request was ended before it finished; retry it"


def terminal_event(path: str) -> bytes:
    """The last server-sent event of a stream ended by shutdown, in the format of its API."""
    if path.startswith("/v1/messages"):
        data: dict[str, Any] = {"type": "error", "error": {"type": "api_error", "message": SHUTDOWN_MESSAGE}}
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": "server_shutting_down", "message": SHUTDOWN_MESSAGE, "param": None,
                "sequence_number": 0}  # fmt: skip
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    data = {"error": {"message": SHUTDOWN_MESSAGE, "type": "server_error", "param": None, "code": 503}}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def unavailable_body(path: str) -> bytes:
    if path.startswith("/v1/messages"):
        return json.dumps({"type": "error", "error": {"type": "api_error", "message": SHUTDOWN_MESSAGE}}).encode()
    error = {"message": SHUTDOWN_MESSAGE, "type": "server_error", "param": None, "code": 503}
    return json.dumps({"error": error}).encode()


class _Exchange:
    """One open HTTP request: what of its response has been sent."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.streaming = False
        self.ended_by_shutdown = False

    async def send(self, message: Message) -> None:
        if self.ended_by_shutdown:
            return  # the request's task is being cancelled; its late messages go nowhere
        if message["type"] == "http.response.start":
            self.started = True
            for name, value in message.get("headers") or []:
                if name.lower() == b"content-type" and value.lower().startswith(b"text/event-stream"):
                    self.streaming = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)


class _Shutdown:
    """The shutdown state of one event loop: admitting, then closing, then ending."""

    def __init__(self, loop: asyncio.AbstractEventLoop, server: Any, drain_s: float) -> None:
        self.closing = False  # no new request is admitted
        self.ending = asyncio.Event()  # open requests are ended now
        self._loop = loop
        self._drain_s = drain_s
        self._server = server
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(STOP_SIGNAL, self.begin)
        if server is not None and hasattr(server, "should_exit"):
            self._watch = loop.create_task(self._wait_for_exit())

    def begin(self) -> None:
        if self.closing:
            return
        self.closing = True
        self._loop.call_later(self._drain_s, self.ending.set)

    async def _wait_for_exit(self) -> None:
        while not self._server.should_exit:
            await asyncio.sleep(POLL_S)
        self.closing = True
        self.ending.set()

    @property
    def admitting(self) -> bool:
        return not (self.closing or (self._server is not None and getattr(self._server, "should_exit", False)))


class ShutdownDrain:
    """Pure ASGI middleware; a pass-through until the server that runs it begins to stop."""

    def __init__(self, app: ASGIApp, drain_s: float | None = None) -> None:
        self.app = app
        self.drain_s = float(os.environ.get(DRAIN_ENV, "0") or 0) if drain_s is None else drain_s
        self._states: dict[asyncio.AbstractEventLoop, _Shutdown] = {}

    def _state(self, scope: Scope) -> _Shutdown:
        loop = asyncio.get_running_loop()  # one state per loop (vLLM runs one; test clients several)
        if loop not in self._states:
            # vLLM's serve_http keeps the uvicorn server on the app's state (launcher.py).
            server = getattr(getattr(scope.get("app"), "state", None), "server", None)
            self._states[loop] = _Shutdown(loop, server, self.drain_s)
        return self._states[loop]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "lifespan"):
            await self.app(scope, receive, send)
            return
        state = self._state(scope)
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(send)
        path = scope.get("path", "")
        if not state.admitting:  # no new work once the server is stopping
            await _end(exchange, path, send)
            return
        request = asyncio.ensure_future(self.app(scope, receive, exchange.send))
        ending = asyncio.ensure_future(state.ending.wait())
        try:
            await asyncio.wait({request, ending}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            request.cancel()
            ending.cancel()
            raise
        if request.done():
            ending.cancel()
            request.result()  # re-raises what the app raised
            return
        exchange.ended_by_shutdown = True
        request.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(request, timeout=1.0)
        await _end(exchange, path, send)


async def _end(exchange: _Exchange, path: str, send: Send) -> None:
    if exchange.finished:
        return
    if not exchange.started:
        body = unavailable_body(path)
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", b"5"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
    elif exchange.streaming:
        await send({"type": "http.response.body", "body": terminal_event(path), "more_body": False})
    else:
        raise RuntimeError("response cut by shutdown")  # uvicorn closes the connection
