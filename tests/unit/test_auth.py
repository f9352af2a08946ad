"""The key guard is an allow-list: with a key configured, every path but /health and /ping
needs it (a path nobody registered yet too), as Bearer or x-api-key, compared exactly.
The real vLLM app's every route is checked in tests/integration/test_faults.py."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from entrypoint.asgi import API_KEY_ENV, INSTANCE_ENV, INSTANCE_HEADER, StackMiddleware
from entrypoint.auth import OPEN_PATHS, ApiKeyGuard, presented_keys

KEY = "k" * 24 + "-secret"


async def _ok(request):
    return PlainTextResponse("ran")


async def _socket(websocket):
    await websocket.accept()
    await websocket.send_text("ran")
    await websocket.close()


def _app() -> Starlette:
    routes = [Route(p, _ok, methods=["GET", "POST"]) for p in ("/health", "/ping", "/v1/models", "/invocations",
                                                               "/tokenize", "/metrics", "/scale_elastic_ep")]
    return Starlette(routes=[*routes, WebSocketRoute("/v1/realtime", _socket)])


@pytest.fixture
def client(monkeypatch) -> TestClient:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setenv(INSTANCE_ENV, "0123456789abcdef")
    app = _app()
    app.add_middleware(StackMiddleware)
    return TestClient(app)


@pytest.mark.parametrize("path", ["/v1/models", "/invocations", "/tokenize", "/metrics", "/scale_elastic_ep"])
def test_every_route_off_the_allow_list_needs_the_key(client, path):
    refused = client.post(path, json={})
    assert refused.status_code == 401 and refused.text != "ran"
    assert "x-api-key" in refused.json()["error"]["message"]
    assert client.post(path, json={}, headers={"Authorization": "Bearer wrong" + KEY}).status_code == 401
    assert client.post(path, json={}, headers={"Authorization": f"Bearer {KEY}"}).text == "ran"
    assert client.post(path, json={}, headers={"x-api-key": KEY}).text == "ran"


def test_a_route_nobody_has_registered_yet_is_closed_by_default(client):
    assert client.get("/v3/whatever-a-later-vllm-adds").status_code == 401
    assert client.get("/v3/whatever-a-later-vllm-adds", headers={"x-api-key": KEY}).status_code == 404


@pytest.mark.parametrize("path", sorted(OPEN_PATHS))
def test_liveness_routes_answer_without_the_key(client, path):
    assert client.get(path).text == "ran"


def test_open_paths_match_exactly_not_by_prefix(client):
    assert client.get("/health/../v1/models").status_code in (401, 404)
    assert client.get("/healthz").status_code == 401
    assert client.get("/ping/x").status_code == 401


def test_wrong_scheme_prefix_or_extension_of_the_key_is_refused(client):
    for headers in (
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"x-api-key": KEY.upper()},
        {"x-api-key": ""},
    ):
        assert client.get("/v1/models", headers=headers).status_code == 401, headers


def test_anthropic_paths_get_anthropic_shaped_401(client):
    body = client.post("/v1/messages", json={}).json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_cors_preflight_passes_but_a_plain_options_does_not(client):
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    assert client.options("/v1/models", headers=preflight).status_code != 401
    assert client.options("/v1/models").status_code == 401


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted(client):
    with pytest.raises(WebSocketDisconnect) as closed:
        with client.websocket_connect("/v1/realtime") as socket:
            socket.receive_text()
    assert closed.value.code == 1008
    with client.websocket_connect("/v1/realtime", headers={"x-api-key": KEY}) as socket:
        assert socket.receive_text() == "ran"


def test_every_answer_carries_the_instance_id_refusals_included(client):
    assert client.get("/health").headers[INSTANCE_HEADER] == "0123456789abcdef"
    assert client.get("/v1/models").headers[INSTANCE_HEADER] == "0123456789abcdef"


def test_without_a_configured_key_the_guard_lets_everything_through():
    app = _app()
    app.add_middleware(ApiKeyGuard, api_key=None)
    assert TestClient(app).get("/invocations").text == "ran"


def test_presented_keys_reads_both_forms_and_nothing_else():
    headers = [(b"authorization", b"bearer  abc "), (b"x-api-key", b" def"), (b"cookie", b"ghi")]
    assert presented_keys(headers) == [b"abc", b"def"]
