"""``openbook-gateway``: serve the HTTP API, configured by :class:`GatewaySettings`."""

from __future__ import annotations

import uvicorn

from openbook.logs import setup_logging
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    setup_logging(settings.log_level)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
