"""Inducing a silent engine stall in a real `qwen38 serve` (tests/conftest.py `Server`).

`engine_core_pid` finds vLLM's engine core among the engine's process group (the run record
names the group: the API server's pid); `paused` stops it with SIGSTOP and always resumes
it: the API server keeps answering /health and /metrics meanwhile, the silent failure the
watchdog exists for. `StreamingRequest` is a long streamed completion in a thread, so a
test can pause the engine while a request is running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx

from entrypoint.lifecycle import group_members, read_record
from entrypoint.run_files import record_path


def engine_core_pid(server) -> int:
    """The ``VLLM::EngineCore`` process of ``server`` (vLLM names it with setproctitle)."""
    record = read_record(record_path(server.cache_dir, server.profile))
    assert record is not None, "the server has no run record (not running?)"
    cores = []
    for pid in group_members(record.engine_pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                cores.append(pid)
    assert len(cores) == 1, f"expected one engine core in group {record.engine_pid}, found {cores}"
    return cores[0]


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class StreamingRequest(threading.Thread):
    """A streamed /v1/completions of ``max_tokens`` tokens (EOS ignored) in a thread."""

    def __init__(self, server, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.model, self.max_tokens = server, model, max_tokens
        self.first_token = threading.Event()
        self._cancel = threading.Event()
        self.tokens = 0  # completion tokens, from the closing usage event
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": self.model, "prompt": "Count the caches:", "max_tokens": self.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        headers = {"Authorization": f"Bearer {self.server.api_key}"}
        try:
            with httpx.stream(
                "POST", f"{self.server.base_url}/v1/completions", json=body, headers=headers, timeout=300
            ) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if self._cancel.is_set():
                        return  # closing the stream aborts the request in vLLM
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if event.get("usage"):
                        self.tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and event["choices"][0].get("text"):
                        self.first_token.set()
        except BaseException as exc:  # reported by the test that reads .error
            self.error = exc
        finally:
            self.first_token.set()

    def cancel(self, timeout: float = 30) -> None:
        """Stop reading (the server aborts the request) and wait for the thread."""
        self._cancel.set()
        self.join(timeout)
