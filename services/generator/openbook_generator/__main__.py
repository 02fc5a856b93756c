"""``openbook-generator``: serve the generator over gRPC (settings: :class:`GeneratorSettings`)."""

from __future__ import annotations

from openbook.serving.startup import run
from openbook_generator.server import serve
from openbook_generator.settings import GeneratorSettings


def main() -> None:
    run("openbook-generator", GeneratorSettings, serve)


if __name__ == "__main__":
    main()
