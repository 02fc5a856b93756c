"""Tracing's configuration (the standard OTEL_* variables) and its cost when off.

The traces themselves, across the three services, are checked end to end in
tests/test_end_to_end.py (an OTLP receiver in the test process).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from openbook.errors import InvalidArgument
from openbook.observability.telemetry import exporters_from_env


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, []),
        # compose's ${VAR:-} gives empty values: unset
        ({"OTEL_TRACES_EXPORTER": "", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            ["otlp"],
        ),
    ],
)
def test_exporters_follow_the_standard_variables(env, exporters):
    assert exporters_from_env(env) == exporters


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_a_configuration_openbook_cannot_honour_fails_naming_the_variable(env, variable):
    with pytest.raises(InvalidArgument, match=variable):
        exporters_from_env(env)


OFF_PROBE = """
import json, sys, threading
from opentelemetry import trace
from openbook.observability import telemetry
from openbook.serving.tracing import server_interceptors, span_interceptors, trace_metadata
from openbook_gateway.app import create_app
on = telemetry.setup_tracing("openbook-gateway")
create_app()
with telemetry.span("x") as span:
    recording = span.is_recording()
print(json.dumps({
    "on": on,
    # (redis-py imports the SDK's metrics when it is installed: its own, unused)
    "sdk": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk.trace")),
    "exporter": sorted(m for m in sys.modules if m.startswith("opentelemetry.exporter")),
    "instrumentation": sorted(
        m for m in sys.modules if m.startswith("opentelemetry.instrumentation")
    ),
    "provider": type(trace.get_tracer_provider()).__name__,
    "threads": [t.name for t in threading.enumerate()],
    "server": len(server_interceptors()) + len(span_interceptors()),
    "client": trace_metadata(),
    "recording": recording,
}))
"""


def test_tracing_is_off_by_default_at_no_cost():
    """Without OTEL_* variables: no tracing SDK, no exporter or its thread, no
    instrumentation, the API's no-op provider, no interceptor, no trace metadata, no span."""
    env = {"PATH": "/usr/bin:/bin", "OPENBOOK_LOG_LEVEL": "WARNING"}
    probe = subprocess.run(
        [sys.executable, "-c", OFF_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen == {
        "on": False,
        "sdk": [],
        "exporter": [],
        "instrumentation": [],
        "provider": "ProxyTracerProvider",
        "threads": ["MainThread"],
        "server": 0,
        "client": [],
        "recording": False,
    }


RPC_PROBE = """
import json
from concurrent import futures
import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from openbook.observability import telemetry
from openbook.errors import InvalidArgument
from openbook.serving.grpc_server import ErrorInterceptor
from openbook.serving.tracing import server_interceptors, span_interceptors

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
telemetry._enabled = True  # as setup_tracing leaves it, with spans kept in memory

def refused(request, context):
    raise InvalidArgument("k: must be >= 1")

def broken(request, context):
    raise KeyError("a bug")

handlers = grpc.method_handlers_generic_handler("openbook.v1.Probe", {
    "Refused": grpc.unary_unary_rpc_method_handler(refused),
    "Broken": grpc.unary_unary_rpc_method_handler(broken),
})
interceptors = [*server_interceptors(), ErrorInterceptor(), *span_interceptors()]
server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=interceptors)
server.add_generic_rpc_handlers((handlers,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
codes = {}
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    for rpc in ("Refused", "Broken"):
        try:
            channel.unary_unary(f"/openbook.v1.Probe/{rpc}")(b"", metadata=(("x-request-id", rpc),))
        except grpc.RpcError as error:
            codes[rpc] = error.code().name
server.stop(0)
print(json.dumps({"codes": codes, "spans": {
    s.name: {
        "kind": s.kind.name,
        "status_code": s.attributes["rpc.grpc.status_code"],
        "request_id": s.attributes["openbook.request_id"],
        "error": s.status.status_code.name,
        "exceptions": [e.attributes["exception.type"] for e in s.events],
    }
    for s in exporter.get_finished_spans()
}}))
"""


def test_an_rpc_span_holds_the_request_id_the_status_and_the_servicers_exception():
    """OpenTelemetry's server interceptor outside ErrorInterceptor: the span records the
    status the error became; ours inside adds the request id and the real exception. A
    client's mistake is not the server's error (the gRPC semantic conventions)."""
    probe = subprocess.run(
        [sys.executable, "-c", RPC_PROBE], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["codes"] == {"Refused": "INVALID_ARGUMENT", "Broken": "INTERNAL"}
    refused = seen["spans"]["openbook.v1.Probe/Refused"]
    assert refused["kind"] == "SERVER" and refused["request_id"] == "Refused"
    assert refused["status_code"] == 3 and refused["error"] == "UNSET"
    assert "openbook.errors.InvalidArgument" in refused["exceptions"]
    broken = seen["spans"]["openbook.v1.Probe/Broken"]
    assert broken["status_code"] == 13 and broken["error"] == "ERROR"
    assert "KeyError" in broken["exceptions"]
