"""``GET /indexes``: the indexes the retriever has, which is active, and whether each loads
(to a key held to indexes: only those, its first as the active one;
``openbook_gateway.operations.indexes``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.operations import indexes as operations
from openbook_gateway.operations.caller import caller_of
from openbook_gateway.schemas import IndexesResponse
from openbook_gateway.services import ServicesDep

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/indexes", response_model=IndexesResponse)
async def indexes(request: Request, services: ServicesDep) -> dict:
    return await operations.list_indexes(services, caller_of(request))
