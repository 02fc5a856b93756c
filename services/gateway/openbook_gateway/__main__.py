"""``openbook-gateway``: serve the HTTP API, configured by :class:`GatewaySettings`."""

from __future__ import annotations

from openbook.serving.startup import prepare
from openbook_gateway.server import serve
from openbook_gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    prepare("openbook-gateway", settings)  # logging, secrets, Redis, tracing
    serve(settings)


if __name__ == "__main__":
    main()
