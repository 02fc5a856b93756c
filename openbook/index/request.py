"""SearchRequest: what one search of an index asks for, checked once where it is made.

Read side. Every engine's ``search`` takes one (``engine.SearchableIndex.search``): the
retriever's servicer builds it from the protobuf at its edge, a library caller in one line.
What can be checked without an index (``k``, the shape of the query vectors, the retrieval
mode's name) is checked when the request is made; what depends on the index (a mode its views
serve, the vectors' dimension, a bm25 index taking no vectors) by :meth:`SearchRequest.mode_on`,
the one rule every engine applies before it searches. Errors are :class:`InvalidArgument`
naming the field (the retriever's INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import numpy as np

from openbook.errors import InvalidArgument
from openbook.index.engine import RetrievalMode, check_retrieval

if TYPE_CHECKING:
    from openbook.index.encoders import Encoder
    from openbook.index.engine import SearchableIndex
    from openbook.validation.metadata_filter import MetadataFilter


@dataclass(frozen=True, eq=False)
class SearchRequest:
    """One search: top ``k`` passages per query, best first.

    * ``queries``: the query texts, n of them (what BM25 reads, and what the dense view
      encodes unless ``query_vectors`` are given).
    * ``query_vectors``: the queries already encoded, float32 ``(n, dim)`` (one vector
      ``(dim,)`` is one row; stored read-only): with ``queries`` their n rows in the same
      order (a server batching the query encoder across requests, then BM25 or hybrid
      reads the texts); alone, a dense search by vectors.
    * ``k`` >= 1: passages per query.
    * ``retrieval``: the mode (None: the index's ``default_retrieval``, or dense for a
      request of vectors alone); a mode's name is taken as its member.
    * ``where``: only passages whose metadata passes the filter (inside retrieval).
    * ``return_vectors``: each passage's stored vector ``(dim,)`` in ``Passage.vector``.
    """

    queries: Sequence[str] = ()
    _: KW_ONLY
    k: int
    query_vectors: np.ndarray | None = None
    retrieval: RetrievalMode | None = None
    where: MetadataFilter | None = None
    return_vectors: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.queries, str):
            raise InvalidArgument("queries: a list of strings, not a string")
        queries = tuple(self.queries)
        for i, text in enumerate(queries):
            if not isinstance(text, str):
                raise InvalidArgument(f"queries[{i}]: a string, got {type(text).__name__}")
        set_field = object.__setattr__  # frozen: the fields are set here, once
        set_field(self, "queries", queries)
        if isinstance(self.k, bool) or not isinstance(self.k, int | np.integer):
            raise InvalidArgument(f"k must be a whole number, got {self.k!r}")
        if self.k < 1:
            raise InvalidArgument(f"k must be >= 1, got {self.k}")
        set_field(self, "k", int(self.k))
        if self.query_vectors is not None:
            q = np.asarray(self.query_vectors, dtype=np.float32)
            if q.ndim == 1:
                q = q[None, :]
            if q.ndim != 2:
                raise InvalidArgument(
                    f"query_vectors: shape {q.shape}, expected (n, dim) (or one (dim,))"
                )
            if queries and len(q) != len(queries):
                raise InvalidArgument(
                    f"query_vectors: {len(q)} rows for {len(queries)} queries, expected one "
                    "row per query"
                )
            q = q.view()  # read-only here, not in the caller's array
            q.flags.writeable = False
            set_field(self, "query_vectors", q)
        if self.retrieval is not None and not isinstance(self.retrieval, RetrievalMode):
            mode = self.retrieval
            try:
                set_field(self, "retrieval", RetrievalMode(mode) if mode else None)
            except ValueError:
                raise InvalidArgument(
                    f"retrieval: unknown mode {mode!r}; expected one of {', '.join(RetrievalMode)}"
                ) from None
        set_field(self, "return_vectors", bool(self.return_vectors))

    @property
    def n(self) -> int:
        """How many queries: texts, or vector rows for a request of vectors alone."""
        if self.queries or self.query_vectors is None:
            return len(self.queries)
        return len(self.query_vectors)

    @property
    def by_vectors(self) -> bool:
        """A request of query vectors alone (no texts): a dense search."""
        return self.query_vectors is not None and not self.queries

    def mode_on(self, index: SearchableIndex, encoder: Encoder | None = None) -> RetrievalMode:
        """The mode this request is served in on ``index``, which can serve it as asked:
        its views hold the mode (:func:`~openbook.index.engine.check_retrieval`: the index's
        default for none), a request of vectors alone is dense, a bm25 index takes no query
        vectors or ``encoder`` and returns no vectors, the vectors are of its dimension.
        InvalidArgument naming the field otherwise."""
        if self.by_vectors:
            if not index.dense:
                raise InvalidArgument(f"index {index.name!r} is bm25; search it by text")
            if self.retrieval not in (None, RetrievalMode.DENSE):
                raise InvalidArgument(
                    f"retrieval: {self.retrieval} reads the query texts; this request has "
                    "query_vectors only (dense)"
                )
            mode = RetrievalMode.DENSE
        else:
            mode = check_retrieval(index.name, index.views, index.default_retrieval, self.retrieval)
        if not index.dense:
            if encoder is not None or self.query_vectors is not None:
                raise InvalidArgument(f"index {index.name!r} is bm25; it takes no encoder")
            if self.return_vectors:
                raise InvalidArgument(f"index {index.name!r} is bm25 and stores no vectors")
        q = self.query_vectors
        if q is not None and q.shape[1] != index.manifest.dim:
            raise InvalidArgument(
                f"query_vectors: index {index.name!r}: query vectors of shape {q.shape}, "
                f"expected (n, {index.manifest.dim})"
            )
        return mode

    def dense_queries(self, index: SearchableIndex, encoder: Encoder | None = None) -> np.ndarray:
        """The float32 ``(n, dim)`` query vectors a dense search of ``index`` runs with:
        ``query_vectors`` as given (checked by :meth:`mode_on`), else the texts encoded by
        ``encoder`` (checked to pair with the index) or by the index's own query encoder."""
        if self.query_vectors is not None:
            return self.query_vectors
        if encoder is None:
            encoder = index.query_encoder
        else:
            index.check_encoder(encoder)
        return encoder.encode(list(self.queries))


__all__ = ["SearchRequest"]
