"""A real Prometheus for a test: Debian's `prometheus` package (which ships `promtool`), on
loopback, with its own data directory, scraping the real servers of the test session.

`scrape_config_for` turns the monitoring profile's own ``docker/monitoring/prometheus.yml``
into the test's: only what compose's network and mounts provide is swapped (the target
addresses, the mounted key and rules files, the scrape interval for a short test); the jobs,
the bearer-token scrape and the metrics path stay as shipped. Where the package is missing
the tests skip, saying how to install it (`make prometheus`).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO, free_port

MONITORING = REPO / "docker" / "monitoring"
CONFIG = MONITORING / "prometheus.yml"
RULES = MONITORING / "rules.yml"
INSTALL = "`make prometheus` (unpacks it into .venv) or apt-get install -y --no-install-recommends prometheus"


def binaries() -> tuple[str, str]:
    """(prometheus, promtool) from PATH or `make prometheus`'s .venv/prometheus, or the test
    is skipped with how to install them."""
    unpacked = str(REPO / ".venv" / "prometheus" / "usr" / "bin")
    prometheus = shutil.which("prometheus") or shutil.which("prometheus", path=unpacked)
    promtool = shutil.which("promtool") or shutil.which("promtool", path=unpacked)
    if prometheus is None or promtool is None:
        pytest.skip(f"Debian's prometheus package is not installed: {INSTALL}")
    return prometheus, promtool


def host_paths(config: dict, key_file: Path) -> dict:
    """The shipped config with the files compose mounts (rules, the key secret) at their host paths."""
    config["rule_files"] = [str(RULES)]
    for job in config["scrape_configs"]:
        if "authorization" in job:
            assert job["authorization"]["credentials_file"] == "/run/secrets/api_key"
            job["authorization"]["credentials_file"] = str(key_file)
    return config


def scrape_config_for(targets: list[str], key_file: Path, own: str, interval: str = "2s") -> dict:
    """The monitoring profile's config, scraping ``targets`` (host:port) with the key in ``key_file``.

    One job more than shipped, ``qwen38-without-key``: the same targets without the key, to
    show that the key is what lets Prometheus in."""
    config = host_paths(yaml.safe_load(CONFIG.read_text()), key_file)
    config["global"].update({"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval})
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["qwen38"]["static_configs"] = [{"targets": targets}]
    jobs["prometheus"]["static_configs"] = [{"targets": [own]}]
    keyless = {k: v for k, v in jobs["qwen38"].items() if k != "authorization"}
    config["scrape_configs"].append({**keyless, "job_name": "qwen38-without-key"})
    return config


@contextlib.contextmanager
def running_prometheus(config: dict, workdir: Path, port: int | None = None) -> Iterator[str]:
    """Prometheus with ``config`` on 127.0.0.1; yields its URL once it is ready."""
    prometheus, _ = binaries()
    port = port or free_port()
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / "prometheus.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [
                prometheus, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            ],
            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def targets(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]


def wait_for_scrapes(url: str, jobs: set[str], timeout: float = 60, *, up: set[str] = frozenset()) -> list[dict]:
    """Active targets, once every target of ``jobs`` has been scraped at least once (and every
    target of the jobs in ``up`` has been scraped successfully: on a busy 2-core machine one
    scrape may time out, which says nothing about the key or the config)."""
    deadline = time.monotonic() + timeout
    while True:
        active = [t for t in targets(url) if t["labels"]["job"] in jobs]
        scraped = active and all(t["health"] != "unknown" for t in active)
        if scraped and {t["labels"]["job"] for t in active} == jobs:
            if all(t["health"] == "up" for t in active if t["labels"]["job"] in up):
                return active
        if time.monotonic() > deadline:
            raise AssertionError(f"targets of {sorted(jobs)} not scraped within {timeout:.0f} s: {active}")
        time.sleep(0.5)
