"""A private Docker daemon for the image tests, as ../shared/CI-NOTES.md describes it.

Debian's docker.io (20.10) runs as root without touching the host's networking:
`dockerd --bridge=none --iptables=false ...` with its own data root, exec root, socket and
pid file under one directory; builds use `--network=host`. `stop()` ends the daemon by its pid
file and unmounts what it left mounted (its network namespaces), so nothing outlives a run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# Debian's CLI: it builds with BuildKit through the daemon (a newer CLI wants buildx).
DOCKER_CLI = os.environ.get("QWEN38_DOCKER_CLI", "/usr/bin/docker")
DOCKERD = os.environ.get("QWEN38_DOCKERD", "/usr/sbin/dockerd")
INSTALL_HINT = "apt-get install -y --no-install-recommends docker.io mmdebstrap (run as root)"


class DaemonUnavailable(RuntimeError):
    """This machine cannot run the private daemon (no dockerd, not root)."""


@dataclass
class PrivateDockerDaemon:
    root: Path
    _process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "docker.pid"

    @property
    def exec_root(self) -> Path:
        return self.root / "exec"

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "1"}

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [DOCKER_CLI, *args], env={**os.environ, **self.env()}, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])}... failed: {result.stderr.strip()[-2000:]}")
        return result

    def start(self, timeout: float = 60) -> None:
        if os.geteuid() != 0:
            raise DaemonUnavailable("the private Docker daemon needs root")
        for path in (DOCKERD, DOCKER_CLI):
            if not Path(path).exists():
                raise DaemonUnavailable(f"{path} is missing: {INSTALL_HINT}")
        if self.pidfile.exists():
            raise RuntimeError(f"{self.pidfile} exists: a daemon from an earlier run is still up (stop it first)")
        for path in (self.data_root, self.exec_root):
            path.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    DOCKERD,
                    "--data-root", str(self.data_root),
                    "--exec-root", str(self.exec_root),
                    "-H", f"unix://{self.socket}",
                    "--pidfile", str(self.pidfile),
                    "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.socket.exists() and self.docker("version", check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"dockerd did not answer within {timeout:.0f} s; see {self.log}")

    def stop(self, timeout: float = 60) -> None:
        try:
            pid = int(self.pidfile.read_text().strip())
        except (FileNotFoundError, ValueError):
            pid = None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if self._process is not None and self._process.pid == pid:
                # Our child: wait() also reaps it (a zombie still has its /proc entry).
                try:
                    self._process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            else:
                deadline = time.monotonic() + timeout
                while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
                if Path(f"/proc/{pid}").exists():
                    os.kill(pid, signal.SIGKILL)
        self.unmount_leftovers()
        self.pidfile.unlink(missing_ok=True)

    def unmount_leftovers(self) -> None:
        """Unmount what the daemon left under its roots (network namespaces), deepest first."""
        roots = (str(self.exec_root), str(self.data_root))
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[1].startswith(roots)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
