"""The admin API under ``/admin``: swap the active index, reload the model, list replicas.

Invariant: every route here needs the ``admin`` scope (``openbook_gateway.access.RULES``: the
admin token, or a key made with it that has ``admin``): without ``OPENBOOK_ADMIN_TOKEN`` set the
admin API is off (401), a request with no known credential is refused (401), one whose key
lacks the scope too (403). The gateway forwards the token on the admin RPCs, which the
retriever and generator check again.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from openbook_gateway import audit
from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.replicas import desired_model, list_replicas, outcome, reload_models
from openbook_gateway.schemas import (
    ReloadModelRequest,
    ReloadModelResponse,
    ReplicasResponse,
    SwapIndexRequest,
    SwapIndexResponse,
)
from openbook_gateway.services import ServicesDep

log = logging.getLogger(__name__)

# Loading a large index or model can take a while: an admin call is not cut by the deadline
# of a query or an answer, but waits at least this long.
ADMIN_MIN_TIMEOUT_S = 600.0


router = APIRouter(prefix="/admin", route_class=JSONBodyRoute)


@router.post("/swap-index", response_model=SwapIndexResponse)
async def swap_index(body: SwapIndexRequest, request: Request, services: ServicesDep) -> dict:
    audit.note(request, index=body.index)
    timeout_s = max(services.settings.retrieve_timeout_s, ADMIN_MIN_TIMEOUT_S)
    previous, active = await services.retrieval.swap(
        body.index, request.state.request_id, timeout_s=timeout_s
    )
    services.cache.swapped(active)
    log.info("index swapped %s -> %s", previous, active)
    return {"previous": previous or None, "active": active}


@router.post("/reload-model", response_model=ReloadModelResponse)
async def reload_model(
    body: ReloadModelRequest, request: Request, services: ServicesDep
) -> dict | JSONResponse:
    """Load a trained checkpoint into the retriever (query encoder) and the generator.

    Each service verifies the checkpoint before switching and keeps its current model if
    it is refused; if one service refuses it, the other is put back on the model it served
    (``rolled_back``). In-flight requests finish on the model they started with.
    """
    audit.note(request, checkpoint=body.checkpoint)
    settings = services.settings
    status, result = await reload_models(
        services.retrieval,
        services.generator,
        services.cache.client,
        services.cache.sealer,
        body.checkpoint or "",
        request.state.request_id,
        timeout_s=max(settings.generate_timeout_s, ADMIN_MIN_TIMEOUT_S),
        wait_s=settings.reload_wait_s,
    )
    return result if status == 200 else JSONResponse(jsonable_encoder(result), status)


@router.get("/replicas", response_model=ReplicasResponse)
async def replicas(services: ServicesDep) -> dict:
    """Every live retriever and generator replica: the model version it serves and how the
    latest reload went; and the desired model recorded in Redis."""
    client = services.cache.client
    try:
        desired = await desired_model(client, services.cache.sealer)
        listed = await list_replicas(client, services.cache.sealer)
    except (RedisError, OSError) as exc:
        raise HTTPException(503, f"redis unavailable: replicas unknown: {exc}") from None
    request_id = desired.get("id", "")
    return {
        "desired": desired,
        "replicas": [outcome(r, request_id) if request_id else r for r in listed],
    }
