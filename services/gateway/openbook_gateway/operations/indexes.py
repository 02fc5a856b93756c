"""Indexes: list them, create one, delete one (``GET``/``POST /indexes``,
``DELETE /indexes/{name}``, MCP ``list_indexes`` and ``create_index``, ``/v1/models``).

Invariants:

* A key held to indexes sees, names and creates only those (:meth:`Principal.sees`); the
  others' names do not leak, and its first is the one a request naming none is answered from.
* A key with a tenant filter gets no passage counts (``count`` null): an index's total is
  every tenant's, and would tell one tenant the others' volume.
* Listing records each index's version (answer cache, metrics); creating one starts its
  version again from the retriever's (a new index of a deleted one's name).
"""

from __future__ import annotations

import logging

from fastapi import HTTPException

from openbook_gateway.mapping import index_out, indexes_response
from openbook_gateway.operations.caller import Caller
from openbook_gateway.operations.documents import acknowledged
from openbook_gateway.schemas import CreateIndexRequest
from openbook_gateway.services import Services

log = logging.getLogger(__name__)


async def list_indexes(services: Services, caller: Caller) -> dict:
    """The ``IndexesResponse`` of the indexes the caller may see (its ``indexes`` are
    ``IndexOut`` models)."""
    listed = await services.retrieval.list_indexes(caller.request_id)
    for info in listed.indexes:
        services.metrics.index_version(info.name, info.version)
        services.cache.wrote(info.name, info.version)
    reply = indexes_response(listed)
    principal = caller.principal
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
    if principal.tenant is not None:
        reply["indexes"] = [i.model_copy(update={"count": None}) for i in reply["indexes"]]
    return reply


async def loadable_names(services: Services, caller: Caller) -> list[str]:
    """The names of the indexes the caller may name that can be loaded (no ``problem``)."""
    listed = await services.retrieval.list_indexes(caller.request_id)
    principal = caller.principal
    return [i.name for i in listed.indexes if not i.problem and principal.sees(i.name)]


async def create_index(services: Services, caller: Caller, body: CreateIndexRequest) -> dict:
    """An empty index (``IndexOut``): the default encoder and type, or those of the index
    named by ``like``. A key held to indexes creates only those (403) and copies only those
    (404 for another ``like``)."""
    principal = caller.principal
    if not principal.sees(body.name):
        raise HTTPException(
            403,
            f"name: key {principal.name!r} may create only its indexes "
            f"({', '.join(principal.indexes or ())})",
        )
    if body.like is not None and not principal.sees(body.like):
        raise HTTPException(404, principal.unknown_index(body.like))
    info = await services.retrieval.create_index(
        body.name, body.type or "", body.like or "", caller.request_id
    )
    # A new index of a deleted one's name starts again from version 0.
    services.cache.forget(body.name)
    acknowledged(services, info.name, info.version)
    log.info("index created %s", info.name)
    return index_out(info)


async def delete_index(services: Services, caller: Caller, name: str) -> dict:
    """Delete an index and its files (``DeleteIndexResponse``); the retriever refuses the
    active index (409)."""
    await services.retrieval.delete_index(name, caller.request_id)
    await services.cache.deleted(name)
    services.metrics.index_deleted(name)
    log.info("index deleted %s", name)
    return {"name": name}
