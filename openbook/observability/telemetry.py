"""OpenTelemetry traces of every service: the one place tracing is set up.

Each service calls :func:`setup_tracing` once at start, before it serves. The spans of the
RPCs and HTTP requests are the OpenTelemetry instrumentations' (``opentelemetry-instrumentation-
grpc`` on the retriever's and generator's servers, :mod:`openbook.serving.tracing`;
``-fastapi`` on the gateway's app); openbook's own spans, the GenAI ones and the stages of a
request (the gateway's pipeline, the generator's admission and queueing), go through
:func:`span`, :func:`past_span` and :func:`enabled`.

Configured by the standard ``OTEL_*`` variables, which the SDK reads itself (the OTLP endpoint
and its ``/v1/traces``, headers and timeout, ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, the sampler, ``OTEL_BSP_*``, ``OTEL_PROPAGATORS``). Only whether
to trace at all is decided here, before the SDK is imported:

- ``OTEL_SDK_DISABLED=true``: off, whatever else is set.
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (OTLP over HTTP/protobuf), ``console`` (spans on stdout)
  or ``none``; unset or empty, tracing is on only if ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` names a collector (then ``otlp``).
- ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` must be ``http/protobuf`` (the default) if set: the
  gRPC exporter is not installed.
- ``service.name``: the service's own (``openbook-gateway`` ...) unless the variables name one.

Invariant: off (the default) costs nothing. The tracing SDK, the exporter and the
instrumentations are not even imported, no tracer provider is installed (the API's tracer is a
no-op), no export thread runs, no gRPC interceptor is added and :func:`span` returns a shared
no-op context. An empty variable (compose's ``${VAR:-}``) counts as unset. A misconfiguration
(an unknown exporter or protocol) fails the start with :class:`~openbook.errors.InvalidArgument`
naming the variable, rather than tracing nothing silently.

Spans are flushed by the SDK's exit hook when the process ends (SIGTERM included: every
service exits normally on it), and every few seconds while it runs (``OTEL_BSP_SCHEDULE_DELAY``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace

from openbook.errors import InvalidArgument

log = logging.getLogger(__name__)

TRACER_NAME = "openbook"
# gen_ai.provider.name of every GenAI span: the models run inside openbook's own services.
PROVIDER = "openbook"
# The request id (the gateway's X-Request-ID, carried to the services as gRPC metadata).
REQUEST_ID_ATTRIBUTE = "openbook.request_id"

SUPPORTED_EXPORTERS = ("otlp", "console", "none")
SUPPORTED_PROTOCOL = "http/protobuf"

_enabled = False
_provider: Any = None  # the SDK's TracerProvider once set up (typed loosely: SDK not imported)
_NO_SPAN: AbstractContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)


def _env(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def exporters_from_env(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the variables ask for (empty: tracing off); raises
    :class:`InvalidArgument` naming the variable for one openbook cannot honour."""
    if _env(environ, "OTEL_SDK_DISABLED").lower() == "true":
        return []
    named = [e.strip().lower() for e in _env(environ, "OTEL_TRACES_EXPORTER").split(",")]
    named = [e for e in named if e]
    if not named:
        endpoint = _env(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env(
            environ, "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        named = ["otlp"] if endpoint else []
    for name in named:
        if name not in SUPPORTED_EXPORTERS:
            raise InvalidArgument(
                f"OTEL_TRACES_EXPORTER: {name!r} is not supported "
                f"(one of {', '.join(SUPPORTED_EXPORTERS)})"
            )
    if "otlp" in named:
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = _env(environ, var)
            if protocol and protocol != SUPPORTED_PROTOCOL:
                raise InvalidArgument(
                    f"{var}: {protocol!r} is not supported (only {SUPPORTED_PROTOCOL!r})"
                )
            if protocol:
                break  # the traces-specific one wins over the general one
    return [name for name in named if name != "none"]


def setup_tracing(service_name: str) -> bool:
    """Set up tracing for this process as the ``OTEL_*`` variables say (module docstring);
    True if spans are now exported. ``service_name`` is the default ``service.name``. Call
    once, at start."""
    global _enabled, _provider
    exporters = exporters_from_env(os.environ)
    if not exporters:
        return False
    # why: the SDK and its exporter thread exist only in a process that traces
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    # The SDK reads its variables from os.environ, where compose's ${VAR:-} leaves empty
    # values that it would misread (an empty endpoint is used as the URL).
    for var in [k for k, v in os.environ.items() if k.startswith("OTEL_") and not v.strip()]:
        del os.environ[var]
    # The HTTP instrumentation's stable attribute names (http.response.status_code, ...).
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; without either it
    # names the service "unknown_service...": ours then.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        if exporter == "otlp":
            # the endpoint, headers and timeout: the OTEL_EXPORTER_OTLP_* variables
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    log.info(
        "tracing: spans of %s go to %s", resource.attributes[SERVICE_NAME], ", ".join(exporters)
    )
    trace.set_tracer_provider(provider)
    _provider, _enabled = provider, True
    return True


def enabled() -> bool:
    """Whether this process exports spans (:func:`setup_tracing` set it up)."""
    return _enabled


def shutdown_tracing() -> None:
    """Export what is buffered and stop (the SDK also does this at exit)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
) -> AbstractContextManager[trace.Span]:
    """A span made current for the ``with`` block (child of the current one), which records
    an escaping exception as its error; with tracing off a shared no-op context (no span
    object is made, nothing is recorded)."""
    if not _enabled:
        return _NO_SPAN
    return tracer().start_as_current_span(name, kind=kind, attributes=dict(attributes or {}))


def past_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Record a span that already happened (``time.time_ns()`` bounds), as a child of the
    current span: a stage measured in another thread, such as the generator's queueing,
    reported by the thread that serves the call. Nothing with tracing off."""
    if not _enabled or end_ns < start_ns or start_ns <= 0:
        return
    recorded = tracer().start_span(name, attributes=dict(attributes or {}), start_time=start_ns)
    recorded.end(end_time=end_ns)


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Add ``attributes`` to the current span (a no-op with tracing off or no span)."""
    if _enabled:
        trace.get_current_span().set_attributes(dict(attributes))
