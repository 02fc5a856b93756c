"""The documents of a built index, read from its passages, as a live index would list them.

A built index (``openbook index build``) keeps passages, not documents; it becomes live on its
first document write, which adopts each passage as part of the document its id names
(``<doc>#<n>``, or a one-passage id: :func:`~openbook.index.documents.document_id_of`). Until
then GetDocument and ListDocuments answer from the passages, grouped the same way, so a client
reads the same documents before and after the adoption (text: the passages joined by a space,
title: the first passage's, no metadata, version 0). Nothing is copied or adopted for a read:
a read never turns a large built index into a live one.

Invariant: ids are listed in id order, each once; a page's ``next_cursor`` is its last id.
"""

from __future__ import annotations

from openbook.errors import InvalidArgument
from openbook.index.document_store import StoredDocument
from openbook.index.documents import (
    PASSAGE_ID_SEPARATOR,
    Document,
    check_document_id,
    document_id_of,
)
from openbook.index.live import MAX_LIST_LIMIT, DocumentNotFound, DocumentPage
from openbook.index.loaded import LoadedIndex
from openbook.limits import check_range

# Passage ids read per step while paging: a document has a handful of passages.
_SCAN = 1000


def built_document(index: LoadedIndex, doc_id: str) -> StoredDocument:
    """The document ``doc_id`` of the built ``index``; :class:`DocumentNotFound` if no passage
    belongs to it."""
    check_document_id("id", doc_id)
    found = index.passage_store.with_id_prefix(doc_id + PASSAGE_ID_SEPARATOR, doc_id)
    passages = [p for p in found if document_id_of(p.id) == doc_id]
    if not passages:
        raise DocumentNotFound(f"document {doc_id!r} not found in index {index.name!r}")
    document = Document(doc_id, passages[0].title, " ".join(p.text for p in passages), {})
    return StoredDocument(document, tuple(p.id for p in passages), 0)


def built_document_page(index: LoadedIndex, cursor: str | None, limit: int) -> DocumentPage:
    """A page of the built ``index``'s document ids after ``cursor``, in id order."""
    check_range("limit", limit, 1, MAX_LIST_LIMIT)
    if cursor is not None and not isinstance(cursor, str):
        raise InvalidArgument("cursor must be a string")
    store = index.passage_store
    ids: set[str] = set()
    after = cursor or ""
    # A document's passage ids sort right after its id ("<doc>#<n>"), so scanning passage ids
    # above the cursor finds the next documents; a page is complete once the scan has moved
    # past limit + 1 distinct ids and every passage of the last of them.
    while True:
        batch = store.ids_after(after, _SCAN)
        for pid in batch:
            doc = document_id_of(pid)
            if cursor is None or doc > cursor:
                ids.add(doc)
        if len(batch) < _SCAN or len(ids) > limit + 1:
            break
        after = batch[-1]
    ordered = sorted(ids)
    more = len(ordered) > limit
    page = ordered[:limit]
    return DocumentPage(tuple(page), page[-1] if more and page else None)
