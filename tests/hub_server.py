"""A local stand-in for the Hugging Face hub, for tests (the real hub is not reachable).

It answers the routes huggingface_hub 2.4 calls (read from its source: hf_api.model_info,
file_download.get_hf_file_metadata / http_get / hf_hub_download), with the same headers:

- ``GET /api/models/{owner}/{name}/revision/{rev}?blobs=True``: repo info with siblings
  (``rfilename``, ``size``, ``blobId``, ``lfs: {sha256, size, pointerSize}``);
- ``HEAD|GET /{owner}/{name}/resolve/{rev}/{path}``: small (git) files answer 200 with
  ``ETag`` = git blob id; LFS files answer 302 to a second server playing the CDN, with
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``; both carry ``X-Repo-Commit``;
- ``HEAD|GET /cdn/{sha256}`` on the CDN port, honouring ``Range: bytes=N-`` (206);
- errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound).

Knobs for failure tests: ``corrupt`` (serve flipped bytes under the right headers),
``cut_after`` (send that many body bytes of the next CDN GET, then drop the connection and
answer 500 until ``fail_after_cut`` is cleared), ``throttle`` (bytes/s on the CDN), and a
log of every request with its Range header.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def _port_range(text: str) -> range:
    """``QWEN38_TEST_PORTS=FIRST-LAST``: the ports test servers may bind (one block per tenant)."""
    first, _, last = text.partition("-")
    return range(int(first), int(last) + 1)


PORT_RANGE = _port_range(os.environ.get("QWEN38_TEST_PORTS", "18200-18299"))
LFS_THRESHOLD = 1024  # files larger than this are LFS files in the fake repos


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    # Per (commit, path): what the listing claims instead of the truth (to test refusals).
    listed_blob_id: dict[tuple[str, str], str] = field(default_factory=dict)
    listed_sha256: dict[tuple[str, str], str] = field(default_factory=dict)
    served_sha: dict[str, str] = field(default_factory=dict)  # revision -> sha the API answers

    def resolve(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.blobs: dict[str, bytes] = {}
        self.corrupt: set[str] = set()  # paths served with one byte flipped
        self.cut_after: int | None = None
        self.fail_after_cut = True
        self.failing = False
        self.throttle: float | None = None  # CDN bytes per second
        self.requests: list[tuple[str, str, str | None]] = []
        self.authorizations: list[str | None] = []  # the Authorization header of each hub (not CDN) request
        self._servers: list[ThreadingHTTPServer] = []
        self.hub_url = ""
        self.cdn_url = ""

    # -- content ----------------------------------------------------------------------

    def add_commit(self, repo: str, commit: str, files: dict[str, bytes], ref: str | None = "main") -> None:
        fake = self.repos.setdefault(repo, FakeRepo())
        fake.commits[commit] = dict(files)
        if ref is not None:
            fake.refs[ref] = commit
        for data in files.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> FakeHub:
        hub = _bind(_handler(self, cdn=False))
        cdn = _bind(_handler(self, cdn=True))
        self._servers = [hub, cdn]
        for server in self._servers:
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.hub_url = f"http://127.0.0.1:{hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{cdn.server_address[1]}"
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
            # Kept-alive connections (huggingface_hub pools them) would otherwise go on
            # being served by this hub's handler threads.
            for conn in list(server.open_connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def ranges(self, fragment: str) -> list[str | None]:
        return [r for m, p, r in self.requests if m == "GET" and fragment in p]


_next_port = [PORT_RANGE.start]


def _bind(handler) -> ThreadingHTTPServer:
    # Each server takes the next port of the range, so a client's pooled connection to a
    # stopped test server can never reach the next test's server.
    for _ in PORT_RANGE:
        port = _next_port[0]
        _next_port[0] = PORT_RANGE.start + (port + 1 - PORT_RANGE.start) % len(PORT_RANGE)
        try:
            server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError:
            continue
        server.daemon_threads = True
        server.open_connections = set()
        return server
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def _handler(hub: FakeHub, *, cdn: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def setup(self) -> None:
            super().setup()
            self.server.open_connections.add(self.connection)

        def finish(self) -> None:
            self.server.open_connections.discard(self.connection)
            super().finish()

        def _error(self, status: int, code: str | None = None, headers: dict | None = None) -> None:
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, head: bool) -> None:
            path = urlsplit(self.path).path
            hub.requests.append(("HEAD" if head else "GET", path, self.headers.get("Range")))
            if not cdn:
                hub.authorizations.append(self.headers.get("Authorization"))
            if cdn:
                return self._cdn(path, head)
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                return self._model_info(m.group(1), unquote(m.group(2)))
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._resolve(m.group(1), unquote(m.group(2)), unquote(m.group(3)), head)
            self._error(404)

        def _lookup(self, repo_id: str, rev: str):
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
                return None
            commit = repo.resolve(rev)
            if commit is None:
                self._error(404, "RevisionNotFound")
                return None
            return repo, commit

        def _model_info(self, repo_id: str, rev: str) -> None:
            found = self._lookup(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            siblings = []
            for name, data in sorted(repo.commits[commit].items()):
                entry = {
                    "rfilename": name,
                    "size": len(data),
                    "blobId": repo.listed_blob_id.get((commit, name), git_blob_id(data)),
                }
                if len(data) > LFS_THRESHOLD:
                    sha = repo.listed_sha256.get((commit, name), hashlib.sha256(data).hexdigest())
                    entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
                siblings.append(entry)
            body = json.dumps(
                {"id": repo_id, "modelId": repo_id, "sha": repo.served_sha.get(rev, commit), "siblings": siblings}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _resolve(self, repo_id: str, rev: str, name: str, head: bool) -> None:
            found = self._lookup(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            data = repo.commits[commit].get(name)
            if data is None:
                return self._error(404, "EntryNotFound", {"X-Repo-Commit": commit})
            if len(data) > LFS_THRESHOLD:
                sha = repo.listed_sha256.get((commit, name), hashlib.sha256(data).hexdigest())
                self.send_response(302)
                self.send_header("Location", f"{hub.cdn_url}/cdn/{hashlib.sha256(data).hexdigest()}?name={name}")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("ETag", f'"{git_blob_id(data)}"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{git_blob_id(data)}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _cdn(self, path: str, head: bool) -> None:
            m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
            data = hub.blobs.get(m.group(1)) if m else None
            if data is None:
                return self._error(404)
            if hub.failing and not head:
                return self._error(500)
            name = dict(p.split("=", 1) for p in urlsplit(self.path).query.split("&") if "=" in p).get("name")
            if name in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            rng = self.headers.get("Range")
            if rng and (rm := re.fullmatch(r"bytes=(\d+)-", rng)):
                start = int(rm.group(1))
            body = data[start:]
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if head:
                return
            if hub.cut_after is not None:
                cut, hub.cut_after = hub.cut_after, None
                self.wfile.write(body[:cut])
                self.wfile.flush()
                hub.failing = hub.fail_after_cut
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if hub.throttle:
                step = 64 << 10
                for i in range(0, len(body), step):
                    self.wfile.write(body[i : i + step])
                    self.wfile.flush()
                    time.sleep(step / hub.throttle)
            else:
                self.wfile.write(body)

    return Handler
