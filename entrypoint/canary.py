"""The canary: one short greedy chat answer, the proof that a server generates.

The readiness gate sends it once per start (`entrypoint.ready`), the watchdog again on an
interval (`entrypoint.watchdog`); both through `ask_canary`, so both ask exactly the same
question and a later answer can be compared with the gate's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from core.errors import ReadinessError
from entrypoint.client import StackClient

CANARY_PROMPT = "Write one sentence about caches."
CANARY_TOKENS = 12


@dataclass(frozen=True)
class CanaryAnswer:
    text: str
    tokens: int  # completion tokens the server counted
    seconds: float  # request sent -> answer parsed


def canary_body(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": CANARY_PROMPT}],
        "max_tokens": CANARY_TOKENS,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def ask_canary(client: StackClient, model: str) -> CanaryAnswer:
    """Send the canary to ``model``; `ReadinessError` when it answers without a token.

    HTTP failures propagate as httpx errors (the client's own timeouts apply)."""
    start = time.monotonic()
    data = client.post_json("/v1/chat/completions", canary_body(model))
    seconds = time.monotonic() - start
    tokens = int(data.get("usage", {}).get("completion_tokens", 0))
    if tokens < 1:
        raise ReadinessError(f"canary on {model}: no tokens generated")
    return CanaryAnswer(text=data["choices"][0]["message"].get("content") or "", tokens=tokens, seconds=seconds)
