"""How many passages to retrieve for a request that names no ``k``.

The served generator's ``default_k`` (a RAG checkpoint's n_docs), else
:data:`~openbook_gateway.schemas.DEFAULT_K`; read from the generator's Info RPC and remembered
per generator model version. Invariant: a version is asked about once while it is remembered;
an answer from a version not seen before (a reload) makes the next request ask again.
"""

from __future__ import annotations

import logging

from fastapi import HTTPException

from openbook.v1 import generator_pb2
from openbook_gateway.clients import GeneratorClient
from openbook_gateway.schemas import DEFAULT_K

log = logging.getLogger(__name__)

# Generator model versions whose default k the gateway remembers (a reload adds one).
MAX_REMEMBERED_DEFAULTS = 16


class DefaultK:
    """The number of passages for a request that names none (module docstring)."""

    def __init__(self, generator: GeneratorClient, timeout_s: float) -> None:
        self.generator = generator
        self.timeout_s = timeout_s
        self.by_version: dict[str, int] = {}
        self.version: str | None = None  # the version the latest Info or answer came from

    async def get(self, request_id: str = "") -> int:
        if self.version is None or self.version not in self.by_version:
            try:
                info = await self.generator.call(
                    self.generator.stub.Info,
                    generator_pb2.InfoRequest(),
                    request_id,
                    timeout_s=self.timeout_s,
                )
            except HTTPException as exc:  # the answer's own call reports the generator's state
                log.warning("generator info unavailable, default k unknown: %s", exc.detail)
                return self.by_version.get(self.version or "", DEFAULT_K)
            k = info.default_k or DEFAULT_K
            self.remember(info.model_version, k)
            return k
        return self.by_version[self.version]

    def remember(self, version: str, k: int) -> None:
        if len(self.by_version) >= MAX_REMEMBERED_DEFAULTS and version not in self.by_version:
            self.by_version.clear()
        self.by_version[version] = k
        self.version = version

    def seen(self, version: str) -> None:
        """An answer came from ``version``: a version not seen before is asked about next time."""
        self.version = version
