"""Retrieval without generation: the passages for a query (MCP ``search``) and the query
vectors of texts (``POST /v1/embeddings``).

Invariant: the index searched is one the caller's key may name (a key held to indexes: its
first when the request names none, a 404 for another) and the passages are those its tenant's
filter keeps, ANDed with the request's (``Principal.where``: nothing a request sends widens it).
"""

from __future__ import annotations

from openbook.v1 import retriever_pb2
from openbook_gateway import tenancy
from openbook_gateway.operations.caller import Caller
from openbook_gateway.schemas import AnswerRequest
from openbook_gateway.services import Services


async def search(
    services: Services, caller: Caller, query: AnswerRequest
) -> retriever_pb2.RetrieveResponse:
    """The ``query.k`` passages (None: the model's default) most relevant to
    ``query.question`` on ``query.index`` by ``query.retrieval``, among those its filter keeps;
    the fields of an answer request, validated by its rules."""
    principal = caller.principal
    index = principal.index_for(query.index)
    where = principal.where(query.metadata_filter())
    k = query.k if query.k is not None else await services.default_k.get(caller.request_id)
    retrieved = await services.retrieval.retrieve(
        query.question, k, index, caller.request_id, retrieval=query.retrieval, where=where
    )
    tenancy.shown(principal, retrieved)  # a tenant's ids as it wrote them
    return retrieved


async def embed(
    services: Services, caller: Caller, texts: list[str], index: str | None
) -> retriever_pb2.EmbedQueriesResponse:
    """The query vectors of ``texts`` by the query encoder of ``index`` (None: the caller's
    default index)."""
    index = caller.principal.index_for(index)
    return await services.retrieval.embed_queries(texts, index, caller.request_id)
