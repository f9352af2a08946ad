"""The route table of a running vLLM server, as vLLM itself logs it at start-up.

`vllm.entrypoints.launcher.serve_http` logs every route of the app it serves
(``Route: /path, Methods: GET, HEAD``; mounts as ``Route: /path, Endpoint: name``), read
from ``app.routes`` of the real app: the complete list, routes hidden from /openapi.json
included. A test reads it from the server's log so a route a later vLLM adds is in the table.
"""

from __future__ import annotations

import re

_METHODS = re.compile(r"\] Route: (\S+), Methods: (.+)$")
_MOUNT = re.compile(r"\] Route: (\S+), Endpoint: (\S+)$")
_PARAM = re.compile(r"\{[^}]+\}")


def logged_routes(log: str) -> set[tuple[str, str]]:
    """(method, path) for every route the server logged."""
    routes: set[tuple[str, str]] = set()
    for line in log.splitlines():
        if match := _METHODS.search(line):
            routes.update((method.strip(), match.group(1)) for method in match.group(2).split(","))
        elif match := _MOUNT.search(line):
            routes.add(("GET", match.group(1)))
    return routes


def concrete(path: str) -> str:
    """A request path for a route pattern: every ``{param}`` filled in."""
    return _PARAM.sub("probe", path)
