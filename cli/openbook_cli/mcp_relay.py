"""``openbook mcp``: openbook's MCP tools over stdio, for clients that launch a command.

A relay, not a second server: it lists and calls the tools of a running gateway's ``/mcp``
(streamable HTTP) with the official MCP client, and serves exactly those over stdin/stdout
with the official server. The tools are implemented once, in the gateway
(``openbook_gateway.mcp_tools``), on its own services; this process needs only the gateway's
URL, not the retriever's and generator's addresses, Redis' password or the cache's key, and
it works the same against a gateway on another machine.

Credentials travel as the gateway takes them on ``/mcp``: one bearer token, the admin token
when given (it opens the write tools and, where API keys are set, ``/mcp`` itself), else the
API key. A gateway that cannot be reached or refuses the token stops the command at start with
an error naming the URL; a call that fails on the way is a tool error, never a crashed session.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
)

MCP_PATH = "/mcp"


@dataclass(frozen=True)
class RelayOptions:
    """Where the gateway is and what to present to it."""

    url: str  # the gateway's base URL (``/mcp`` is appended) or its ``.../mcp`` URL
    api_key: str | None = None
    admin_token: str | None = None
    timeout_s: float = 120.0

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith(MCP_PATH) else base + MCP_PATH

    def headers(self) -> dict[str, str]:
        token = self.admin_token or self.api_key
        return {"Authorization": f"Bearer {token}"} if token else {}


class GatewayRelay:
    """The stdio server's handlers: every list and call forwarded to the gateway's client."""

    def __init__(self, upstream: Client, options: RelayOptions) -> None:
        self.upstream = upstream
        self.options = options

    async def list_tools(
        self, ctx: ServerRequestContext, params: PaginatedRequestParams | None
    ) -> ListToolsResult:
        return await self.upstream.list_tools(cursor=params.cursor if params else None)

    async def call_tool(
        self, ctx: ServerRequestContext, params: CallToolRequestParams
    ) -> CallToolResult:
        try:
            return await self.upstream.call_tool(params.name, params.arguments or {})
        except MCPError:
            raise  # the gateway's protocol error (an unknown tool): the client's to see as is
        except (httpx2.HTTPError, OSError) as exc:
            text = f"the openbook gateway at {self.options.endpoint} failed: {exc}"
            return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def first_cause(exc: BaseException) -> str:
    """What went wrong, for a person: the first exception inside the task groups' wrapping."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


async def serve_stdio(options: RelayOptions) -> None:
    """Serve the gateway's tools on stdin/stdout until the client closes stdin."""
    http = httpx2.AsyncClient(
        headers=options.headers(), timeout=httpx2.Timeout(options.timeout_s, connect=10.0)
    )
    async with http:
        transport = streamable_http_client(options.endpoint, http_client=http)
        # No response cache: a tool's answer reflects the index as it is at each call.
        async with Client(transport, cache=None, read_timeout_seconds=options.timeout_s) as up:
            relay = GatewayRelay(up, options)
            info = up.server_info
            server: Server = Server(
                info.name if info else "openbook",
                version=info.version if info else "",
                instructions=up.instructions,
                on_list_tools=relay.list_tools,
                on_call_tool=relay.call_tool,
            )
            async with stdio_server() as (read_stream, write_stream):
                await server.run(read_stream, write_stream, server.create_initialization_options())
