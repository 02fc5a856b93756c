"""The gateway's ASGI middlewares: the body-size limit and the request context.

Both are plain ASGI middlewares (no extra task per request). ``create_app`` adds
:class:`RequestContext` last, so it is outermost: every response, a 413 from
:class:`BodySizeLimit` too, carries the request id, and an unhandled error anywhere inside
becomes a JSON 500 naming it (OpenAI's error object under ``/v1``), never a stack trace.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from opentelemetry import trace
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openbook.observability import telemetry
from openbook.observability.logs import request_id_var
from openbook_gateway import audit, openai_format
from openbook_gateway.metrics import GatewayMetrics, ms_since
from openbook_gateway.principal import ANONYMOUS, Principal

log = logging.getLogger(__name__)


# How much of a body over the limit the gateway reads and throws away before answering 413.
# Closing a connection with unread bytes in the socket makes the kernel send a TCP reset, and
# a client still writing its body then sees "connection reset" instead of the 413. Past this
# many bytes, resetting is cheaper than reading.
DRAIN_MAX_BYTES = 32 * 1024 * 1024


# Where document writes live (routes/documents.py), and the MCP endpoint whose put_document
# tool carries an article (routes/mcp.py): their bodies get the larger limit.
DOCUMENT_PATH_PREFIX = "/indexes/"
MCP_PATH = "/mcp"


class BodySizeLimit:
    """Refuse request bodies over ``max_bytes`` with a 413 the client can read.

    A declared ``Content-Length`` over the limit is refused before the body reaches the app; a
    body streamed without one is cut off as soon as it passes the limit. Either way the rest
    of the body (up to ``drain_max_bytes``) is read and discarded first, so the answer is not
    lost to a connection reset; the connection is then closed.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        drain_max_bytes: int = DRAIN_MAX_BYTES,
        document_max_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_max_bytes = drain_max_bytes
        # Document writes (under DOCUMENT_PATH_PREFIX) carry whole articles and batches of
        # them: they get their own, larger limit; every other body keeps the small one.
        self.document_max_bytes = document_max_bytes or max_bytes
        self.message = (
            f"request body larger than {max_bytes} bytes (OPENBOOK_GATEWAY_MAX_BODY_BYTES)"
        )
        self.document_message = (
            f"request body larger than {self.document_max_bytes} bytes "
            "(OPENBOOK_GATEWAY_MAX_DOCUMENT_BODY_BYTES)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, message_text = self.max_bytes, self.message
        if scope["path"].startswith(DOCUMENT_PATH_PREFIX) or scope["path"] == MCP_PATH:
            max_bytes, message_text = self.document_max_bytes, self.document_message
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > max_bytes:
            # A client that sent "Expect: 100-continue" waits for the go-ahead before sending
            # its body, and the server asks for it on the first receive(): answer without one.
            waiting = headers.get("expect", "").lower() == "100-continue"
            if not waiting and int(declared) <= self.drain_max_bytes:
                await self._drain(receive, 0)
            body = {"detail": message_text}
            if openai_format.is_openai_path(scope["path"]):
                body = openai_format.error_body(413, message_text, code="request_too_large")
            response = JSONResponse(body, 413, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    if message.get("more_body", False):
                        await self._drain(receive, received)
                    raise HTTPException(413, message_text, headers={"Connection": "close"})
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive, received: int) -> None:
        """Read and discard the rest of the body, stopping past ``drain_max_bytes``."""
        while received <= self.drain_max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


class RequestContext:
    """Request id (the client's ``x-request-id`` or a new one) in the log context, in
    ``request.state`` and on the response; request count, and one access-log line; with
    tracing on, the request id on the request's root span (``POST /answer``, the FastAPI
    instrumentation's SERVER span, outside every middleware: ``app.create_app``).

    A plain ASGI middleware: no extra task per request, and the handler runs in this context,
    so everything it logs carries the request id. An unhandled error becomes a JSON 500 that
    names the request id, never a stack trace.
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, access_log: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id", "")
        if not (0 < len(request_id) <= 128 and request_id.isascii() and request_id.isprintable()):
            request_id = uuid.uuid4().hex  # it goes into logs and gRPC metadata: keep it sane
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        if telemetry.enabled():
            trace.get_current_span().set_attribute(telemetry.REQUEST_ID_ATTRIBUTE, request_id)
        try:
            await self._handle(scope, receive, send, request_id)
        finally:
            request_id_var.reset(token)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - never leak a stack trace to the client
            log.exception("unhandled error")
            if response_started:
                raise
            body = {"detail": "internal error", "request_id": request_id}
            if openai_format.is_openai_path(scope["path"]):
                body = openai_format.error_body(500, f"internal error (request {request_id})")
            await JSONResponse(body, 500)(scope, receive, send_with_id)
        route = getattr(scope.get("route"), "path", "unmatched")
        state = scope.get("state") or {}
        principal = state.get("principal")
        key = audit.key_label(principal if isinstance(principal, Principal) else ANONYMOUS)
        self.metrics.requests.labels(route, status, key).inc()
        if audit.audited(scope["method"], route):
            audit.record(
                state, f"{scope['method']} {route}", scope.get("path_params") or {}, status
            )
        if self.access_log:
            # Never the headers: the Authorization header carries the admin token.
            method = scope["method"]
            log.info(
                "http %s %s %d",
                method,
                route,
                status,
                extra={
                    "fields": {
                        "method": method,
                        "route": route,
                        "status": status,
                        "ms": ms_since(started),
                    }
                },
            )
