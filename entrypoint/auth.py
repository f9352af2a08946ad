"""The API key guard around vLLM's whole app: closed unless a route is on the allow-list.

vLLM 0.28.0's own check (``--api-key`` / ``VLLM_API_KEY``) guards only the path prefixes
``/v1``, ``/v2``, ``/inference`` and ``/cohere``, and reads only ``Authorization: Bearer``:
``/invocations``, ``/tokenize``, ``/generative_scoring``, ``/scale_elastic_ep``, ``/docs``
and the rest answer anyone. `ApiKeyGuard` inverts that: with a key configured, a request
passes only when its path is in `OPEN_PATHS` or it carries the key, so a route a later vLLM
adds is closed until someone decides otherwise. `qwen38 serve` installs it (through
`entrypoint.asgi.StackMiddleware`, vLLM's ``--middleware``) as the outermost layer, and the
key travels to the engine only under our own variable, so vLLM's narrower check is not
installed beside it (it would refuse the ``x-api-key`` form this guard accepts).

Open without a key, and why: ``/health`` and ``/ping`` answer 200 with an empty body while
the server is up (liveness for load balancers and the container healthcheck); they reveal
no model, version or load. ``/metrics``, ``/version``, ``/load``, the docs and everything
else need the key. A CORS preflight (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) is let through: vLLM's CORS middleware answers it itself
and no route runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping"})
KEY_HEADERS = ("authorization: Bearer <key>", "x-api-key: <key>")  # what the 401 names
UNAUTHORIZED_MESSAGE = (
    "missing or wrong API key: send it as `Authorization: Bearer <key>` (OpenAI clients) "
    "or `x-api-key: <key>` (Anthropic clients)"
)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Every key the request offers: ``Authorization: Bearer <key>`` and ``x-api-key: <key>``."""
    found: list[bytes] = []
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                found.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            found.append(value.strip())
    return found


def is_open(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """A request that needs no key: an allow-listed path, or a CORS preflight."""
    if path in OPEN_PATHS:
        return True
    if method == "OPTIONS":
        names = {name.lower() for name, _ in headers}
        return b"origin" in names and b"access-control-request-method" in names
    return False


class ApiKeyGuard:
    """Pure ASGI middleware: 401 (HTTP) or close 1008 (WebSocket) without the key."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        # Compared as digests in constant time: neither the length nor a prefix leaks.
        self._key_digest = _digest(api_key.encode("utf-8")) if api_key else None

    def allows(self, scope: Scope) -> bool:
        if self._key_digest is None:
            return True  # no key configured: the settings allow only a loopback address then
        headers = list(scope.get("headers") or [])
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if is_open(scope.get("method", "GET"), path, headers):
            return True
        matched = False
        for key in presented_keys(headers):
            matched |= hmac.compare_digest(_digest(key), self._key_digest)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
        else:
            await send_unauthorized(scope, send)


async def send_unauthorized(scope: Scope, send: Send) -> None:
    path = scope.get("path", "")
    if path.startswith("/v1/messages"):  # Anthropic's error shape for its own API
        error = {"type": "authentication_error", "message": UNAUTHORIZED_MESSAGE}
        body: dict[str, Any] = {"type": "error", "error": error}
    else:
        body = {"error": {"message": UNAUTHORIZED_MESSAGE, "type": "authentication_error", "param": None, "code": 401}}
    payload = json.dumps(body).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"www-authenticate", b'Bearer realm="qwen38"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
