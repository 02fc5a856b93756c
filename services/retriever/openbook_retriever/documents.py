"""The documents RPCs' requests, checked once at the top of each RPC, and their replies.

Each ``validate_*`` turns a proto request into a typed one that everything behind it trusts,
or raises :class:`~openbook.errors.InvalidArgument` naming the first bad field as the
gateway reports it (``documents[3].metadata``, ``id``, ``index``, ``name``, ``type``,
``limit``). Writes and document reads name their index: there is no default for them, so a
write never lands in whichever index happens to be active.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from openbook.errors import InvalidArgument
from openbook.index import INDEX_TYPES
from openbook.index.document_store import StoredDocument
from openbook.index.documents import Document
from openbook.index.live import MAX_LIST_LIMIT
from openbook.v1 import retriever_pb2
from openbook.validation.limits import (
    MAX_BATCH_DOCUMENTS,
    check_document_ref,
    check_index_name,
    check_range,
)

DEFAULT_LIST_LIMIT = 100


@dataclass(frozen=True)
class NewIndexDefaults:
    """What CreateIndex makes when the request names no index to be ``like``."""

    encoder: str  # the document (and query) encoder
    index_type: str


@dataclass(frozen=True)
class ValidCreateIndex:
    name: str
    index_type: str | None  # None: like's type, else the default's
    like: str | None  # None: the default encoder (NewIndexDefaults)


@dataclass(frozen=True)
class ValidPutDocuments:
    index: str
    documents: tuple[Document, ...]


@dataclass(frozen=True)
class DocumentRef:
    """One document of one index (GetDocument, DeleteDocument)."""

    index: str
    id: str


@dataclass(frozen=True)
class ValidListDocuments:
    index: str
    cursor: str | None  # None: from the first id
    limit: int


def validate_create_index(request: retriever_pb2.CreateIndexRequest) -> ValidCreateIndex:
    name = check_index_name("name", request.name)
    index_type = request.type or None
    if index_type is not None and index_type not in INDEX_TYPES:
        raise InvalidArgument(f"type must be one of {', '.join(INDEX_TYPES)}, got {index_type!r}")
    like = check_index_name("like", request.like) if request.like else None
    return ValidCreateIndex(name, index_type, like)


def validate_put_documents(request: retriever_pb2.PutDocumentsRequest) -> ValidPutDocuments:
    index = check_index_name("index", request.index)
    if not request.documents:
        raise InvalidArgument("documents: at least one document is required")
    if len(request.documents) > MAX_BATCH_DOCUMENTS:
        raise InvalidArgument(
            f"documents: at most {MAX_BATCH_DOCUMENTS} per request, got {len(request.documents)}"
        )
    documents = tuple(
        document_from_proto(d, f"documents[{i}]") for i, d in enumerate(request.documents)
    )
    seen: set[str] = set()
    for i, doc in enumerate(documents):
        if doc.id in seen:
            raise InvalidArgument(f"documents[{i}].id: {doc.id!r} appears twice in the batch")
        seen.add(doc.id)
    return ValidPutDocuments(index, documents)


def validate_document_ref(
    request: retriever_pb2.GetDocumentRequest | retriever_pb2.DeleteDocumentRequest,
) -> DocumentRef:
    return DocumentRef(
        check_index_name("index", request.index), check_document_ref("id", request.id)
    )


def validate_list_documents(request: retriever_pb2.ListDocumentsRequest) -> ValidListDocuments:
    index = check_index_name("index", request.index)
    limit = check_range("limit", request.limit or DEFAULT_LIST_LIMIT, 1, MAX_LIST_LIMIT)
    cursor = check_document_ref("cursor", request.cursor) if request.cursor else None
    return ValidListDocuments(index, cursor, limit)


def document_from_proto(message: retriever_pb2.Document, field: str) -> Document:
    """A validated document; ``field`` prefixes the name of a bad field."""
    if message.passage_ids:
        raise InvalidArgument(f"{field}.passage_ids: filled in replies only, leave it empty")
    metadata: object = {}
    if message.metadata_json:
        try:
            metadata = json.loads(message.metadata_json)
        except ValueError as exc:
            raise InvalidArgument(f"{field}.metadata: not valid JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise InvalidArgument(
            f"{field}.metadata must be a JSON object, got {type(metadata).__name__}"
        )
    return Document.create(message.id, message.title, message.text, metadata, field=field)


def document_to_proto(stored: StoredDocument) -> retriever_pb2.Document:
    doc = stored.document
    return retriever_pb2.Document(
        id=doc.id,
        title=doc.title,
        text=doc.text,
        metadata_json=json.dumps(dict(doc.metadata), ensure_ascii=False),
        passage_ids=list(stored.passage_ids),
    )
