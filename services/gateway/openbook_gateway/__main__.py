"""``openbook-gateway``: serve the HTTP API, configured by :class:`GatewaySettings`."""

from __future__ import annotations

from openbook.serving.startup import run
from openbook_gateway.server import serve
from openbook_gateway.settings import GatewaySettings


def main() -> None:
    run("openbook-gateway", GatewaySettings, serve)


if __name__ == "__main__":
    main()
