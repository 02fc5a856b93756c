"""Liveness, readiness and metrics: ``GET /healthz``, ``/readyz`` and ``/metrics``.

``/healthz`` is the process answering; ``/readyz`` is 200 only while the retriever (every
shard) and the generator are serving. Redis only caches and coordinates: it is reported,
but without it the gateway still answers, so it never makes ``/readyz`` fail.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from openbook.storage.artifacts import public_name
from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.replicas import list_replicas
from openbook_gateway.services import ServicesDep

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(services: ServicesDep, response: Response) -> dict:
    shards = await services.retrieval.shard_health()
    ready_services = {
        "retriever": all(shards.values()),
        "generator": await services.generator.healthy(),
    }
    redis_ok = await services.cache.ping()
    ready = all(ready_services.values())
    if not ready:
        response.status_code = 503
    body: dict = {"ready": ready, "services": ready_services, "redis": redis_ok}
    if len(shards) > 1:  # sharded: which shard is down
        body["retriever_shards"] = shards
    if redis_ok:
        try:
            listed = await list_replicas(services.cache.client, services.cache.sealer)
        except (RedisError, OSError):
            listed = []
        if listed:  # the replicas that follow shared reloads, and the version each serves
            # each version by name: a record may name a path (issue 42), a reply never does
            body["replicas"] = [
                {
                    **{key: r.get(key, "") for key in ("service", "replica", "state")},
                    "version": public_name(str(r.get("version", ""))),
                }
                for r in listed
            ]
    return body


@router.get("/metrics")
async def prometheus_metrics(services: ServicesDep) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
