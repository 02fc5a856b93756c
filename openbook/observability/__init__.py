"""What a running service tells its operators: structured JSON logs with the request id
(``logs``) and OpenTelemetry traces, set up once from the ``OTEL_*`` variables (``telemetry``,
docs/observability.md). The metrics of the gRPC servers are :mod:`openbook.serving.metrics`.

Imports only the top-level leaves (``openbook.errors``); torch-free.
"""
