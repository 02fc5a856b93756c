"""Calls to a running gateway that the API-key, tenant and MCP tests all make: a key sent as a
bearer token, an admin creating a key, an answer asked with a key, an MCP tool called with one.

Each takes the gateway's base URL, so the same helper serves a stack of the services tests and
``openbook up``'s (``LocalStack.url``).
"""

from __future__ import annotations

from typing import Any

import httpx

# What a streamable-HTTP MCP client sends with every request (MCP 2025-06-18).
MCP_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2025-06-18",
}
TIMEOUT_S = 120  # a first answer on a loaded CI machine; the calls return long before it


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header of ``key``; none when ``key`` is None (an anonymous call)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def create_key(url: str, admin: dict[str, str], name: str, scopes: list[str], **extra: Any) -> str:
    """A new API key named ``name`` (201 asserted); ``extra``: its indexes, filter, rate."""
    reply = httpx.post(
        f"{url}/admin/keys",
        json={"name": name, "scopes": scopes, **extra},
        headers=admin,
        timeout=TIMEOUT_S,
    )
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert body["name"] == name and body["key"].startswith(f"obk_{name}."), body
    return str(body["key"])


def answer_with_key(url: str, key: str | None, question: str, **body: Any) -> httpx.Response:
    """``POST /answer`` as ``key``, two new tokens and no cache unless ``body`` says otherwise."""
    return httpx.post(
        f"{url}/answer",
        json={"question": question, "max_new_tokens": 2, "use_cache": False, **body},
        headers=bearer(key),
        timeout=TIMEOUT_S,
    )


def mcp_rpc(url: str, key: str | None, method: str, **params: Any) -> httpx.Response:
    """One JSON-RPC request to ``/mcp`` as ``key``; the reply as it came."""
    return httpx.post(
        f"{url}/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
        headers={**MCP_HEADERS, **bearer(key)},
        timeout=TIMEOUT_S,
    )


def mcp_tool(url: str, key: str | None, name: str, **arguments: Any) -> dict[str, Any]:
    """The ``result`` of calling MCP tool ``name`` as ``key`` (a 200 asserted; a tool's own
    error is in the result, ``isError``)."""
    reply = mcp_rpc(url, key, "tools/call", name=name, arguments=arguments)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()["result"]
    return result
