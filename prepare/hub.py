"""The Hugging Face hub, through huggingface_hub: revision listings and resumable fetches.

Everything here goes through the real client, so the endpoint is chosen the way
huggingface_hub documents it: the ``HF_ENDPOINT`` environment variable (read when
huggingface_hub is imported) or the explicit ``endpoint`` argument, which wins. Tokens come
from the client too (``HF_TOKEN`` or ``hf auth login``) and are never printed.

Which client calls hit which routes (what a hub-compatible server must answer; the tests
serve exactly these):

- `list_revision` -> ``HfApi.model_info(repo, revision=R, files_metadata=True)``:
  ``GET {endpoint}/api/models/{repo}/revision/{R}?blobs=True`` -> ``{"sha": commit,
  "siblings": [{"rfilename", "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}``.
- `fetch_small_file` -> ``hf_hub_download``: ``HEAD`` then ``GET
  {endpoint}/{repo}/resolve/{commit}/{path}``.
- `download_resumable` -> ``get_hf_file_metadata(hf_hub_url(...))`` (``HEAD .../resolve/...``,
  reading ``X-Repo-Commit``, ``X-Linked-Etag``/``ETag``, ``X-Linked-Size``/``Content-Length``
  and a CDN ``Location``), then ``http_get`` with ``Range: bytes=N-`` to resume.

``hf_hub_download`` itself is not used for the large files: in huggingface_hub 2.4 it
writes each attempt to a process-unique temporary file and deletes it on failure
(``_download_to_tmp_and_move``), so an interrupted 5 GB shard would start over. We keep
our own staging file per expected sha256 and let ``http_get`` continue it.

The bounds in pyproject.toml (``huggingface_hub>=2.4,<3``, ``httpx2>=2,<3``) are what this
module relies on beyond the documented API, all as of huggingface_hub 2.4.0 (every lock's):
``huggingface_hub.file_download.http_get`` (a module-level helper, not exported) with
``resume_size``/``expected_size``/``displayed_filename``; ``HfFileMetadata.location`` (the
CDN redirect) beside ``commit_hash``/``etag``/``size``; ``errors.RemoteEntryNotFoundError``;
and httpx2 as the client's transport, whose ``HTTPError`` is what a network failure raises
(`hub_errors`). A major version may move any of these: raise the ceiling only after the
hub tests (tests/unit/test_hub_download.py, tests/hub_server.py) pass with it.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from core.errors import DownloadError
from core.hashing import git_blob_sha1
from core.identity import COMMIT_RE, SHA256_RE


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repo at one commit, as the hub lists it."""

    path: str
    size: int
    blob_id: str | None
    lfs_sha256: str | None


@dataclass(frozen=True)
class RemoteRevision:
    repo: str
    commit: str
    files: tuple[RemoteFile, ...]


