"""Tenants (issue 43): what a key with a ``filter`` may write and read among an index's
documents, beside the retrievals it makes (:meth:`Principal.where`, which ANDs the filter into
every one).

Invariants, for a key with a tenant filter (a key without one is untouched by all of this):

* A document it writes (``PUT``, a batch, an upload, MCP ``put_document``) gets the filter's
  equality fields in its metadata (:func:`stamped`: ``{"tenant": "a"}`` writes ``tenant: "a"``;
  ``$in`` and ``$or`` name no single value, so they stamp nothing). Metadata that contradicts
  one is a 403, and so is a document that, stamped, the filter would still not keep (a key
  held to ``{"tenant": {"$in": ["a", "b"]}}`` must say which): a tenant never writes what it
  could not read back.
* A document it cannot see (its metadata, ``_id`` and ``_title`` not kept by the filter) is a
  404 to it, as one that does not exist, when it reads it (``GET``); overwriting or deleting
  it is refused (403 and 404), checked before the write. Document ids are one namespace per
  index: a tenant learns that an id it cannot see is taken (docs/security.md).
* A listing shows only the ids it can see (:func:`visible_page`): each id of the retriever's
  pages is checked, its pages then shorter than ``limit`` but still in id order, and
  ``next_cursor`` goes on from the last id looked at.

The check before an overwrite and the write are two calls: a write of the same id by another
tenant between them is not seen. Give tenants their own id prefixes, or indexes, where that
matters.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import HTTPException

from openbook.metadata_filter import (
    BUILTIN_FIELDS,
    AllOf,
    Condition,
    MetadataFilter,
    Node,
    record_of,
    value_key,
)
from openbook.v1 import retriever_pb2
from openbook_gateway.principal import Principal
from openbook_gateway.retrieval import Retrieval

# Documents looked up at once when a listing or a batch is checked.
CONCURRENT_LOOKUPS = 32
# Ids one listing looks at, at most, to fill a page: a tenant with few documents in a large
# index gets short pages (``next_cursor`` goes on), not a request that reads the whole index.
MAX_IDS_SCANNED = 5000


def equality_fields(tenant: MetadataFilter) -> dict[str, Any]:
    """The fields the filter holds to one value whatever else holds (a top-level condition
    with one value, or one under a top-level ``$and``), built-in fields left out."""
    fields: dict[str, Any] = {}

    def walk(node: Node) -> None:
        if isinstance(node, AllOf):
            for part in node.parts:
                walk(part)
        elif (
            isinstance(node, Condition) and len(node.values) == 1 and node.key not in BUILTIN_FIELDS
        ):
            ((_, value),) = node.values
            fields[node.key] = value

    walk(tenant.root)
    return fields


def stamped(
    principal: Principal,
    doc_id: str,
    title: str,
    metadata: dict[str, Any] | None,
    field: str = "metadata",
) -> dict[str, Any] | None:
    """``metadata`` as a document written by ``principal`` keeps it: with its tenant's
    equality fields; a 403 naming ``field`` when it contradicts one, or when the filter would
    not keep the document it makes (module docstring). No tenant: ``metadata`` unchanged."""
    tenant = principal.tenant
    if tenant is None:
        return metadata
    given = dict(metadata or {})
    for key, value in equality_fields(tenant).items():
        if key in given and value_key(given[key]) != value_key(value):
            raise HTTPException(
                403,
                f"{field}.{key}: key {principal.name!r} writes only documents with "
                f"{key} = {json.dumps(value)}, got {json.dumps(given[key])[:100]}",
            )
        given[key] = value
    if not tenant.matches(record_of(doc_id, title, given)):
        raise HTTPException(
            403,
            f"{field}: key {principal.name!r} may write only documents its filter keeps "
            f"({tenant.canonical()[:300]}); this one's metadata is not kept",
        )
    return given


def visible(principal: Principal, document: retriever_pb2.Document) -> bool:
    """Whether ``principal``'s tenant filter keeps ``document`` (no tenant: every one)."""
    if principal.tenant is None:
        return True
    metadata = json.loads(document.metadata_json) if document.metadata_json else {}
    if not isinstance(metadata, dict):
        metadata = {}
    return principal.tenant.matches(record_of(document.id, document.title, metadata))


async def existing(
    retrieval: Retrieval, index: str, doc_id: str, request_id: str
) -> retriever_pb2.Document | None:
    """Document ``doc_id`` of ``index``; None when there is none."""
    try:
        return await retrieval.get_document(index, doc_id, request_id)
    except HTTPException as exc:
        # the retriever's words for a document it does not have (an unknown index: "index: ")
        if exc.status_code == 404 and str(exc.detail).startswith("document "):
            return None
        raise


async def check_overwrites(
    principal: Principal, retrieval: Retrieval, index: str, doc_ids: list[str], request_id: str
) -> None:
    """A 403 when a write by ``principal`` would replace a document its tenant cannot see."""
    if principal.tenant is None:
        return
    limit = asyncio.Semaphore(CONCURRENT_LOOKUPS)

    async def one(doc_id: str) -> str | None:
        async with limit:
            document = await existing(retrieval, index, doc_id, request_id)
        if document is not None and not visible(principal, document):
            return doc_id
        return None

    taken = [d for d in await asyncio.gather(*(one(d) for d in doc_ids)) if d is not None]
    if taken:
        raise HTTPException(
            403,
            f"doc_id: {taken[0]!r} is the id of a document key {principal.name!r} cannot "
            "write (ids are shared by everyone writing to the index): choose another",
        )


async def visible_page(
    principal: Principal,
    retrieval: Retrieval,
    index: str,
    cursor: str,
    limit: int,
    request_id: str,
) -> retriever_pb2.ListDocumentsResponse:
    """A page of the ids ``principal`` can see, after ``cursor`` (module docstring)."""
    ids: list[str] = []
    scanned = 0
    version = 0
    gate = asyncio.Semaphore(CONCURRENT_LOOKUPS)

    async def keep(doc_id: str) -> bool:
        async with gate:
            document = await existing(retrieval, index, doc_id, request_id)
        return document is not None and visible(principal, document)

    while True:
        page = await retrieval.list_documents(index, cursor, limit, request_id)
        version = max(version, page.version)
        kept = await asyncio.gather(*(keep(doc_id) for doc_id in page.ids))
        for doc_id, shown in zip(page.ids, kept, strict=True):
            scanned += 1
            cursor = doc_id
            if shown:
                ids.append(doc_id)
            if len(ids) == limit:
                break
        more = bool(page.next_cursor) or (len(ids) == limit and cursor != page.ids[-1])
        if len(ids) == limit or not page.next_cursor or scanned >= MAX_IDS_SCANNED:
            return retriever_pb2.ListDocumentsResponse(
                ids=ids, next_cursor=cursor if more and page.ids else "", version=version
            )
