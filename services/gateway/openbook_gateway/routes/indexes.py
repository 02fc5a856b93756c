"""``GET /indexes``: the indexes the retriever has, which is active, and whether each loads
(to a key held to indexes: only those, its first as the active one)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.mapping import indexes_response
from openbook_gateway.principal import principal_of
from openbook_gateway.schemas import IndexesResponse
from openbook_gateway.services import ServicesDep

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/indexes", response_model=IndexesResponse)
async def indexes(request: Request, services: ServicesDep) -> dict:
    listed = await services.retrieval.list_indexes(request.state.request_id)
    for info in listed.indexes:
        services.metrics.index_version(info.name, info.version)
        services.cache.wrote(info.name, info.version)
    reply = indexes_response(listed)
    principal = principal_of(request)
    if principal.indexes is not None:
        # a key held to indexes sees only those (the others' names do not leak), and its
        # first as the one a request naming none is answered from
        first = principal.index_for(None)
        reply["active"] = first
        reply["indexes"] = [
            i.model_copy(update={"active": i.name == first})
            for i in reply["indexes"]
            if principal.sees(i.name)
        ]
    return reply
