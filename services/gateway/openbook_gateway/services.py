"""What the gateway's handlers work with: one typed :class:`Services`, built when the app starts.

Invariants:

* One :class:`Services` per app, opened in the app's lifespan (:func:`running_services`) and
  closed when it ends; a handler receives it as a FastAPI dependency (:data:`ServicesDep`),
  never by reading ``app.state``: :func:`get_services` is the only reader of
  ``request.app.state``.
* The clients in it are shared by every request: they hold channels and a connection pool,
  not per-request state.
* The admin token is forwarded on the admin RPCs, which the services refuse without it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from openbook.config.settings import RedisOptions
from openbook.security.sealing import Sealer
from openbook_gateway.cache import AnswerCache
from openbook_gateway.clients import GeneratorClient
from openbook_gateway.default_k import DefaultK
from openbook_gateway.metrics import GatewayMetrics
from openbook_gateway.retrieval import Retrieval
from openbook_gateway.settings import GatewaySettings


@dataclass
class Services:
    """The settings, clients and state the handlers share (module docstring)."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    retrieval: Retrieval
    generator: GeneratorClient
    cache: AnswerCache  # also the Redis client the replica registry is read through
    default_k: DefaultK
    # When this gateway started (Unix seconds): the "created" of the models /v1/models lists.
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def open(
        cls,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        redis_options: RedisOptions,
        sealer: Sealer,
    ) -> Services:
        retrieval = Retrieval(
            settings.retriever_addr,
            settings.retrieve_timeout_s,
            settings.health_timeout_s,
            admin_token=settings.admin_token,
        )
        generator = GeneratorClient(
            settings.generator_addr,
            settings.generate_timeout_s,
            settings.health_timeout_s,
            admin_token=settings.admin_token,
        )
        return cls(
            settings=settings,
            metrics=metrics,
            retrieval=retrieval,
            generator=generator,
            cache=AnswerCache(redis_options, settings.cache_ttl_s, sealer),
            default_k=DefaultK(generator, settings.health_timeout_s),
        )

    async def close(self) -> None:
        await self.retrieval.close()
        await self.generator.close()
        await self.cache.close()


@asynccontextmanager
async def running_services(
    app: FastAPI,
    settings: GatewaySettings,
    metrics: GatewayMetrics,
    redis_options: RedisOptions,
    sealer: Sealer,
) -> AsyncIterator[None]:
    """The app's lifespan: :class:`Services` open while it serves, in ``app.state.services``.

    ``redis_options`` and ``sealer`` are read before serving (by ``create_app``): a password or
    key file that cannot be read stops the start with an error naming it.
    """
    services = Services.open(settings, metrics, redis_options, sealer)
    app.state.services = services
    yield
    await services.close()


async def get_services(request: Request) -> Services:
    """The app's :class:`Services` (a FastAPI dependency: use :data:`ServicesDep`).

    Async only so that FastAPI calls it in the event loop, not in a worker thread."""
    try:
        services: Services = request.app.state.services  # set by running_services
    except AttributeError:
        raise RuntimeError(
            "the gateway's services are not open: they open in the app's lifespan "
            "(under a TestClient: `with TestClient(app) as client`)"
        ) from None
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
