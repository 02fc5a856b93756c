"""The documents API: create and delete indexes, and write, read and list the documents of a
live index (issue 32; docs/api.md, "Documents").

Invariants:

* Every write is behind a scope (``openbook_gateway.access.RULES``): putting and deleting
  documents ``write``, creating and deleting indexes ``admin``; reads need ``ask`` where keys
  are required, else are open, as ``GET /indexes`` is. A key held to indexes gets a 404 for
  any other (the door checks the path's ``index``).
* A body or path is checked here first, with ``openbook.validation.limits``' rules
  (``schemas``): bad input is a 422 naming the field and never reaches the retriever. What only the
  retriever can know maps from its gRPC code: NOT_FOUND -> 404, ALREADY_EXISTS and
  FAILED_PRECONDITION (the active index) -> 409, INVALID_ARGUMENT -> 422, UNAVAILABLE -> 503.
* Every write is audited (``openbook_gateway.audit``: the middleware logs the request, the
  batch routes note their document ids).
* The handlers only check the path and turn the body into typed requests: what is done with
  them (a tenant's stamps and visibility, the versions the answer cache remembers) is the
  service layer's (``openbook_gateway.operations.documents`` and ``.indexes``), which the MCP
  tools call too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Path, Query, Request
from fastapi.exceptions import RequestValidationError

from openbook.errors import InvalidArgument
from openbook.validation.limits import (
    INDEX_NAME_PATTERN,
    MAX_DOCUMENT_ID_CHARS,
    check_document_id,
    check_document_ref,
)
from openbook_gateway import audit
from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.mapping import document_response, put_document_response
from openbook_gateway.operations import documents as operations
from openbook_gateway.operations import indexes as index_operations
from openbook_gateway.operations.caller import caller_of
from openbook_gateway.operations.documents import NewDocument
from openbook_gateway.schemas import (
    CreateIndexRequest,
    DeleteDocumentResponse,
    DeleteIndexResponse,
    DocumentBody,
    DocumentListResponse,
    DocumentResponse,
    IndexOut,
    PutDocumentResponse,
    PutDocumentsRequest,
    PutDocumentsResponse,
)
from openbook_gateway.services import ServicesDep

# Ids per page of GET /indexes/{index}/documents.
DEFAULT_PAGE = 100
MAX_PAGE = 1000


def _checked_id(
    where: str,
    name: str,
    value: str,
    request: Request | None = None,
    check: Callable[[str, object], str] = check_document_id,
) -> str:
    """``value`` if it is a document id (``check``: a new one's rule, or
    :func:`check_document_ref` for one that may exist), else the 422 a body's bad field gets,
    naming ``name`` (a path or query parameter is checked here: FastAPI's own constraints
    cannot say why). With ``request``, the id came from its path: bytes there that are not
    UTF-8 are refused rather than read as U+FFFD, which would make ``%FF%FE`` and ``%FE%FF``
    one id."""
    try:
        if request is not None:
            _utf8_path(name, request)
        return check(name, value)
    except InvalidArgument as exc:
        raise RequestValidationError(
            [{"type": "value_error", "loc": (where, name), "msg": str(exc), "input": value[:64]}]
        ) from None


def _utf8_path(name: str, request: Request) -> None:
    """Raise naming ``name`` unless the request's path, percent-decoded, is UTF-8 (the server
    decodes it with replacement, so the path parameters cannot tell)."""
    raw = request.scope.get("raw_path") or request.scope.get("path", "").encode("utf-8")
    decoded = unquote_to_bytes(raw)
    try:
        decoded.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"{name} must be UTF-8 (percent-encoded): byte 0x{decoded[exc.start]:02x} at "
            f"offset {exc.start} of the decoded path is not"
        ) from None


IndexName = Annotated[str, Path(pattern=INDEX_NAME_PATTERN, description="the index's name")]
DocumentId = Annotated[
    str,
    Path(
        max_length=MAX_DOCUMENT_ID_CHARS,
        description="the document's id, UTF-8: not empty, no '/', no control, format, bidi or "
        "invisible characters, no separator but the space, none at its ends (one with a '/' "
        "reaches the route, to be refused naming doc_id, not a 404)",
    ),
]

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/indexes", status_code=201, response_model=IndexOut)
async def create_index(body: CreateIndexRequest, request: Request, services: ServicesDep) -> dict:
    """An empty index: the default encoder and type, or those of the index named by ``like``.
    A key held to indexes (with ``indexes:create``) creates only those."""
    audit.note(request, name=body.name)
    return await index_operations.create_index(services, caller_of(request), body)


@router.delete("/indexes/{name}", response_model=DeleteIndexResponse)
async def delete_index(name: IndexName, request: Request, services: ServicesDep) -> dict:
    """Delete an index and its files; refused (409) for the active index."""
    return await index_operations.delete_index(services, caller_of(request), name)


@router.put(
    "/indexes/{index}/documents/{doc_id:path}",
    response_model=PutDocumentResponse,
)
async def put_document(
    index: IndexName,
    doc_id: DocumentId,
    body: DocumentBody,
    request: Request,
    services: ServicesDep,
) -> dict:
    """Insert or replace one document: split into passages, embedded, searchable once this
    answers."""
    doc_id = _checked_id("path", "doc_id", doc_id, request)
    document = NewDocument(doc_id, body.title, body.text, body.metadata)
    reply = await operations.write(services, caller_of(request), index, [document])
    return put_document_response(index, doc_id, reply)


@router.post(
    "/indexes/{index}/documents:batch",
    response_model=PutDocumentsResponse,
)
async def put_documents(
    index: IndexName, body: PutDocumentsRequest, request: Request, services: ServicesDep
) -> dict:
    """Insert or replace many documents under one version, all or nothing (per shard)."""
    audit.note(request, ids=[document.id for document in body.documents])
    documents = [
        NewDocument(
            d.id, d.title, d.text, d.metadata, f"documents[{at}].metadata", f"documents[{at}].id"
        )
        for at, d in enumerate(body.documents)
    ]
    reply = await operations.write(services, caller_of(request), index, documents)
    return {"index": index, "version": reply.version, "passages": list(reply.passages)}


@router.delete(
    "/indexes/{index}/documents/{doc_id:path}",
    response_model=DeleteDocumentResponse,
)
async def delete_document(
    index: IndexName, doc_id: DocumentId, request: Request, services: ServicesDep
) -> dict:
    """Delete a document (404 when absent): its passages are never served once this answers."""
    doc_id = _checked_id("path", "doc_id", doc_id, request, check_document_ref)
    reply = await operations.delete(services, caller_of(request), index, doc_id)
    return {"version": reply.version}


@router.get("/indexes/{index}/documents/{doc_id:path}", response_model=DocumentResponse)
async def get_document(
    index: IndexName, doc_id: DocumentId, request: Request, services: ServicesDep
) -> dict:
    """A document, its metadata and its passage ids (404 when absent)."""
    doc_id = _checked_id("path", "doc_id", doc_id, request, check_document_ref)
    document = await operations.get(services, caller_of(request), index, doc_id)
    return document_response(index, document)


@router.get("/indexes/{index}/documents", response_model=DocumentListResponse)
async def list_documents(
    index: IndexName,
    request: Request,
    services: ServicesDep,
    cursor: Annotated[
        str,
        Query(
            max_length=MAX_DOCUMENT_ID_CHARS,
            description="the next_cursor of the previous page; empty: from the first id",
        ),
    ] = "",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
) -> dict:
    """A page of document ids, in id order, after ``cursor``."""
    if cursor:
        _checked_id("query", "cursor", cursor, check=check_document_ref)
    listed = await operations.list_page(services, caller_of(request), index, cursor, limit)
    return {
        "index": index,
        "ids": list(listed.ids),
        "next_cursor": listed.next_cursor or None,
        "version": listed.version,
    }
