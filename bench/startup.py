"""`qwen38 bench startup --profile P`: wall time from `qwen38 serve` to a passed readiness gate.

Starts `qwen38 serve --profile P` as a user would (same settings, ``.env`` and models),
on its own port and cache directory, and measures, from the moment the process is
spawned:

- when ``/health`` first answers 200 (the engine is up);
- when the readiness gate has written a passing ``CACHE_DIR/run/P.status.json`` (the
  headline figure: the server has proved it serves what was pinned and answers);
- how long SIGTERM takes to end it afterwards.

The first run uses a fresh cache directory (no compile cache, no verify stat cache: every
file is hashed); later runs reuse it (a restart). ``--cache-dir`` measures with an existing
cache instead. Nothing is left running: the server is stopped after each run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from core.errors import BenchError
from core.settings import load_settings, load_settings_profile
from entrypoint.keys import init_key_file
from entrypoint.run_files import status_path

REPO = Path(__file__).resolve().parents[1]
_VERIFIED = re.compile(r"qwen38: verified \S+ in ([0-9.]+) s")
_PLANNED = re.compile(r"qwen38: (?:planned in ([0-9.]+) s|plan reused)")
_READY = re.compile(r"qwen38: ready in ([0-9.]+) s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen, timeout: float) -> float:
    """SIGTERM `qwen38 serve` (it stops the engine it supervises); its whole group if it will not go."""
    start = time.perf_counter()
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        pass
    else:  # a worker outlived the engine: do not leave it behind
        os.killpg(process.pid, signal.SIGKILL)
    return time.perf_counter() - start


def gate_verdict(status: Path, pid: int) -> dict[str, Any] | None:
    """The gate's verdict written by the supervisor ``pid`` (not a previous start's)."""
    try:
        found = json.loads(status.read_text())
    except (OSError, ValueError):
        return None
    return found if found.get("pid") == pid else None


def measure_start(
    profile: str, env: dict[str, str], cache_dir: Path, port: int, log: Path, timeout: float
) -> dict[str, Any]:
    """One `qwen38 serve` start: seconds to /health and to a passed gate, then the stop."""
    status = status_path(cache_dir, profile)
    status.unlink(missing_ok=True)  # only this start's verdict counts
    load_before = [round(x, 2) for x in os.getloadavg()]
    env = {**env, "PORT": str(port), "CACHE_DIR": str(cache_dir), "READY_TIMEOUT": str(int(timeout))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    url = f"http://127.0.0.1:{port}/health"
    health_s = None
    start = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "entrypoint.cli", "serve", "--profile", profile],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with httpx.Client(timeout=2.0) as http:
            while True:
                elapsed = time.perf_counter() - start
                if health_s is None:
                    try:
                        if http.get(url).status_code == 200:
                            health_s = elapsed
                    except httpx.HTTPError:
                        pass
                found = gate_verdict(status, process.pid)
                if found is not None:
                    verdict = found
                    ready_s = time.perf_counter() - start
                    break
                if process.poll() is not None:
                    raise BenchError(
                        f"`qwen38 serve --profile {profile}` exited ({process.returncode}) before the "
                        f"gate passed: {_log_tail(log)}"
                    )
                if elapsed > timeout:
                    raise BenchError(
                        f"`qwen38 serve --profile {profile}` not ready after {timeout:.0f} s "
                        f"(--timeout): {_log_tail(log)}"
                    )
                time.sleep(0.2)
    finally:
        stop_s = _stop(process, timeout=120)
    if not verdict.get("ready"):
        raise BenchError(f"the readiness gate failed: {verdict.get('error')}")
    text = log.read_text(errors="replace")
    verified = _VERIFIED.search(text)
    planned = _PLANNED.search(text)
    gate = _READY.search(text)
    return {
        "ready_s": round(ready_s, 2),
        "health_s": None if health_s is None else round(health_s, 2),
        "verify_s": float(verified.group(1)) if verified else None,
        # 0.0: the plan was reused from CACHE_DIR/plan
        "plan_s": (float(planned.group(1) or 0.0)) if planned else None,
        "gate_s": float(gate.group(1)) if gate else None,
        "stop_s": round(stop_s, 2),
        "identity": verdict.get("identity"),
        "loadavg_before": load_before,
    }


THROWAWAY_KEY = "api_key"  # in the work directory: the key engine_env writes when the profile needs one


def engine_env(profile: str, workdir: Path) -> dict[str, str]:
    """The user's environment, plus a throw-away API key when the profile needs one and none is set."""

    settings = load_settings(profile=profile)
    env = dict(os.environ)
    if load_settings_profile(settings).require_api_key and not settings.has_api_key:
        key = workdir / THROWAWAY_KEY
        init_key_file(key)
        env["API_KEY_FILE"] = str(key)
    return env