@contextlib.contextmanager
def hub_errors(where: str) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one `DownloadError` line naming ``where``."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError:
        raise DownloadError(
            f"{where}: the repo is gated: accept its license on the hub and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError(f"{where}: repository not found (or private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise DownloadError(f"{where}: revision not found on the hub; check the lock") from None
    except RemoteEntryNotFoundError:
        raise DownloadError(f"{where}: file not found at this revision; check the lock") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise DownloadError(f"{where}: the hub answered HTTP {status}; retry later") from None
    except LocalEntryNotFoundError:
        raise DownloadError(f"{where}: the hub cannot be reached (check HF_ENDPOINT / the network)") from None
    except OSError as exc:
        # httpx's network errors and huggingface_hub's consistency checks.
        raise DownloadError(f"{where}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        import httpx2

        if isinstance(exc, httpx2.HTTPError):
            raise DownloadError(f"{where}: network error: {type(exc).__name__}: {exc}") from None
        raise


def list_revision(repo: str, revision: str, *, endpoint: str | None = None) -> RemoteRevision:
    """The commit ``revision`` resolves to and every file of the repo there, with sizes and hashes."""
    from huggingface_hub import HfApi

    with hub_errors(f"{repo}@{revision}"):
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True)
    commit = info.sha or ""
    if not COMMIT_RE.fullmatch(commit):
        raise DownloadError(f"{repo}@{revision}: the hub returned no commit sha (got {commit!r})")
    if COMMIT_RE.fullmatch(revision) and commit != revision:
        raise DownloadError(f"{repo}@{revision}: the hub resolved the commit to {commit}; refusing")
    files = []
    for sibling in info.siblings or []:
        if sibling.size is None:
            raise DownloadError(f"{repo}@{commit}/{sibling.rfilename}: the hub listed no size")
        lfs = sibling.lfs.sha256 if sibling.lfs is not None else None
        if lfs is not None and not SHA256_RE.fullmatch(lfs):
            raise DownloadError(f"{repo}@{commit}/{sibling.rfilename}: malformed LFS sha256 {lfs!r}")
        if sibling.lfs is not None and sibling.lfs.size != sibling.size:
            raise DownloadError(
                f"{repo}@{commit}/{sibling.rfilename}: the hub lists size {sibling.size} and LFS size "
                f"{sibling.lfs.size}"
            )
        files.append(RemoteFile(sibling.rfilename, sibling.size, sibling.blob_id, lfs))
    return RemoteRevision(repo=repo, commit=commit, files=tuple(sorted(files, key=lambda f: f.path)))


def fetch_small_file(repo: str, commit: str, remote: RemoteFile, *, endpoint: str | None = None) -> bytes:
    """A non-LFS file's bytes, checked against the git blob id the hub lists for it."""
    from huggingface_hub import hf_hub_download

    where = f"{repo}@{commit}/{remote.path}"
    with tempfile.TemporaryDirectory(prefix="qwen38-hub-") as tmp:
        with hub_errors(where):
            local = hf_hub_download(repo, remote.path, revision=commit, cache_dir=tmp, endpoint=endpoint)
        data = Path(local).read_bytes()
    if len(data) != remote.size:
        raise DownloadError(f"{where}: size expected {remote.size} (hub listing), found {len(data)}")
    if remote.blob_id is not None and git_blob_sha1(data) != remote.blob_id:
        raise DownloadError(
            f"{where}: git blob id expected {remote.blob_id} (hub listing), found {git_blob_sha1(data)}"
        )
    return data


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def download_resumable(
    *,
    repo: str,
    revision: str,
    path: str,
    size: int,
    sha256: str,
    staging: Path,
    endpoint: str | None = None,
) -> None:
    """Bring ``staging`` to the file's full length, resuming whatever it already holds.

    Checks what the hub announces (commit, LFS sha256, size) against the pin before any
    byte is fetched. Does not hash: the caller hashes the staged file, and only a file
    whose sha256 matches the pin is ever moved into place.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    where = f"{repo}@{revision}/{path}"
    url = hf_hub_url(repo, path, revision=revision, endpoint=endpoint)
    with hub_errors(where):
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    if meta.commit_hash != revision:
        raise DownloadError(f"{where}: the hub serves commit {meta.commit_hash}, the lock pins {revision}")
    if meta.size is not None and meta.size != size:
        raise DownloadError(f"{where}: size pinned {size}, the hub announces {meta.size}")
    if meta.etag is not None and SHA256_RE.fullmatch(meta.etag) and meta.etag != sha256:
        raise DownloadError(f"{where}: sha256 pinned {sha256}, the hub announces {meta.etag}")

    headers = build_hf_headers()
    if _origin(meta.location) != _origin(url):
        # A CDN redirect is a signed URL: the hub token must not travel there.
        headers.pop("authorization", None)
        headers.pop("Authorization", None)

    staging.parent.mkdir(parents=True, exist_ok=True)
    have = staging.stat().st_size if staging.exists() else 0
    if have > size:
        staging.unlink()  # longer than the file can be: not a prefix of it
        have = 0
    if have == size:
        return
    with open(staging, "ab") as handle:
        handle.seek(0, 2)
        with hub_errors(where):
            http_get(
                meta.location,
                handle,
                resume_size=have,
                headers=headers,
                expected_size=size,
                displayed_filename=path,
            )
