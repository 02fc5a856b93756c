"""The index engine interface: what the retriever searches and writes, whatever holds the index.

Read side. An *engine* is where an index's passages, vectors and documents live: ``files`` (the
built FAISS + BM25 directories, :class:`~openbook.index.loaded.LoadedIndex`, and the live layer
over them, :class:`~openbook.index.live.LiveIndex`; ``openbook/index/files_engine.py``) or
``milvus`` (one Milvus collection per index, ``openbook/index/milvus_engine.py``). Two
protocols say what each must offer:

* :class:`SearchableIndex`: its manifest facts (name, encoder pairing through
  ``query_encoder`` / ``check_encoder``, ``score_scale`` and ``views`` in ``manifest``,
  ``default_retrieval``) and search (one :class:`~openbook.index.request.SearchRequest`: a
  :class:`RetrievalMode`, a metadata filter, k, texts and/or query vectors), with the
  scores the generator's prior takes as logits (``score_scale`` x inner product for dense,
  as ``openbook/index/README.md`` says).
* :class:`DocumentIndex`: a searchable index that also takes documents: put / put_many (one
  write, one version, all or nothing) / delete / get / list, and the ``version`` that grows by
  one per acknowledged write; ``catch_up`` brings a replica's view up to the other replicas'
  writes before a request.

The retrieval modes and index types are enums here (:class:`RetrievalMode`,
:class:`IndexType`, :class:`EngineKind`): ``StrEnum``, so each member *is* its string (a
manifest's ``index_type``, a request's ``retrieval``) and the modules that still compare
strings keep working while they move to the members. :func:`check_retrieval` is the one rule
for which mode a request gets on an index of given views.

:func:`pages_of` is how every engine answers ``DocumentIndex.passage_pages`` from its
documents' metadata.

Invariants: this module imports no engine (no faiss, no pymilvus: besides ``documents``'s
passage numbering, its imports are for type checking only); each engine's conformance is
asserted where it is registered (``files_engine.py``, ``milvus_engine.py``) and checked by
mypy, and the enums' values are the strings ``openbook.validation.limits.RETRIEVAL_MODES`` and
``spec.INDEX_TYPES`` list (``tests/index/test_engine.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, cast

from openbook.errors import InvalidArgument
from openbook.index.documents import passage_number, passage_page
from openbook.types import document_id_of

if TYPE_CHECKING:
    from openbook.index.document_store import StoredDocument
    from openbook.index.documents import Document
    from openbook.index.encoders import Encoder
    from openbook.index.live import DocumentPage, WriteResult
    from openbook.index.manifest import Manifest
    from openbook.index.request import SearchRequest
    from openbook.types import Passage


class View(StrEnum):
    """A retrieval view an index holds (a manifest's ``views``)."""

    DENSE = "dense"
    BM25 = "bm25"


class RetrievalMode(StrEnum):
    """How passages are retrieved (``openbook.validation.limits.RetrievalMode`` spells the same
    strings for the wire): one view, or both fused (``openbook.index.fusion``)."""

    DENSE = "dense"
    BM25 = "bm25"
    HYBRID = "hybrid"

    @property
    def views(self) -> tuple[View, ...]:
        """The views this mode reads."""
        if self is RetrievalMode.HYBRID:
            return (View.DENSE, View.BM25)
        return (View(self.value),)


class IndexType(StrEnum):
    """What an index's dense view is (``openbook.index.spec.INDEX_TYPES``), or ``bm25`` for an
    index with only a BM25 view."""

    FLAT = "flat"
    HNSW = "hnsw"
    HNSW_SQ8 = "hnsw-sq8"
    IVFPQ = "ivfpq"
    BM25 = "bm25"

    @property
    def dense(self) -> bool:
        return self is not IndexType.BM25


class EngineKind(StrEnum):
    """Where indexes live (``OPENBOOK_INDEX_ENGINE``)."""

    FILES = "files"
    MILVUS = "milvus"


def check_retrieval(
    index: str, views: Sequence[str], default: str, retrieval: str | None
) -> RetrievalMode:
    """The mode a request asking for ``retrieval`` gets on index ``index`` of ``views`` (None
    or "": ``default``, the manifest's ``default_retrieval``). InvalidArgument starting
    "retrieval: " naming the index and its views (the retriever's INVALID_ARGUMENT) for an
    unknown mode or one whose views the index lacks."""
    if not retrieval:
        return RetrievalMode(default)
    try:
        mode = RetrievalMode(retrieval)
    except ValueError:
        raise InvalidArgument(
            f"retrieval: unknown mode {retrieval!r} for index {index!r}; expected one "
            f"of {', '.join(RetrievalMode)}"
        ) from None
    if not set(mode.views) <= set(views):
        raise InvalidArgument(
            f"retrieval: index {index!r} has no {mode} retrieval (its views: {', '.join(views)})"
        )
    return mode


def check_milvus_uri(uri: str) -> str:
    """``uri`` as ``OPENBOOK_MILVUS_URI`` takes it: ``http(s)://``, ``tcp://`` or ``unix:``
    to a server, or a local path ending in ``.db`` (Milvus Lite); InvalidArgument otherwise."""
    if re.match(r"^(https?|tcp)://[^/\s]+", uri) or uri.startswith("unix:"):
        return uri
    if uri.endswith(".db") and len(uri) > 3:
        return uri
    raise InvalidArgument(
        "OPENBOOK_MILVUS_URI: expected http(s)://host:port of a Milvus server or a local "
        f"path ending in .db (Milvus Lite), got {uri!r}"
    )


class SearchableIndex(Protocol):
    """An index the retriever searches (module docstring). Thread-safe for searches."""

    @property
    def name(self) -> str:
        """The name clients use (the retriever's directory or collection name)."""
        ...

    @property
    def manifest(self) -> Manifest:
        """What the index is: type, encoders, dim, ``score_scale``, ``views``, ``fusion``."""
        ...

    @property
    def views(self) -> tuple[str, ...]: ...

    @property
    def default_retrieval(self) -> str:
        """``Manifest.default_retrieval``: the mode a request naming none gets."""
        ...

    @property
    def dense(self) -> bool: ...

    @property
    def query_encoder(self) -> Encoder:
        """The manifest's query encoder (ValueError on an index without a dense view)."""
        ...

    def check_encoder(self, encoder: Encoder) -> None:
        """ValueError unless ``encoder`` can search this index (``pairing.py``)."""
        ...

    def __len__(self) -> int: ...

    def search(self, request: SearchRequest, encoder: Encoder | None = None) -> list[list[Passage]]:
        """Top ``request.k`` passages per query, best first, each passing ``request.where``,
        in the mode ``request.mode_on(self, encoder)`` checks and resolves (texts encoded by
        ``encoder``, default the index's own query encoder, unless the request holds the
        vectors ``(n, dim)``)."""
        ...

    def close(self) -> None: ...


class DocumentIndex(SearchableIndex, Protocol):
    """A searchable index that takes document writes (module docstring)."""

    @property
    def version(self) -> int:
        """The last acknowledged write's version (0: none since the index was made)."""
        ...

    def catch_up(self) -> bool:
        """Bring this process's view up to every write acknowledged anywhere; whether it
        changed."""
        ...

    def get(self, doc_id: str) -> StoredDocument:
        """The document ``doc_id``; ``live.DocumentNotFound`` if there is none."""
        ...

    def list(self, cursor: str | None = None, limit: int = 100) -> DocumentPage:
        """A page of document ids in id order, after ``cursor``."""
        ...

    def passage_pages(self, passage_ids: Iterable[str]) -> dict[str, int]:
        """The page of each passage of a paged document (an uploaded PDF); others absent."""
        ...

    def put(self, document: Document) -> WriteResult: ...

    def put_many(self, documents: Sequence[Document], *, field: str = "documents") -> WriteResult:
        """Insert or replace ``documents`` as one write: one version, all or nothing."""
        ...

    def delete(self, doc_id: str) -> WriteResult:
        """Delete ``doc_id``; ``live.DocumentNotFound`` if there is none."""
        ...


def pages_of(
    passage_ids: Iterable[str],
    max_words: int,
    metadata_of: Callable[[list[str]], Mapping[str, Mapping[str, Any]]],
) -> dict[str, int]:
    """:meth:`DocumentIndex.passage_pages` as every engine answers it: the page of each of
    ``passage_ids`` that is a passage ``<doc>#<n>`` of a live paged document (an uploaded
    PDF), from its document's metadata (split at ``max_words``, as the document was); the
    others absent. ``metadata_of(doc_ids)``: the metadata of those of ``doc_ids`` (sorted,
    never none) that are live, read by the engine."""
    numbered = {pid: (document_id_of(pid), passage_number(pid)) for pid in passage_ids}
    docs = sorted({doc for doc, _ in numbered.values()})
    if not docs:
        return {}
    metadata = metadata_of(docs)
    pages: dict[str, int] = {}
    for pid, (doc, n) in numbered.items():
        meta = metadata.get(doc)
        page = None if meta is None or n is None else passage_page(meta, n, max_words)
        if page is not None:
            pages[pid] = page
    return pages


# What a class must offer, beyond a SearchableIndex, to take documents (DocumentIndex).
_DOCUMENT_MEMBERS = (
    "version",
    "catch_up",
    "get",
    "list",
    "passage_pages",
    "put",
    "put_many",
    "delete",
)


def as_document_index(index: SearchableIndex) -> DocumentIndex | None:
    """``index`` as a :class:`DocumentIndex` when its class offers the documents API (a files
    live index, a Milvus index), else None (a built files index: read-only until adopted).
    Looks at the class only: a runtime-checkable Protocol's ``isinstance`` would evaluate
    every property (a query encoder loaded, a count read) on Python 3.11."""
    cls = type(index)
    if all(hasattr(cls, member) for member in _DOCUMENT_MEMBERS):
        return cast("DocumentIndex", index)
    return None


__all__ = [
    "DocumentIndex",
    "EngineKind",
    "IndexType",
    "RetrievalMode",
    "SearchableIndex",
    "View",
    "as_document_index",
    "check_milvus_uri",
    "check_retrieval",
    "pages_of",
]
