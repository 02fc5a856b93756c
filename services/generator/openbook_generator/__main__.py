"""``openbook-generator``: serve the generator over gRPC (settings: :class:`GeneratorSettings`)."""

from __future__ import annotations

from openbook.logs import setup_logging
from openbook.telemetry import setup_tracing
from openbook_generator.server import serve
from openbook_generator.settings import GeneratorSettings


def main() -> None:
    settings = GeneratorSettings()
    setup_logging(settings.log_level)
    settings.check_secrets("openbook-generator")
    settings.check_redis("openbook-generator")  # unreachable: one line naming it, not a trace
    setup_tracing("openbook-generator")  # before the server exists: its interceptors depend on it
    serve(settings)


if __name__ == "__main__":
    main()
