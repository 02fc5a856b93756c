"""``openbook-generator``: serve the generator over gRPC (settings: :class:`GeneratorSettings`)."""

from __future__ import annotations

from openbook.serving.startup import prepare
from openbook_generator.server import serve
from openbook_generator.settings import GeneratorSettings


def main() -> None:
    settings = GeneratorSettings()
    prepare("openbook-generator", settings)  # logging, secrets, Redis, tracing
    serve(settings)


if __name__ == "__main__":
    main()
