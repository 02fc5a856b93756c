"""openbook's MCP server through the stack `openbook up` starts, with the official MCP client
over both transports: streamable HTTP at the gateway's ``/mcp`` and ``openbook mcp`` (stdio,
a relay to it). The gateway has API keys set: ``/mcp`` takes one as ``/v1`` does.

Checked: the tools and their hints are listed; search, answer and list_indexes answer; a write
tool is refused without the admin token and works with it; bad arguments are tool errors naming
the argument and the session goes on. Tiny random models: where passages come from is checked,
not what the answer says.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import LocalStack, build_fact_indexes

pytestmark = pytest.mark.e2e

KEY = "mcp-e2e-key"
READ_TOOLS = {"search", "answer", "list_indexes"}
WRITE_TOOLS = {"create_index", "put_document", "delete_document"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    var = tmp_path_factory.mktemp("var")
    build_fact_indexes(var / "indexes")
    make_tiny_bart(var / "models" / "tiny-bart")
    stack = LocalStack(var, extra_env={"OPENBOOK_GATEWAY_API_KEYS": KEY})
    stack.start()
    yield stack
    stack.stop()


def _http(stack: LocalStack, token: str) -> Client:
    """The official client on the gateway's /mcp, presenting ``token`` as its bearer."""
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
    return Client(streamable_http_client(f"{stack.url}/mcp", http_client=http), cache=None)


def _stdio(stack: LocalStack, *options: str) -> Client:
    """The official client launching ``openbook mcp`` as an MCP client configuration does."""
    env = {**os.environ, "OPENBOOK_URL": stack.url}
    env.pop("OPENBOOK_ADMIN_TOKEN", None)
    command = StdioServerParameters(
        command=sys.executable, args=["-m", "openbook_cli", "mcp", *options], env=env
    )
    return Client(command, cache=None)


def _run(client: Client, session: Callable[[Client], Awaitable[None]]) -> None:
    async def main() -> None:
        async with client:
            await session(client)

    anyio.run(main)


async def _call(client: Client, tool: str, **arguments: Any) -> dict:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


async def _error(client: Client, tool: str, **arguments: Any) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, result
    return " ".join(getattr(block, "text", "") for block in result.content)


def _names(message: str, argument: str) -> bool:
    """Whether a tool error's text names ``argument`` (as a word: "k" is not in "tool")."""
    return re.search(rf"(^|[\s:]){argument}\b", message, re.MULTILINE) is not None


async def _reads(client: Client) -> None:
    """Every read tool, bad arguments among them: the session survives each refusal."""
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == READ_TOOLS | WRITE_TOOLS
    for name in READ_TOOLS:
        assert tools[name].annotations.read_only_hint is True
    for name in ("put_document", "delete_document"):
        assert tools[name].annotations.destructive_hint is True
    assert tools["search"].input_schema["properties"]["k"]["maximum"] == 100

    listed = await _call(client, "list_indexes")
    assert listed["active"] == "facts-a"
    assert {"facts-a", "facts-b"} <= {index["name"] for index in listed["indexes"]}

    found = await _call(client, "search", query="Who wrote Hamlet?", k=2, retrieval="bm25")
    assert found["index"] == "facts-a" and len(found["passages"]) == 2
    assert found["passages"][0]["score"] >= found["passages"][1]["score"]
    assert "Shakespeare" in found["passages"][0]["text"]

    answered = await _call(client, "answer", question="Who wrote Hamlet?", k=3)
    assert isinstance(answered["answer"], str) and 0 <= answered["confidence"] <= 1
    assert len(answered["citations"]) == 3
    posteriors = [citation["posterior"] for citation in answered["citations"]]
    assert sum(posteriors) == pytest.approx(1, abs=1e-3)

    assert _names(await _error(client, "search", query="Hamlet", k=0), "k")
    assert _names(await _error(client, "search", query="Hamlet", k="many"), "k")
    assert _names(await _error(client, "search", query="  ", k=2), "query")
    assert _names(await _error(client, "search", query="Hamlet", index="no-such-index"), "index")
    assert _names(await _error(client, "answer", question="Hamlet", k=101), "k")
    assert _names(await _error(client, "answer", question=""), "question")
    assert _names(await _error(client, "answer", question="Hamlet", decoding="best"), "decoding")
    refused = await _error(client, "put_document", index="facts-a", doc_id="x", text="Some text.")
    assert "admin token" in refused
    # still serving after every refusal
    assert len((await _call(client, "search", query="Hamlet", k=1))["passages"]) == 1


async def _writes(client: Client, index: str) -> None:
    """A document written through a tool is searchable, then deleted, through tools."""
    text = "The zorblax machine is kept in Tromso."
    written = await _call(client, "put_document", index=index, doc_id="zorblax", text=text)
    assert written["passages"] == 1 and written["version"] >= 1
    found = await _call(
        client, "search", query="zorblax machine", k=1, index=index, retrieval="bm25"
    )
    assert found["passages"][0]["id"] == "zorblax#0"
    deleted = await _call(client, "delete_document", index=index, doc_id="zorblax")
    assert deleted["version"] == written["version"] + 1
    missing = await _error(client, "delete_document", index=index, doc_id="zorblax")
    assert "zorblax" in missing
    assert _names(await _error(client, "delete_document", index=index, doc_id="a/b"), "doc_id")


async def _new_index_and_writes(client: Client) -> None:
    created = await _call(client, "create_index", name="mcp-notes", like="facts-a")
    assert created["name"] == "mcp-notes"
    assert _names(await _error(client, "create_index", name="bad name"), "name")
    await _writes(client, "mcp-notes")


def test_http_needs_an_api_key(stack):
    hello = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    assert httpx.post(f"{stack.url}/mcp", json=hello, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-a-key"}
    assert httpx.post(f"{stack.url}/mcp", json=hello, headers=wrong, timeout=10).status_code == 401


def test_http_read_tools_and_bad_calls(stack):
    _run(_http(stack, KEY), _reads)


def test_http_write_tools_with_the_admin_token(stack):
    _run(_http(stack, stack.admin_token), _new_index_and_writes)


def test_stdio_relay(stack):
    _run(_stdio(stack, "--api-key", KEY), _reads)
    _run(_stdio(stack, "--admin-token", stack.admin_token), partial(_writes, index="facts-a"))
