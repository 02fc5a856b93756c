"""The documents of a live index: write, read, list and delete them (the REST documents and
upload routes, MCP ``put_document`` and ``delete_document``).

Invariants:

* What comes in is checked already (the transport's request models and ``openbook.limits``'
  rules); what only the retriever can know maps from its gRPC code (the clients: NOT_FOUND ->
  404, ALREADY_EXISTS and FAILED_PRECONDITION -> 409, INVALID_ARGUMENT -> 422).
* A caller with a tenant filter (``openbook_gateway.tenancy``) writes its fields into what it
  writes, never over a document it cannot see, and reads and lists only what its filter keeps
  (404 for the rest, as for a document that does not exist).
* Each acknowledged write's version is remembered by the answer cache and the metrics
  (:func:`acknowledged`): this gateway never serves a cached answer computed on fewer writes
  than it has acknowledged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def acknowledged(services: Services, index: str, version: int) -> None:
    """Remember that ``index`` is at ``version`` once a write there is acknowledged."""
    services.cache.wrote(index, version)
    services.metrics.index_version(index, version)


async def write(
    services: Services, caller: Caller, index: str, documents: Sequence[NewDocument]
) -> retriever_pb2.WriteResponse:
    """Insert or replace ``documents`` under one version, all or nothing (per shard):
    split into passages, embedded, searchable once this returns."""
    principal = caller.principal
    if principal.tenant is not None:
        # the tenant's fields stamped in, and never over another tenant's document
        documents = [
            NewDocument(
                d.id,
                d.title,
                d.text,
                tenancy.stamped(principal, d.id, d.title, d.metadata, d.metadata_field),
                d.metadata_field,
            )
            for d in documents
        ]
        await tenancy.check_overwrites(
            principal, services.retrieval, index, [d.id for d in documents], caller.request_id
        )
    protos = [
        retriever_pb2.Document(
            id=d.id,
            title=d.title,
            text=d.text,
            metadata_json=json.dumps(d.metadata or {}, allow_nan=False, ensure_ascii=False),
        )
        for d in documents
    ]
    reply = await services.retrieval.put_documents(index, protos, caller.request_id)
    acknowledged(services, index, reply.version)
    return reply


async def delete(
    services: Services, caller: Caller, index: str, doc_id: str
) -> retriever_pb2.WriteResponse:
    """Delete a document (404 when absent, or when the caller's tenant cannot see it): its
    passages are never served once this returns."""
    if caller.principal.tenant is not None:
        # another tenant's document is one this key does not have
        await get(services, caller, index, doc_id)
    reply = await services.retrieval.delete_document(index, doc_id, caller.request_id)
    acknowledged(services, index, reply.version)
    return reply


async def get(
    services: Services, caller: Caller, index: str, doc_id: str
) -> retriever_pb2.Document:
    """Document ``doc_id``, a 404 when there is none or the caller's tenant cannot see it (the
    same words: whether another tenant has it does not show)."""
    document = await services.retrieval.get_document(index, doc_id, caller.request_id)
    if not tenancy.visible(caller.principal, document):
        raise HTTPException(404, f"document {doc_id!r} not found in index {index!r}")
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
