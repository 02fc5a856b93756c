"""``/mcp`` in-process, without backends: the door (API keys, the admin token), the MCP session
manager running inside the app's lifespan (each time the lifespan runs), and a write tool
refused before anything is asked of the retriever. The tools themselves, through the stack:
tests/test_mcp_end_to_end.py."""

from __future__ import annotations

from fastapi.testclient import TestClient

from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings

KEY = "mcp-key"
ADMIN = "mcp-admin"
# Stateless streamable HTTP: a JSON-RPC request per POST, answered as JSON.
HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}


def _app():
    # Backends nowhere: nothing here may reach them.
    settings = GatewaySettings(
        api_keys=KEY,
        admin_token=ADMIN,
        retriever_addr="127.0.0.1:9",
        generator_addr="127.0.0.1:9",
        redis_url="redis://127.0.0.1:9/0",
    )
    return create_app(settings)


def _rpc(client: TestClient, method: str, token: str | None, **params) -> dict:
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    reply = client.post(
        "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
        headers={**HEADERS, **auth},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_door_and_the_lifespan_run_after_run():
    app = _app()
    for _ in range(2):  # the SDK's session manager runs once: each lifespan makes its own
        with TestClient(app, base_url="http://127.0.0.1:8000") as client:
            ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
            assert client.post("/mcp", json=ping, headers=HEADERS).status_code == 401
            wrong = {**HEADERS, "Authorization": "Bearer nope"}
            assert client.post("/mcp", json=ping, headers=wrong).status_code == 401
            for token in (KEY, ADMIN):  # the admin token opens the door too
                tools = _rpc(client, "tools/list", token)["result"]["tools"]
                assert {tool["name"] for tool in tools} >= {"search", "answer", "put_document"}
            metrics = client.get("/metrics").text
            counter = 'openbook_gateway_requests_total{key="anonymous",route="/mcp",status="401"}'
            assert counter in metrics


def test_a_write_tool_needs_the_admin_token_and_is_refused_before_any_rpc():
    with TestClient(_app(), base_url="http://127.0.0.1:8000") as client:
        arguments = {"index": "facts-a", "doc_id": "x", "text": "Some text."}
        result = _rpc(client, "tools/call", KEY, name="put_document", arguments=arguments)
        assert result["result"]["isError"] is True
        assert "admin token" in result["result"]["content"][0]["text"]
        # a bad argument is named before the token is even looked at
        bad = {**arguments, "doc_id": "a/b"}
        result = _rpc(client, "tools/call", KEY, name="put_document", arguments=bad)
        assert result["result"]["isError"] is True
        assert "doc_id" in result["result"]["content"][0]["text"]


def test_dns_rebinding_is_refused_on_loopback():
    with TestClient(_app(), base_url="http://evil.example:8000") as client:
        reply = client.post(
            "/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
            headers={**HEADERS, "Authorization": f"Bearer {KEY}"},
        )
        assert reply.status_code in (403, 421)
