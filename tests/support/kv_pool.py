"""The KV pool two ways, read from one `qwen38 serve` log: what the planner said before the
engine started ("qwen38: planned ...: KV pool N tokens ..., max concurrency X.XXx") and
what the engine then logged ("GPU KV cache size: N tokens, Maximum concurrency ... X.XXx").

`serve_until_pool_logged` starts `qwen38 serve --no-ready-gate` and stops it as soon as the
engine has logged its pool: the cheapest real start that answers the question (no
readiness gate, no requests), for the combinations no session server covers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import QWEN38, clean_env, free_port

PLANNED = re.compile(
    r"qwen38: (?:planned in [0-9.]+ s|plan reused): KV pool ([\d,]+) tokens \((patched|stock) vLLM\), "
    r"max concurrency ([\d.]+)x"
)
ENGINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")


@dataclass(frozen=True)
class Pools:
    planned_tokens: int
    planned_concurrency: str
    engine_tokens: int
    engine_concurrency: str
    tree: str  # the tree the plan answered for: patched or stock


def pools(log: str) -> Pools:
    planned, engine = PLANNED.search(log), ENGINE.search(log)
    assert planned, f"no planner line in the log:\n{log[-3000:]}"
    assert engine, f"the engine logged no KV cache size:\n{log[-3000:]}"
    return Pools(
        planned_tokens=int(planned[1].replace(",", "")),
        planned_concurrency=planned[3],
        engine_tokens=int(engine[1].replace(",", "")),
        engine_concurrency=engine[2],
        tree=planned[2],
    )


def serve_until_pool_logged(
    tmp: Path, models: Path, key_file: Path, profile: str = "cpu", timeout: float = 600, **settings: str
) -> str:
    """`qwen38 serve --profile P --no-ready-gate` until the engine logs its KV pool; the log."""
    return PoolLogged(tmp, models, key_file, profile, **settings).log_when_logged(timeout)


class PoolLogged:
    """`serve_until_pool_logged` in two halves: started at once, read (and stopped) when asked,
    so that other work runs while the engine starts."""

    def __init__(self, tmp: Path, models: Path, key_file: Path, profile: str = "cpu", **settings: str):
        self.log = tmp / "serve.log"
        env = clean_env(
            MODELS_DIR=str(models), API_KEY_FILE=str(key_file), PORT=str(free_port()), CACHE_DIR=str(tmp / "cache"),
            **settings,
        )  # fmt: skip
        with open(self.log, "w") as handle:
            self.process = subprocess.Popen(
                [*QWEN38, "serve", "--profile", profile, "--no-ready-gate"], env=env, cwd=tmp, stdout=handle,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.started = time.monotonic()

    def log_when_logged(self, timeout: float = 600) -> str:
        """Waits (at most ``timeout`` s from the start) for the engine's pool line, stops the
        engine, returns the log."""
        try:
            while not ENGINE.search(self.log.read_text(errors="replace")):
                if self.process.poll() is not None or time.monotonic() - self.started > timeout:
                    break
                time.sleep(1)
        finally:
            _stop_group(self.process)
        return self.log.read_text(errors="replace")


def _stop_group(process: subprocess.Popen) -> None:
    """End the engine and its processes (one group): SIGTERM, then SIGKILL after 15 s.
    An engine stopped in the middle of its start does not drain; nothing is in flight."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        process.poll()  # reap the leader once it exits
        time.sleep(0.5)
    else:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
