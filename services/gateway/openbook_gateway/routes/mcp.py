"""``/mcp``: openbook's MCP tools (:mod:`openbook_gateway.mcp_tools`) over streamable HTTP.

Invariants:

* Same door as ``/v1`` (``openbook_gateway.access``): with ``OPENBOOK_GATEWAY_API_KEYS`` or
  ``OPENBOOK_GATEWAY_REQUIRE_KEYS`` set, every request needs a key with the ``ask`` scope (or
  the admin token); anything else is a 401 before the MCP layer reads the body. Otherwise
  ``/mcp`` is open, as ``/answer`` is. The write tools ask for their own scope (``write``;
  ``admin`` to create an index).
* Stateless: every POST is answered on its own (JSON, no server-side session), so any gateway
  replica behind a load balancer can serve any call, and nothing is kept between calls. So
  there is no stream for the server to push on: ``GET /mcp`` (which the SDK would answer with an
  SSE stream that never closes) is a 405 naming POST (issue 42).
* The SDK's session manager needs a task group of its own for as long as the app serves:
  :meth:`McpEndpoint.running` is entered in the gateway's lifespan (``app.create_app``), one
  session manager per run of the lifespan (the SDK's runs once); a request before it is a 503.
* The body limit is the document writes' (``OPENBOOK_GATEWAY_MAX_DOCUMENT_BODY_BYTES``:
  ``put_document`` carries an article), applied by ``middleware.BodySizeLimit``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi.responses import JSONResponse
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from openbook_gateway.access import Refused, admit, rule_of
from openbook_gateway.mcp_tools import build_server
from openbook_gateway.services import get_services
from openbook_gateway.settings import GatewaySettings

PATH = "/mcp"
METHODS = ["GET", "POST", "DELETE"]
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def transport_security(host: str) -> TransportSecuritySettings | None:
    """DNS-rebinding protection (Host and Origin must be loopback) when the gateway listens on
    loopback only, as the SDK does for its own servers: a web page the user visits cannot then
    reach a local, key-less ``/mcp`` through a hostname it controls. A gateway that listens
    beyond loopback is reached by names the SDK cannot know: its API keys guard it."""
    if host not in LOOPBACK:
        return None
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*", "127.0.0.1", "localhost"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
    )


class McpEndpoint:
    """The ASGI app of ``/mcp`` (module docstring); one per app."""

    path = PATH  # the route label of its requests in the access log and metrics

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.manager: StreamableHTTPSessionManager | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """While the app serves: a session manager and its task group (the gateway's
        lifespan enters this)."""
        server = build_server()
        server.streamable_http_app(
            streamable_http_path=PATH,
            json_response=True,
            stateless_http=True,
            max_request_body_size=self.settings.max_document_body_bytes,
            transport_security=transport_security(self.settings.host),
            host=self.settings.host,
        )
        manager = server.session_manager
        async with manager.run():
            self.manager = manager
            try:
                yield
            finally:
                self.manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI's routes put themselves in the scope, where middleware.RequestContext reads
        # the route's path for its access log and metrics; a plain ASGI route does not.
        scope.setdefault("route", self)
        # The door every route goes through (openbook_gateway.access), before the MCP layer
        # reads a byte; the tools read the principal it found from the request's state.
        request = Request(scope)
        try:
            principal = await admit(
                rule_of(scope["method"], PATH),
                request.headers.get("authorization"),
                await get_services(request),
                {},
            )
        except Refused as refused:
            await refused.response(scope["path"])(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        if scope.get("method") == "GET":
            response = JSONResponse(
                {
                    "detail": "GET /mcp opens a server-to-client stream, which this stateless "
                    "server never sends on: send each call as a POST"
                },
                405,
                headers={"Allow": "POST, DELETE"},
            )
            await response(scope, receive, send)
            return
        if self.manager is None:
            await JSONResponse({"detail": "the MCP server is not running"}, 503)(
                scope, receive, send
            )
            return
        await self.manager.handle_request(scope, receive, send)
