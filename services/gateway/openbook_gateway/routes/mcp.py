"""``/mcp``: openbook's MCP tools (:mod:`openbook_gateway.mcp_tools`) over streamable HTTP.

Invariants:

* Same door as ``/v1``: with ``OPENBOOK_GATEWAY_API_KEYS`` set, every request needs
  ``Authorization: Bearer <one of them>``, or the admin token (which also opens the write
  tools); anything else is a 401 before the MCP layer reads the body. Unset: ``/mcp`` is open,
  as ``/answer`` is, and only the write tools ask for the admin token.
* Stateless: every POST is answered on its own (JSON, no server-side session), so any gateway
  replica behind a load balancer can serve any call, and nothing is kept between calls.
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
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from openbook.auth import bearer_matches
from openbook_gateway.mcp_tools import build_server
from openbook_gateway.routes.openai import api_keys
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

    def allowed(self, authorization: str | None) -> bool:
        """Whether a request may reach the tools: no API keys set, or one of them (or the admin
        token) as its bearer token."""
        keys = api_keys(self.settings)
        if not keys:
            return True
        token = self.settings.admin_token
        admin = [token.get_secret_value()] if token else []
        return bearer_matches(authorization, [*keys, *admin])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI's routes put themselves in the scope, where middleware.RequestContext reads
        # the route's path for its access log and metrics; a plain ASGI route does not.
        scope.setdefault("route", self)
        if not self.allowed(Headers(scope=scope).get("authorization")):
            response = JSONResponse(
                {
                    "detail": "missing or wrong API key: send 'Authorization: Bearer <key>' "
                    "with one of OPENBOOK_GATEWAY_API_KEYS (or the admin token)"
                },
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        if self.manager is None:
            await JSONResponse({"detail": "the MCP server is not running"}, 503)(
                scope, receive, send
            )
            return
        await self.manager.handle_request(scope, receive, send)
