"""The gateway's HTTP server: the app under uvicorn, with the request-head limits of
:mod:`openbook_gateway.http_protocol`. ``openbook-gateway`` (what compose and ``openbook up``
run) serves through :func:`serve`, and tests start the same :func:`uvicorn_config`."""

from __future__ import annotations

import sys

import uvicorn
from starlette.types import ASGIApp

from openbook_gateway import openai_format
from openbook_gateway.app import create_app
from openbook_gateway.http_protocol import HeadLimits, head_limited_protocol
from openbook_gateway.metrics import GatewayMetrics
from openbook_gateway.settings import GatewaySettings

# uvicorn's exit status when the server could not start (the port taken, ...).
STARTUP_FAILURE = 3
# The route label of requests refused while their head was read (408, 431).
HEAD_ROUTE = "(request head)"


def error_body(path: str, status: int, message: str) -> dict:
    """A refusal's body as the route asked for would have written it: OpenAI's error object
    under ``/v1``, ``{"detail": ...}`` elsewhere."""
    if openai_format.is_openai_path(path):
        return openai_format.error_body(status, message)
    return {"detail": message}


def uvicorn_config(settings: GatewaySettings, app: ASGIApp | None = None) -> uvicorn.Config:
    """How uvicorn serves ``app`` (default: the gateway's) for ``settings``."""
    limits = HeadLimits(
        timeout_s=settings.header_timeout_s,
        max_bytes=settings.max_header_bytes,
        max_fields=settings.max_header_count,
    )
    app = app if app is not None else create_app(settings)
    metrics: GatewayMetrics | None = getattr(getattr(app, "state", None), "metrics", None)

    def count_refusal(status: int) -> None:
        # refused before a route was read: counted under the route "(request head)"
        if metrics is not None:
            metrics.requests.labels(HEAD_ROUTE, status, "anonymous").inc()

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=head_limited_protocol(limits, error_body, count_refusal),
        log_config=None,
        timeout_graceful_shutdown=10,
    )


def serve(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT; exit with :data:`STARTUP_FAILURE` if the server cannot
    start (as ``uvicorn.run`` does)."""
    server = uvicorn.Server(uvicorn_config(settings))
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
