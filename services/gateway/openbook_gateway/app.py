"""The HTTP front door, assembled: settings, lifespan, middlewares, error handlers, routers.

Nothing here handles a request. The routes are named handlers in :mod:`openbook_gateway.routes`
(one module per concern); what they work with is one :class:`~openbook_gateway.services.Services`,
opened in the lifespan and handed to them as a dependency; the middlewares are in
:mod:`openbook_gateway.middleware`, the error handlers in :mod:`openbook_gateway.errors`.
Anything that fails otherwise is a 500 naming the request id.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from openbook.config.settings import RedisOptions
from openbook.observability import telemetry
from openbook.security.sealing import Sealer, load_sealer
from openbook_gateway import errors
from openbook_gateway.access import check_access
from openbook_gateway.metrics import GatewayMetrics
from openbook_gateway.middleware import BodySizeLimit, RequestContext
from openbook_gateway.openai_schemas import OpenAIRequestError
from openbook_gateway.routes import (
    admin,
    answer,
    documents,
    health,
    indexes,
    keys,
    mcp,
    openai,
    pages,
    uploads,
)
from openbook_gateway.routes.mcp import McpEndpoint
from openbook_gateway.services import running_services
from openbook_gateway.settings import GatewaySettings

# Probes and scrapes: not requests anyone follows in a trace (regular expressions of the URL).
UNTRACED_URLS = "/healthz$,/readyz$,/metrics$"


@asynccontextmanager
async def lifespan(
    app: FastAPI,
    *,
    settings: GatewaySettings,
    metrics: GatewayMetrics,
    redis_options: RedisOptions,
    sealer: Sealer,
    mcp_endpoint: McpEndpoint,
) -> AsyncIterator[None]:
    """While the app serves: its :class:`~openbook_gateway.services.Services` are open, and
    the MCP session manager runs (its task group lives as long as the app serves)."""
    if settings.access_log:
        # RequestContext logs every request (route, status, ms, request id): uvicorn's own
        # access line would only repeat it.
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    async with (
        running_services(app, settings, metrics, redis_options, sealer),
        mcp_endpoint.running(),
    ):
        yield


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()
    # Read before serving: a password or key file that cannot be read stops the start with
    # an error naming it, never a gateway running without them.
    redis_options = settings.redis_options()
    sealer = load_sealer(settings.server_key_file)
    mcp_endpoint = McpEndpoint(settings)

    app = FastAPI(
        title="openbook",
        version="0.1.0",
        description="Retrieval-Augmented Generation (Lewis et al., 2020) as a service.",
        # Who a request is and whether its route lets it in (issue 43), decided once for every
        # route (access.RULES); /mcp, an ASGI route of its own, asks the same door.
        dependencies=[Depends(check_access)],
        # FastAPI's own pages are routes no key could open: off when every route needs one.
        docs_url=None if settings.require_keys else "/docs",
        redoc_url=None if settings.require_keys else "/redoc",
        openapi_url=None if settings.require_keys else "/openapi.json",
        lifespan=partial(
            lifespan,
            settings=settings,
            metrics=metrics,
            redis_options=redis_options,
            sealer=sealer,
            mcp_endpoint=mcp_endpoint,
        ),
    )
    # The server counts the refusals of request heads in it (server.uvicorn_config), before
    # any route or the lifespan runs.
    app.state.metrics = metrics

    # Every router that takes a body reads it as JSON (bodies.JSONBodyRoute), but uploads'
    # (a multipart form, parsed by its handler).
    for module in (pages, openai, health, answer, indexes, documents, uploads, admin, keys):
        app.include_router(module.router)
    # An ASGI app of its own (the MCP SDK's transport), at /mcp exactly: a Mount would answer
    # /mcp with a redirect to /mcp/.
    app.router.routes.append(
        Route(mcp.PATH, endpoint=mcp_endpoint, methods=mcp.METHODS, include_in_schema=False)
    )

    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        document_max_bytes=settings.max_document_body_bytes,
    )
    # Outermost (added last): every response, a 413 from BodySizeLimit too, gets a request id.
    app.add_middleware(RequestContext, metrics=metrics, access_log=settings.access_log)
    if telemetry.enabled():
        # why: the instrumentation is imported only in a process that traces
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        # Each request's SERVER span (``POST /answer``, continuing the client's traceparent),
        # outside every middleware; the send/receive spans of each message add nothing.
        FastAPIInstrumentor.instrument_app(
            app, excluded_urls=UNTRACED_URLS, exclude_spans=["receive", "send"]
        )

    # Registered as the decorator would: Starlette types add_exception_handler's handler as
    # taking any Exception, and each of these takes only the one it is registered for.
    app.exception_handler(RequestValidationError)(errors.invalid_request)
    app.exception_handler(OpenAIRequestError)(errors.openai_request_error)
    app.exception_handler(StarletteHTTPException)(errors.http_error)
    return app
