"""The one ASGI middleware `qwen38 serve` installs around vLLM's app (``--middleware``).

vLLM 0.28.0 adds a ``--middleware`` class with ``app.add_middleware(cls)`` after its own,
so it wraps everything else, and passes it no arguments: what it needs comes from the
engine's environment, which the supervisor (`entrypoint.supervise`) sets:

- `API_KEY_ENV`: the API key (`entrypoint.auth.ApiKeyGuard`);
- `INSTANCE_ENV`: this start's instance id, sent back as the `INSTANCE_HEADER` response
  header on every answer, so the readiness gate and the healthcheck can tell the server
  they started from another one on the same port.

Inside the guard, `entrypoint.drain.ShutdownDrain` ends open responses when the server
stops, and inside that `entrypoint.image_requests.ImageRequestGuard` answers 400 for images the
server will not read (its limits: `entrypoint.image_requests.VISION_ENV`). The YAML ``--config`` turns a list into one ``--middleware`` flag with several
values, which argparse's ``append`` does not take: hence one class composing the layers.
"""

from __future__ import annotations

import os

from entrypoint.auth import ApiKeyGuard, ASGIApp, Message, Receive, Scope, Send
from entrypoint.drain import ShutdownDrain
from entrypoint.image_requests import ImageRequestGuard

API_KEY_ENV = "QWEN38_API_KEY"
INSTANCE_ENV = "QWEN38_INSTANCE"
INSTANCE_HEADER = "x-qwen38-instance"
MIDDLEWARE_PATH = "entrypoint.asgi.StackMiddleware"


class StackMiddleware:
    """Instance header (outermost) -> API key guard -> shutdown drain -> image checks -> vLLM's app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = ApiKeyGuard(ShutdownDrain(ImageRequestGuard(app)), os.environ.get(API_KEY_ENV) or None)
        instance = os.environ.get(INSTANCE_ENV)
        self._instance = instance.encode("ascii") if instance else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._instance is None:
            await self.app(scope, receive, send)
            return
        instance = self._instance

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*(message.get("headers") or []), (INSTANCE_HEADER.encode(), instance)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)
