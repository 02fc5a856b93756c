"""``openbook-retriever``: serve the retriever over gRPC (settings: :class:`RetrieverSettings`)."""

from __future__ import annotations

from openbook.serving.startup import prepare
from openbook_retriever.server import serve
from openbook_retriever.settings import RetrieverSettings


def main() -> None:
    settings = RetrieverSettings()
    prepare("openbook-retriever", settings)  # logging, secrets, Redis, tracing
    serve(settings)


if __name__ == "__main__":
    main()
