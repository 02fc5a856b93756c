"""The documents of a built index, read from its passages, as a live index would list them.

A built index (``openbook index build``) keeps passages, not documents; it becomes live on its
first document write, which adopts each passage as part of the document its id names (the id
without its ``#<n>`` suffixes, ``<doc>#<n>#<m>`` as well as ``<doc>#<n>``, or a one-passage
id: :func:`~openbook.index.documents.built_document_id`). Until then GetDocument and
ListDocuments answer from the passages, grouped the same way, so a client reads the same
documents before and after the adoption (text: the passages joined by a space in row order,
title: the first passage's, no metadata, version 0). Nothing is copied or adopted for a read:
a read never turns a large built index into a live one.

Invariant: ids are listed in id order, each document once (never one of its passage ids), each
one that GetDocument finds; a page's ``next_cursor`` is its last id.
"""

from __future__ import annotations

from openbook.errors import InvalidArgument
from openbook.index.document_store import StoredDocument
from openbook.index.documents import (
    PASSAGE_ID_SEPARATOR,
    Document,
    built_document_id,
    check_document_ref,
)
from openbook.index.live import MAX_LIST_LIMIT, DocumentNotFound, DocumentPage
from openbook.index.loaded import LoadedIndex
from openbook.validation.limits import check_range

# Passage ids read per step while paging: a document has a handful of passages.
_SCAN = 1000


def built_document(index: LoadedIndex, doc_id: str) -> StoredDocument:
    """The document ``doc_id`` of the built ``index``; :class:`DocumentNotFound` if no passage
    belongs to it."""
    check_document_ref("id", doc_id)
    found = index.passage_store.with_id_prefix(doc_id + PASSAGE_ID_SEPARATOR, doc_id)
    passages = [p for p in found if built_document_id(p.id) == doc_id]
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
    # A document's passages are its id or ids starting "<doc>#", all at or above its id, so
    # the documents above the cursor are found by scanning the passage ids above it, in id
    # order. Once a scan has read every passage id up to ``after``, the documents not seen yet
    # sort above ``after`` or are below _unseen_floor: the seen ones below both are final.
    while True:
        batch = store.ids_after(after, _SCAN)
        for pid in batch:
            doc = built_document_id(pid)
            if cursor is None or doc > cursor:
                ids.add(doc)
        if len(batch) < _SCAN:  # every passage above the cursor was read
            final = sorted(ids)
            break
        after = batch[-1]
        floor = _unseen_floor(index, after)
        final = sorted(d for d in ids if floor is None or d < floor)
        if len(final) > limit:
            break
    more = len(final) > limit
    page = final[:limit]
    return DocumentPage(tuple(page), page[-1] if more and page else None)


def _unseen_floor(index: LoadedIndex, last: str) -> str | None:
    """The smallest id below passage id ``last`` that a document none of whose passages is at
    or below ``last`` may have; None if there is none (every such document sorts above
    ``last``, every document seen sorts at or below it). Such a document ``P`` has only
    ``P#...`` passages while ``last`` is ``P`` followed by a character below ``#``: documents
    ``A`` and ``A B`` sort ``A`` < ``A B``, their passages ``A B#0`` < ``A#0``."""
    store = index.passage_store
    for end in range(1, len(last)):
        if last[end] < PASSAGE_ID_SEPARATOR:
            head = last[:end] + PASSAGE_ID_SEPARATOR
            found = store.ids_after(head, 1)
            if found and found[0].startswith(head):
                return last[:end]  # the shortest such prefix: the smallest
    return None
