"""`qwen38 bench shutdown --profile P`: what SIGTERM does to open streams, and how long the stop takes.

Starts `qwen38 serve --profile P` as a user would (like `bench startup`), waits for the
readiness gate, then opens one long streaming answer with each official SDK (OpenAI chat
completions, Anthropic messages; ``max_tokens`` 3000, ``ignore_eos``) and, once both are
streaming, one short OpenAI stream (``--short-tokens``, a request a drain can finish). As
soon as the short one has its first token, `qwen38 serve` gets SIGTERM. Recorded for each
client: what it saw (a finish and its reason, or the exception type and message), how many
events it had, and when, counted from the SIGTERM; and when `qwen38 serve` exited (its
engine's processes are gone by then, `entrypoint.supervise`); and what a request sent half
a second after the SIGTERM gets.

``--shutdown-timeout N`` sets SHUTDOWN_TIMEOUT (the drain) for the run; without it the
profile's value applies.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from core.errors import BenchError
from entrypoint.client import StackClient

LONG_TOKENS = 3000
LATE_S = 0.5  # a request sent this long after SIGTERM: what a client arriving mid-stop sees
PROMPT = [{"role": "user", "content": "Tell me a long story."}]


@dataclass
class StreamProbe:
    """One streaming client, run in a thread: what it received and how it ended."""

    client: str
    max_tokens: int
    events: int = 0
    events_at_stop: int | None = None
    outcome: str = "running"  # "finished" | "error" | "running" (still open when given up on)
    detail: str = ""
    ended_at: float | None = None  # time.monotonic()
    seconds_after_stop: float | None = None

    def end(self, outcome: str, detail: str) -> None:
        self.outcome, self.detail, self.ended_at = outcome, detail, time.monotonic()


def _run_openai(probe: StreamProbe, base_url: str, api_key: str, timeout: float) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=timeout, max_retries=0)
    try:
        stream = client.chat.completions.create(
            model=_model(base_url, api_key), messages=PROMPT, max_tokens=probe.max_tokens, stream=True,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
        reason = None
        for chunk in stream:
            probe.events += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        probe.end("finished", f"finish_reason={reason}")
    except Exception as exc:  # what the caller sees is the measurement
        probe.end("error", f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:160]}")


def _run_anthropic(probe: StreamProbe, base_url: str, api_key: str, timeout: float) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    try:
        with client.messages.stream(
            model=_model(base_url, api_key), messages=PROMPT, max_tokens=probe.max_tokens,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
        ) as stream:  # fmt: skip
            for _ in stream:
                probe.events += 1
            probe.end("finished", f"stop_reason={stream.get_final_message().stop_reason}")
    except Exception as exc:
        probe.end("error", f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:160]}")


_models: dict[str, str] = {}


def _model(base_url: str, api_key: str) -> str:
    if base_url not in _models:

        with StackClient(base_url, api_key) as client:
            _models[base_url] = client.model_ids()[0]
    return _models[base_url]


def _start(target, probe: StreamProbe, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=(probe, *args), name=probe.client, daemon=True)
    thread.start()
    return thread


def _wait_for_events(probes: list[StreamProbe], deadline: float) -> None:
    while any(p.events < 3 for p in probes):
        ended = [p for p in probes if p.outcome != "running"]
        if ended:
            raise BenchError(f"{ended[0].client} ended before the stop: {ended[0].detail}")
        if time.monotonic() > deadline:
            raise BenchError("the streams did not start within the timeout")
        time.sleep(0.05)


def stop_mid_stream(
    process: subprocess.Popen,
    base_url: str,
    api_key: str,
    *,
    short_tokens: int = 48,
    timeout: float = 180.0,
) -> dict[str, Any]:
    """SIGTERM ``process`` (a `qwen38 serve`) while three streams are open; what each client saw."""
    _model(base_url, api_key)
    deadline = time.monotonic() + timeout
    long_ones = [StreamProbe("openai", LONG_TOKENS), StreamProbe("anthropic", LONG_TOKENS)]
    threads = [
        _start(_run_openai, long_ones[0], base_url, api_key, timeout),
        _start(_run_anthropic, long_ones[1], base_url, api_key, timeout),
    ]
    _wait_for_events(long_ones, deadline)
    short = StreamProbe("openai-short", short_tokens)
    threads.append(_start(_run_openai, short, base_url, api_key, timeout))
    while short.events < 1:
        if short.outcome != "running" or time.monotonic() > deadline:
            raise BenchError(f"the short stream did not start: {short.detail or 'timeout'}")
        time.sleep(0.01)
    probes = [*long_ones, short]
    for probe in probes:
        probe.events_at_stop = probe.events
    stopped = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(LATE_S)
    late = _late_request(base_url, api_key)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"`qwen38 serve` did not exit within {timeout:.0f} s of SIGTERM") from None
    exit_s = time.monotonic() - stopped
    for thread in threads:
        thread.join(timeout=max(1.0, deadline - time.monotonic()))
    for probe in probes:
        if probe.ended_at is not None:
            probe.seconds_after_stop = round(probe.ended_at - stopped, 2)
    clients = [{k: v for k, v in asdict(p).items() if k != "ended_at"} for p in probes]
    return {"exit_s": round(exit_s, 2), "exit_code": process.returncode, "clients": clients, "late_request": late}


def _late_request(base_url: str, api_key: str) -> str:
    """What a request sent while the server stops gets (OpenAI SDK, no retries)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=30, max_retries=0)
    try:
        client.chat.completions.create(model=_model(base_url, api_key), messages=PROMPT, max_tokens=8)
        return "answered"
    except Exception as exc:
        return f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:160]}"

