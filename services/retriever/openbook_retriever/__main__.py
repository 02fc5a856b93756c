"""``openbook-retriever``: serve the retriever over gRPC (settings: :class:`RetrieverSettings`)."""

from __future__ import annotations

from openbook.logs import setup_logging
from openbook.telemetry import setup_tracing
from openbook_retriever.server import serve
from openbook_retriever.settings import RetrieverSettings


def main() -> None:
    settings = RetrieverSettings()
    setup_logging(settings.log_level)
    settings.check_secrets("openbook-retriever")
    settings.check_redis("openbook-retriever")  # unreachable: one line naming it, not a trace
    setup_tracing("openbook-retriever")  # before the server exists: its interceptors depend on it
    serve(settings)


if __name__ == "__main__":
    main()
