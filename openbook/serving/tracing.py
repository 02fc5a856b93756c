"""Traces over gRPC: OpenTelemetry's server interceptor (``opentelemetry-instrumentation-grpc``)
continues the caller's trace from the W3C ``traceparent`` in the call's metadata with a SERVER
span per RPC; the gateway's calls put it there (:func:`trace_metadata`).

Both are added only where tracing is on (:func:`openbook.observability.telemetry.enabled`): with
tracing off a server carries no interceptor of this module and a call no trace metadata. The
propagation format is the API's global propagator (W3C trace context and baggage unless
``OTEL_PROPAGATORS`` says otherwise).

The instrumentation's span carries the ``rpc.*`` attributes of the gRPC semantic conventions
and the status the call ended with; openbook adds the request id and names it after the RPC
as those conventions do (``openbook.v1.Generator/Generate``). The servicer adds its own
attributes and child spans to it, the current span of the thread that runs the call. Health
checks and reflection are not traced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry import propagate, trace

from openbook.observability import telemetry
from openbook.serving.handlers import wrap_handler

REQUEST_ID_HEADER = "x-request-id"  # the same as grpc_server.REQUEST_ID_HEADER
# Called often (probes) and telling nothing about a request.
UNTRACED_SERVICES = ("grpc.health.", "grpc.reflection.")


@contextmanager
def _rpc_span(method: str, context: grpc.ServicerContext) -> Iterator[None]:
    span = trace.get_current_span()  # the instrumentation's SERVER span of this call
    span.update_name(method.lstrip("/"))
    metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
    span.set_attribute(telemetry.REQUEST_ID_ATTRIBUTE, metadata.get(REQUEST_ID_HEADER, ""))
    try:
        yield
    except GeneratorExit:
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
        raise
    except Exception as exc:
        # The error the servicer raised, before ErrorInterceptor (outside this one) turns it
        # into the status the instrumentation records.
        span.record_exception(exc)
        raise


class RequestIdInterceptor(grpc.ServerInterceptor):
    """Inside ``ErrorInterceptor``, itself inside the instrumentation's interceptor: the
    request id, the RPC's name and the servicer's exception on the instrumentation's span."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if method.lstrip("/").startswith(UNTRACED_SERVICES):
            return handler
        return wrap_handler(handler, lambda context: _rpc_span(method, context))


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """The instrumentation's interceptor, or none with tracing off: outermost, so that what
    the interceptors after it do (the status an error becomes) happens inside its span."""
    if not telemetry.enabled():
        return []
    # why: the instrumentation is imported only in a process that traces
    from opentelemetry.instrumentation.grpc import filters, server_interceptor

    untraced = filters.any_of(*(filters.service_prefix(s) for s in UNTRACED_SERVICES))
    return [server_interceptor(filter_=filters.negate(untraced))]


def span_interceptors() -> list[grpc.ServerInterceptor]:
    """:class:`RequestIdInterceptor`, or none with tracing off: inside ``ErrorInterceptor``."""
    return [RequestIdInterceptor()] if telemetry.enabled() else []


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's context as gRPC metadata (``traceparent``, ``tracestate``): the
    callee's SERVER span becomes its child. Empty with tracing off or no current span."""
    if not telemetry.enabled():
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())
