"""Metadata filters applied inside retrieval: which rows a filter keeps, and searching only them.

Read side. A filter (:mod:`openbook.validation.metadata_filter`) becomes a boolean mask over an
index's rows (:class:`MetadataColumns`), and every search path takes that mask *before* ranking, so
the k best matching passages come back whenever k match (never "the top k, then drop the ones that
do not match", which returns fewer, or none, for a selective filter):

* dense (``flat``, ``hnsw``, ``hnsw-sq8``, ``ivfpq``): when the mask keeps at most
  :data:`EXACT_FILTER_ROWS` rows, the kept rows' stored vectors (``vectors.npy``) are scored
  exactly (a brute-force scan of the few: cheaper than any graph walk, and exact); otherwise
  faiss searches with an ``IDSelectorBitmap`` in its ``SearchParameters`` (flat: exact over the
  kept rows; HNSW: the graph walk returns kept rows only, efSearch at least k; IVF-PQ: kept
  rows of the probed lists). If faiss returns fewer than min(k, kept) (an HNSW walk or the
  probed IVF lists hold too few kept rows), that query falls back to the exact scan: the
  guarantee holds for every type.
* ``bm25`` and the BM25 view: every passage's BM25 score for the query (bm25s'
  ``get_scores``, as hybrid's exact features already do), the mask applied, top k of the rest.
* hybrid: the union of the filtered dense top N and the filtered BM25 top N, fused as usual.

A built index keeps no metadata: its mask is computed from the passages' ids and titles (the
built-in ``_id`` and ``_title`` fields). A live index computes its base's mask from its
document store (each base row's document's metadata), and tests its segment's documents one
by one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import faiss
import numpy as np

from openbook.index import faiss_index
from openbook.validation.metadata_filter import (
    BUILTIN_FIELDS,
    BUILTIN_ID,
    BUILTIN_TITLE,
    AllOf,
    AnyOf,
    Condition,
    MetadataFilter,
    Node,
    ValueKey,
    value_key,
)

# A filter keeping at most this many rows is served by an exact scan of their vectors: at 768-d
# ~25M multiply-adds per query, a few ms, and exact whatever the index type.
EXACT_FILTER_ROWS = 32_768
_EXACT_CHUNK = 65_536
_MASK_CACHE = 32


class MetadataColumns:
    """The filterable fields of an index's rows: each row's document (an ordinal), and per key
    an inverted map value -> documents. Immutable once built; thread-safe (the mask cache has
    a lock).

    Built once per index (base) in one pass over its documents: the built-in ``_id`` (unique:
    value -> one ordinal) and ``_title`` (value -> ordinals) keyed by the string itself,
    metadata keyed by :func:`value_key` (typed). A mask costs the postings of the filter's
    values plus one gather over the rows."""

    def __init__(
        self,
        doc_of_row: np.ndarray,
        ids: Sequence[str],
        titles: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """``doc_of_row[r]``: the ordinal of row r's document in ``ids`` / ``titles`` /
        ``metadata`` (-1: a row of no known document, matched by nothing)."""
        self.rows = len(doc_of_row)
        self.documents = n = len(ids)
        self._ids = {doc_id: i for i, doc_id in enumerate(ids)}
        self._titles: dict[str, list[int]] = {}
        for i, title in enumerate(titles):
            self._titles.setdefault(title, []).append(i)
        self._postings: dict[str, dict[ValueKey, list[int]]] = {}
        for i, meta in enumerate(metadata or ()):
            for key, value in meta.items():
                if key in BUILTIN_FIELDS or isinstance(value, list | dict):
                    continue  # built-ins take precedence; metadata is flat
                self._postings.setdefault(key, {}).setdefault(value_key(value), []).append(i)
        # -1 gathers the extra, never-set slot at the end.
        self._doc_of_row = np.where(doc_of_row < 0, n, doc_of_row).astype(np.int64)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def mask(self, where: MetadataFilter) -> np.ndarray:
        """Boolean ``(rows,)``: the rows whose document passes ``where``. Read-only array."""
        key = where.canonical()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        docs = np.zeros(self.documents + 1, dtype=bool)
        docs[: self.documents] = self._documents(where.root)
        out = docs[self._doc_of_row]
        out.flags.writeable = False
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > _MASK_CACHE:
                self._cache.popitem(last=False)
        return out

    def _documents(self, node: Node) -> np.ndarray:
        if isinstance(node, Condition):
            hit = np.zeros(self.documents, dtype=bool)
            for kind, value in node.values:
                if node.key == BUILTIN_ID:
                    if kind == "string" and value in self._ids:
                        hit[self._ids[value]] = True
                elif node.key == BUILTIN_TITLE:
                    if kind == "string" and value in self._titles:
                        hit[self._titles[value]] = True
                elif (kind, value) in (postings := self._postings.get(node.key, {})):
                    hit[postings[(kind, value)]] = True
            return hit
        parts = [self._documents(p) for p in node.parts]
        if isinstance(node, AllOf):
            return np.logical_and.reduce(parts)
        assert isinstance(node, AnyOf)
        return np.logical_or.reduce(parts)


def segment_mask(where: MetadataFilter, records: Iterable[Mapping[str, Any]]) -> np.ndarray:
    """Which of a few records (a live index's write segment, per passage) pass ``where``."""
    return np.fromiter((where.matches(r) for r in records), dtype=bool)


def search_dense_masked(
    index: faiss.Index,
    index_type: str,
    params: dict[str, Any],
    vectors: np.ndarray,
    queries: np.ndarray,
    k: int,
    allowed: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k inner-product scores and rows (-1 padded) among the rows ``allowed`` keeps (module
    docstring: an exact scan for a few rows, else faiss with an ID selector, exact fallback)."""
    kept = np.flatnonzero(allowed)
    if len(kept) <= EXACT_FILTER_ROWS:
        return exact_scan(vectors, kept, queries, k)
    bits = np.packbits(np.asarray(allowed, dtype=bool), bitorder="little")
    selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bits))
    search_params: Any
    if index_type in ("hnsw", "hnsw-sq8"):
        # faiss' type stubs lack SearchParametersHNSW (faiss has it since 1.7.3)
        search_params = cast(Any, faiss).SearchParametersHNSW()
        search_params.efSearch = max(int(params["ef_search"]), k)
    elif index_type == "ivfpq":
        search_params = faiss.SearchParametersIVF()
        search_params.nprobe = int(params["nprobe"])
    else:
        search_params = faiss.SearchParameters()
    search_params.sel = selector
    scores, rows = faiss_index.search(index, index_type, params, queries, k, search_params)
    del bits  # kept alive until here: the selector points into it
    want = min(k, len(kept))
    short = np.flatnonzero((rows >= 0).sum(axis=1) < want)
    if len(short):
        s, r = exact_scan(vectors, kept, queries[short], k)
        scores[short], rows[short] = s, r
    return scores, rows


def exact_scan(
    vectors: np.ndarray, kept: np.ndarray, queries: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner products of ``queries`` against the rows ``kept`` (ascending) of
    ``vectors`` (a memmap: read in row order, chunk by chunk)."""
    n = len(queries)
    best_scores = np.full((n, 0), -np.inf, dtype=np.float32)
    best_rows = np.zeros((n, 0), dtype=np.int64)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    for at in range(0, len(kept), _EXACT_CHUNK):
        rows = kept[at : at + _EXACT_CHUNK]
        scores = q @ np.asarray(vectors[rows], dtype=np.float32).T
        best_scores = np.concatenate([best_scores, scores], axis=1)
        best_rows = np.concatenate([best_rows, np.broadcast_to(rows, scores.shape)], axis=1)
        if best_scores.shape[1] > k:
            top = np.argpartition(-best_scores, k - 1, axis=1)[:, :k]
            best_scores = np.take_along_axis(best_scores, top, axis=1)
            best_rows = np.take_along_axis(best_rows, top, axis=1)
    order = np.argsort(-best_scores, axis=1, kind="stable")
    best_scores = np.take_along_axis(best_scores, order, axis=1)
    best_rows = np.take_along_axis(best_rows, order, axis=1)
    out_scores = np.zeros((n, k), dtype=np.float32)
    out_rows = np.full((n, k), -1, dtype=np.int64)
    m = best_scores.shape[1]
    out_scores[:, :m] = best_scores
    out_rows[:, :m] = best_rows
    return out_scores, out_rows


def top_masked(
    scores: np.ndarray, allowed: np.ndarray | None, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of one query's ``scores`` over every row (BM25: 0 is no hit) among ``allowed``:
    scores and rows, -1 padded, best first."""
    s = np.where(allowed, scores, 0.0) if allowed is not None else scores
    hits = np.flatnonzero(s > 0)
    out_scores = np.zeros(k, dtype=np.float32)
    out_rows = np.full(k, -1, dtype=np.int64)
    if len(hits) > k:
        hits = hits[np.argpartition(-s[hits], k - 1)[:k]]
    hits = hits[np.argsort(-s[hits], kind="stable")]
    out_scores[: len(hits)] = s[hits]
    out_rows[: len(hits)] = hits
    return out_scores, out_rows
