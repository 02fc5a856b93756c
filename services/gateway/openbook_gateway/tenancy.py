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
* **Its ids are its own** (:func:`stored_id`): the ids it names live in its tenant's
  namespace inside the index, the id stored being ``~<tag>~<id>``, ``<tag>`` the first 16 hex
  digits of the SHA-256 of the filter's canonical form (:func:`namespace`). Two tenants both
  writing ``report`` write two documents; neither can name, overwrite, read or delete the
  other's, and an id another tenant holds behaves exactly as a free one (nothing tells that
  it is taken). Keys with the same filter are one tenant: one namespace. The tenant never
  sees the qualification: replies, listings and citations show its ids as it wrote them
  (:func:`public_id`, :func:`shown`); a key without a tenant (the admin) sees the stored ids.
  No key writes a new id that begins with ``~`` (:func:`refuse_reserved`): only this module
  makes them, so an id of one namespace is never another's, nor an unqualified one.
* A document it cannot see (outside its namespace, or its metadata, ``_id`` and ``_title``
  not kept by the filter) is a 404 to it, as one that does not exist.
* A listing shows only the ids of its namespace that it can see (:func:`visible_page`): the
  namespace is one run of the index's id order, read from its start to its end, each id
  checked against the filter; pages may be shorter than ``limit`` but stay in id order, and
  ``next_cursor`` (an id as the tenant wrote it) goes on from the last id looked at.
* A document of the index its filter keeps but that lies outside its namespace (written by
  the admin, or by a key with another filter that the tenant's keeps) is retrieved and cited
  by its stored id.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import HTTPException

from openbook.v1 import retriever_pb2
from openbook.validation.limits import MAX_DOCUMENT_ID_CHARS
from openbook.validation.metadata_filter import (
    BUILTIN_FIELDS,
    AllOf,
    Condition,
    MetadataFilter,
    Node,
    record_of,
    value_key,
)
from openbook_gateway.principal import NAMESPACE_MARK, Principal, namespace
from openbook_gateway.retrieval import Retrieval

# Documents looked up at once when a listing or a batch is checked.
CONCURRENT_LOOKUPS = 32
# Ids one listing looks at, at most, to fill a page: a tenant with few documents in a large
# index gets short pages (``next_cursor`` goes on), not a request that reads the whole index.
MAX_IDS_SCANNED = 5000


def refuse_reserved(doc_id: str, field: str = "doc_id") -> None:
    """A 422 naming ``field`` for a new id that begins with ``~``: such ids are the
    namespaces of tenants (module docstring), made by the gateway only."""
    if doc_id.startswith(NAMESPACE_MARK):
        raise HTTPException(
            422,
            f"{field}: ids beginning with {NAMESPACE_MARK!r} are reserved "
            "(the namespaces of tenants' documents)",
        )


def stored_id(principal: Principal, doc_id: str, field: str = "doc_id") -> str:
    """The id the index holds for ``doc_id`` as ``principal`` names it: in its tenant's
    namespace; no tenant: ``doc_id`` itself. A 422 naming ``field`` when the namespace would
    make it longer than the index allows."""
    if principal.tenant is None:
        return doc_id
    prefix = namespace(principal.tenant)
    room = MAX_DOCUMENT_ID_CHARS - len(prefix)
    if len(doc_id) > room:
        raise HTTPException(
            422,
            f"{field} must be at most {room} characters for key {principal.name!r}, "
            f"got {len(doc_id)}",
        )
    return prefix + doc_id


def public_id(principal: Principal, stored: str) -> str:
    """``stored`` as ``principal`` sees it: without its tenant's namespace (the id it wrote);
    any other id (no tenant, or a document outside the namespace) as it is."""
    if principal.tenant is None:
        return stored
    prefix = namespace(principal.tenant)
    return stored[len(prefix) :] if stored.startswith(prefix) else stored


def shown(principal: Principal, reply: retriever_pb2.RetrieveResponse) -> None:
    """Show ``reply``'s passages to ``principal``: each passage id (``<document>#<n>``, the
    document it cites) without its tenant's namespace, in place."""
    if principal.tenant is None:
        return
    for result in reply.results:
        for passage in result.passages:
            passage.id = public_id(principal, passage.id)


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


async def visible_page(
    principal: Principal,
    retrieval: Retrieval,
    index: str,
    cursor: str,
    limit: int,
    request_id: str,
) -> retriever_pb2.ListDocumentsResponse:
    """A page of the ids ``principal``'s tenant can see, after ``cursor`` (both as the
    tenant names them), read from its namespace only (module docstring)."""
    assert principal.tenant is not None
    prefix = namespace(principal.tenant)
    # the namespace's start when there is no cursor
    cursor = stored_id(principal, cursor, "cursor") if cursor else prefix
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
        # the namespace is one run of the id order: past its end, nothing more is its
        mine = [doc_id for doc_id in page.ids if doc_id.startswith(prefix)]
        ended = len(mine) < len(page.ids) or not page.next_cursor
        kept = await asyncio.gather(*(keep(doc_id) for doc_id in mine))
        for doc_id, visible_to_it in zip(mine, kept, strict=True):
            scanned += 1
            cursor = doc_id
            if visible_to_it:
                ids.append(doc_id[len(prefix) :])
            if len(ids) == limit:
                break
        more = not ended or (len(ids) == limit and bool(mine) and cursor != mine[-1])
        if len(ids) == limit or ended or scanned >= MAX_IDS_SCANNED:
            next_cursor = cursor[len(prefix) :] if more and cursor != prefix else ""
            return retriever_pb2.ListDocumentsResponse(
                ids=ids, next_cursor=next_cursor, version=version
            )
