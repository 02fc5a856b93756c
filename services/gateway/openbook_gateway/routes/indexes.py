"""``GET /indexes``: the indexes the retriever has, which is active, and whether each loads."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.mapping import indexes_response
from openbook_gateway.schemas import IndexesResponse
from openbook_gateway.services import ServicesDep

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/indexes", response_model=IndexesResponse)
async def indexes(request: Request, services: ServicesDep) -> dict:
    listed = await services.retrieval.list_indexes(request.state.request_id)
    for info in listed.indexes:
        services.metrics.index_version(info.name, info.version)
        services.cache.wrote(info.name, info.version)
    return indexes_response(listed)
