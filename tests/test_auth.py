"""Every endpoint is behind Jupyter's authentication and authorization."""

from __future__ import annotations

import json

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_evalsched import openai_api
from jupyter_evalsched.handlers import AUTH_RESOURCE, handlers

ENDPOINTS = [
    ("GET", "runs"),
    ("POST", "runs"),
    ("GET", "runs/x"),
    ("DELETE", "runs/x"),
    ("POST", "runs/x/cancel"),
    ("GET", "runs/x/logs"),
    ("GET", "runs/x/episodes"),
    ("GET", "queue"),
    ("GET", "ledger"),
    ("GET", "models"),
    ("POST", "models/x/connect"),
    ("GET", "status"),
    ("GET", "doctor"),
    ("GET", "openapi.json"),
    ("GET", "leases"),
    ("POST", "leases"),
    ("GET", "leases/x"),
    ("DELETE", "leases/x"),
    ("GET", "v1/models"),
    ("POST", "v1/completions"),
    ("POST", "v1/chat/completions"),
    ("POST", "v1/embeddings"),
]


@pytest.fixture
def jp_server_config(runs_dir):
    return {
        "ServerApp": {
            # terminals registers an unauthenticated websocket of its own; keep it out of this check
            "jpserver_extensions": {"jupyter_evalsched": True, "jupyter_server_terminals": False},
            "allow_unauthenticated_access": False,
        },
        "EvalSchedApp": {"runs_dir": str(runs_dir), "virtual_gpus": [24000], "freeze_startup_objects": False},
    }


def test_every_handler_method_is_decorated(jp_serverapp):
    missing = []
    for pattern, handler in handlers() + openai_api.handlers():
        missing += jp_serverapp.web_app._check_handler_auth(pattern, handler)
        assert handler.auth_resource == AUTH_RESOURCE
    assert missing == []


@pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")
async def test_server_starts_with_unauthenticated_access_disallowed(jp_fetch, jp_serverapp):
    # The server was built with allow_unauthenticated_access=False and warnings as errors:
    # reaching here means no handler was flagged. It still serves with a token:
    await jp_serverapp.extension_manager.start_all_extensions()
    resp = await jp_fetch("evalsched", "queue")
    assert resp.code == 200


async def test_requests_without_a_token_are_refused(jp_fetch, jp_serverapp, jp_http_port, jp_base_url):
    await jp_serverapp.extension_manager.start_all_extensions()
    client = AsyncHTTPClient()
    for method, path in ENDPOINTS:
        url = f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/{path}"
        req = HTTPRequest(url, method=method, body=b"{}" if method == "POST" else None, follow_redirects=False)
        with pytest.raises(HTTPClientError) as err:
            await client.fetch(req)
        assert err.value.code in (401, 403), (method, path, err.value.code)
        # Wrong token too.
        req = HTTPRequest(
            url,
            method=method,
            body=b"{}" if method == "POST" else None,
            follow_redirects=False,
            headers={"Authorization": "token not-the-token"},
        )
        with pytest.raises(HTTPClientError) as err:
            await client.fetch(req)
        assert err.value.code in (401, 403), (method, path, err.value.code)


async def test_websocket_without_a_token_is_refused(jp_serverapp, jp_http_port, jp_base_url, jp_ws_fetch):
    await jp_serverapp.extension_manager.start_all_extensions()
    url = f"ws://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/events"
    with pytest.raises(HTTPClientError) as err:
        await websocket_connect(url)
    assert err.value.code in (401, 403)
    ws = await jp_ws_fetch("evalsched", "events")  # with the token it works
    assert json.loads(await ws.read_message())["type"] == "snapshot"
    ws.close()
