"""``openbook-gateway``: serve the HTTP API, configured by :class:`GatewaySettings`."""

from __future__ import annotations

from openbook.logs import setup_logging
from openbook.telemetry import setup_tracing
from openbook_gateway.server import serve
from openbook_gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    setup_logging(settings.log_level)
    settings.check_secrets("openbook-gateway")
    settings.check_redis("openbook-gateway")  # unreachable: one line naming it, not a trace
    setup_tracing("openbook-gateway")  # before the server exists: its interceptors depend on it
    serve(settings)


if __name__ == "__main__":
    main()
