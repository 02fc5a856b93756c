"""The documents of a live index: write, read, list and delete them (the REST documents and
upload routes, MCP ``put_document`` and ``delete_document``).

Invariants:

* What comes in is checked already (the transport's request models and
  ``openbook.validation.limits``' rules); what only the retriever can know maps from its gRPC code
  (the clients: NOT_FOUND -> 404, ALREADY_EXISTS and FAILED_PRECONDITION -> 409, INVALID_ARGUMENT ->
  422).
* A caller with a tenant filter (``openbook_gateway.tenancy``) names ids in its tenant's own
  namespace (another tenant's ``report`` is not its ``report``, and an id another tenant
  holds is as free to it as any), writes its fields into what it writes, and reads and lists
  only what its filter keeps (404 for the rest, as for a document that does not exist); what
  it gets back names its ids as it wrote them. No caller writes a new id beginning with
  ``~`` (the namespaces').
* Each acknowledged write's version is remembered by the answer cache and the metrics
  (:func:`acknowledged`): this gateway never serves a cached answer computed on fewer writes
  than it has acknowledged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from openbook.v1 import retriever_pb2
from openbook_gateway import tenancy
from openbook_gateway.operations.caller import Caller
from openbook_gateway.services import Services


@dataclass(frozen=True)
class NewDocument:
    """A document to write, its fields checked by the transport; ``metadata_field`` is what a
    tenant's refusal of its metadata names (``documents[2].metadata`` in a batch)."""

    id: str
    title: str
    text: str
    metadata: dict[str, Any] | None = None
    metadata_field: str = "metadata"
    id_field: str = "doc_id"  # what a refusal of its id names (``documents[2].id``)


def acknowledged(services: Services, index: str, version: int) -> None:
    """Remember that ``index`` is at ``version`` once a write there is acknowledged."""
    services.cache.wrote(index, version)
    services.metrics.index_version(index, version)


async def _acknowledged(
    services: Services, index: str, write: Awaitable[retriever_pb2.WriteResponse]
) -> retriever_pb2.WriteResponse:
    """``write``'s reply, its version remembered (:func:`acknowledged`)."""
    reply = await write
    acknowledged(services, index, reply.version)
    return reply


async def write(
    services: Services, caller: Caller, index: str, documents: Sequence[NewDocument]
) -> retriever_pb2.WriteResponse:
    """Insert or replace ``documents`` under one version, all or nothing (per shard):
    split into passages, embedded, searchable once this returns."""
    principal = caller.principal
    for d in documents:
        tenancy.refuse_reserved(d.id, d.id_field)
    if principal.tenant is not None:
        # in the tenant's namespace (never over another tenant's document), its fields
        # stamped in
        stored = [tenancy.stored_id(principal, d.id, d.id_field) for d in documents]
        documents = [
            NewDocument(
                at,
                d.title,
                d.text,
                tenancy.stamped(principal, at, d.title, d.metadata, d.metadata_field),
                d.metadata_field,
                d.id_field,
            )
            for at, d in zip(stored, documents, strict=True)
        ]
    protos = [
        retriever_pb2.Document(
            id=d.id,
            title=d.title,
            text=d.text,
            metadata_json=json.dumps(d.metadata or {}, allow_nan=False, ensure_ascii=False),
        )
        for d in documents
    ]
    return await _acknowledged(
        services, index, services.retrieval.put_documents(index, protos, caller.request_id)
    )


async def delete(
    services: Services, caller: Caller, index: str, doc_id: str
) -> retriever_pb2.WriteResponse:
    """Delete a document (404 when absent, or when the caller's tenant cannot see it): its
    passages are never served once this returns."""
    if caller.principal.tenant is not None:
        # a document of its namespace that its filter keeps, or a 404
        await get(services, caller, index, doc_id)
    stored = tenancy.stored_id(caller.principal, doc_id)
    return await _acknowledged(
        services, index, services.retrieval.delete_document(index, stored, caller.request_id)
    )


async def get(
    services: Services, caller: Caller, index: str, doc_id: str
) -> retriever_pb2.Document:
    """Document ``doc_id``, a 404 when there is none or the caller's tenant cannot see it (the
    same words: whether another tenant has it does not show); its ids as the caller names
    them."""
    principal = caller.principal
    if principal.tenant is None:
        return await services.retrieval.get_document(index, doc_id, caller.request_id)
    stored = tenancy.stored_id(principal, doc_id)
    document = await tenancy.existing(services.retrieval, index, stored, caller.request_id)
    if document is None or not tenancy.visible(principal, document):
        raise HTTPException(404, f"document {doc_id!r} not found in index {index!r}")
    document.id = doc_id
    passage_ids = [tenancy.public_id(principal, p) for p in document.passage_ids]
    del document.passage_ids[:]
    document.passage_ids.extend(passage_ids)
    return document


async def list_page(
    services: Services, caller: Caller, index: str, cursor: str, limit: int
) -> retriever_pb2.ListDocumentsResponse:
    """A page of the document ids the caller can see, in id order, after ``cursor``."""
    principal = caller.principal
    if principal.tenant is not None:
        listed = await tenancy.visible_page(
            principal, services.retrieval, index, cursor, limit, caller.request_id
        )
    else:
        listed = await services.retrieval.list_documents(index, cursor, limit, caller.request_id)
    services.metrics.index_version(index, listed.version)
    return listed
