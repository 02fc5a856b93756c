"""W3C trace context over gRPC: the client side puts the caller's span in the call's metadata
(``traceparent``, ``tracestate``), the server side continues it with a SERVER span per RPC.

Both are added only where tracing is on (:func:`openbook.telemetry.enabled`): with tracing
off a channel and a server carry no interceptor of this module at all. The propagation format
is the API's global propagator (W3C trace context and baggage unless ``OTEL_PROPAGATORS`` says
otherwise).

A server span is named after the RPC (``openbook.v1.Generator/Generate``), carries the
``rpc.*`` attributes of the gRPC semantic conventions, the request id, and the status the call
ended with; the servicer adds its own attributes and child spans to it, as the current span of
the thread that runs the call. Health checks and reflection are not traced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from openbook import telemetry
from openbook.errors import status_for
from openbook.serving.handlers import wrap_handler

REQUEST_ID_HEADER = "x-request-id"  # the same as grpc_server.REQUEST_ID_HEADER
# Called often (probes) and telling nothing about a request.
UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def _metadata_dict(metadata) -> dict[str, str]:
    return {k: v for k, v in metadata or () if isinstance(v, str)}


@contextmanager
def _server_span(method: str, context: grpc.ServicerContext) -> Iterator[trace.Span]:
    carrier = _metadata_dict(context.invocation_metadata())
    service, _, rpc = method.lstrip("/").partition("/")
    attributes = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": rpc,
        telemetry.REQUEST_ID_ATTRIBUTE: carrier.get(REQUEST_ID_HEADER, ""),
    }
    # The exception is recorded here (it carries the real error); its status code is the one
    # ErrorInterceptor (outside this one) answers with.
    with telemetry.tracer().start_as_current_span(
        method.lstrip("/"),
        context=propagate.extract(carrier),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except GeneratorExit:
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
            raise
        except BaseException as exc:
            # An abort (context.abort) raises a bare Exception after setting the status.
            aborted = context.code() if hasattr(context, "code") else None
            if isinstance(aborted, grpc.StatusCode):
                code = aborted
            elif isinstance(exc, Exception):
                code = status_for(exc)
            else:
                code = grpc.StatusCode.UNKNOWN
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {exc}"))
            raise
        else:
            code = context.code() if hasattr(context, "code") else None
            status = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK
            span.set_attribute("rpc.grpc.status_code", status.value[0])


class TracingServerInterceptor(grpc.ServerInterceptor):
    """A SERVER span around every traced RPC, child of the caller's span when its metadata
    carries one (module docstring)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if method.startswith(UNTRACED_PREFIXES):
            return handler
        return wrap_handler(handler, lambda context: _server_span(method, context))


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """The server's tracing interceptor, or none with tracing off."""
    return [TracingServerInterceptor()] if telemetry.enabled() else []


def _with_trace_context(details: Any) -> Any:
    """``details`` with the current span's context added to its metadata."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details  # no span is current: nothing to continue
    entries = [(k, v) for k, v in details.metadata or () if k not in carrier]
    entries += list(carrier.items())
    return details._replace(metadata=grpc.aio.Metadata(*entries))


class _AioUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    """Puts the caller's span (the current one where the call is made) in the metadata of
    every unary call of an asyncio channel: the callee's SERVER span becomes its child."""

    async def intercept_unary_unary(self, continuation: Callable, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _AioStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls (GenerateStream). A class of its own: an asyncio
    channel files each interceptor under the first call type it implements, only there."""

    async def intercept_unary_stream(self, continuation: Callable, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


def aio_client_interceptors() -> list[grpc.aio.ClientInterceptor] | None:
    """The tracing interceptors of an asyncio channel, or None with tracing off."""
    return [_AioUnaryTracing(), _AioStreamTracing()] if telemetry.enabled() else None
