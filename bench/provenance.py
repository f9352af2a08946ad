"""What a result was measured on: the client machine, the software, the server's identity.

A figure without its machine and its server is not comparable. The server's identity comes
from what the server says (``/v1/models``, ``/version``, the ``system_fingerprint`` of its
answers) and, where the deployment is ours and local, from the files the start-up flow
wrote: ``CACHE_DIR/run/<profile>.status.json`` (the readiness gate's verdict, with the
verified identity) and ``CACHE_DIR/verify/status.json`` (the verify step's identity
document). For a remote server, pass a copy of its verify status with ``--identity-file``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from core.atomic import atomic_write_text
from core.errors import BenchError
from entrypoint import __version__ as stack_version
from entrypoint.client import StackClient
from entrypoint.run_files import statuses

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def write_result(doc: dict[str, Any], out: str | None) -> None:
    """A benchmark's JSON result at ``out`` (atomically; nothing where ``out`` is None)."""
    if out:

        atomic_write_text(Path(out), json.dumps(doc, indent=2) + "\n")
        print(f"result: {out}")


def client_machine(note: str | None = None) -> dict[str, Any]:
    """The machine running the benchmark client (and the server too, for a local deployment)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    machine: dict[str, Any] = {
        "arch": platform.machine(),
        "cpu": cpu or platform.processor(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": memory,
        "os": f"{platform.system()} {platform.release()}",
        "gpus": _gpus(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if note:
        machine["note"] = note
    return machine


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,power.limit,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def versions() -> dict[str, Any]:
    import httpx

    return {
        "qwen38_stack": stack_version,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "httpx": httpx.__version__,
    }


def _git_commit() -> str | None:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _same_server(a: str, b: str) -> bool:
    ua, ub = urlsplit(a), urlsplit(b)
    host_a, host_b = ua.hostname or "", ub.hostname or ""
    same_host = host_a == host_b or (host_a in LOOPBACK and host_b in LOOPBACK)
    return same_host and ua.port == ub.port


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def local_identity(base_url: str, cache_dir: Path) -> dict[str, Any] | None:
    """The readiness and verify status of the local deployment serving ``base_url``, if any."""
    if (urlsplit(base_url).hostname or "") not in LOOPBACK:
        return None
    for profile, path in statuses(cache_dir):
        ready = _read_json(path)
        if not ready or not _same_server(str(ready.get("base_url", "")), base_url):
            continue
        out: dict[str, Any] = {
            "source": str(path),
            "profile": profile,
            "ready": ready.get("ready"),
            "identity": ready.get("identity"),
            "checks": ready.get("checks"),
        }
        verify = _read_json(cache_dir / "verify" / "status.json")
        # The verify status is per cache directory; keep it only if it is this server's.
        if verify and verify.get("identity") == ready.get("identity"):
            out["verify"] = verify
        return out
    return None


def server_identity(
    client: StackClient,
    model: str,
    models: list[dict[str, Any]],
    *,
    identity_file: Path | None = None,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    entry = next(m for m in models if m.get("id") == model)
    identity: dict[str, Any] = {
        "base_url": client.base_url,
        "model": model,
        "models": [{k: m.get(k) for k in ("id", "root", "parent", "max_model_len")} for m in models],
        "max_model_len": entry.get("max_model_len") or _root_limit(models, entry),
        "vllm_version": _vllm_version(client),
    }
    if identity_file is not None:
        data = _read_json(identity_file)
        if data is None:
            raise BenchError(f"--identity-file {identity_file}: not a readable JSON file")
        identity["declared"] = {"source": str(identity_file), **data}
    elif cache_dir is not None:
        local = local_identity(client.base_url, cache_dir)
        if local is not None:
            identity["declared"] = local
    return identity


def _root_limit(models: list[dict[str, Any]], entry: dict[str, Any]) -> int | None:
    """An adapter id lists no max_model_len; its base model's applies."""
    parent = next((m for m in models if m.get("id") == entry.get("parent")), None)
    return parent.get("max_model_len") if parent else None


def _vllm_version(client: StackClient) -> str | None:
    try:
        response = client.get("/version")
    except httpx.HTTPError:  # an optional endpoint: its absence is an answer
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json().get("version")
    except ValueError:
        return None
