"""A private registry on loopback for the publish-path test, as ../shared/CI-NOTES.md describes it.

Debian's `docker-registry` (the reference registry, distribution 2.8) serves
`127.0.0.1:PORT` with filesystem storage under one directory; the Docker daemon pushes to and
pulls from a loopback registry over plain HTTP without being told to (127.0.0.0/8 is an
implied insecure registry). `stop()` ends it; its storage is kept for inspection until the next
start wipes it, so every run pushes into an empty registry.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REGISTRY = "/usr/bin/docker-registry"
INSTALL_HINT = "apt-get install -y docker-registry"
# What `docker push` of a single-platform image writes, and what an index would be.
MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.index.v1+json",
    )
)


class RegistryUnavailable(RuntimeError):
    """This machine has no registry server to run."""


@dataclass
class LocalRegistry:
    root: Path
    port: int
    _process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    @property
    def log(self) -> Path:
        return self.root / "registry.log"

    def config_text(self) -> str:
        return (
            "version: 0.1\n"
            "log:\n  level: info\n"
            "storage:\n"
            f"  filesystem:\n    rootdirectory: {self.storage}\n"
            "  delete:\n    enabled: true\n"
            "http:\n"
            f"  addr: {self.address}\n"
        )

    def start(self, timeout: float = 30) -> None:
        if not Path(REGISTRY).exists():
            raise RegistryUnavailable(f"{REGISTRY} is missing: {INSTALL_HINT}")
        shutil.rmtree(self.storage, ignore_errors=True)
        self.storage.mkdir(parents=True)
        config = self.root / "config.yml"
        config.write_text(self.config_text())
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                [REGISTRY, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self._process.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"docker-registry did not answer on {self.address} within {timeout:.0f} s; see {self.log}")

    def stop(self, timeout: float = 30) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def manifest_digest(self, repository: str, tag: str) -> str:
        """The digest the registry serves for ``repository:tag`` (its Docker-Content-Digest)."""
        request = urllib.request.Request(
            f"http://{self.address}/v2/{repository}/manifests/{tag}", method="HEAD", headers={"Accept": MANIFEST_TYPES}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.headers["Docker-Content-Digest"]
