"""Sparse BM25 index (bm25s): the RAG paper's ablation replacing the dense retriever.

Shared: the write side builds it, the read side searches it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import bm25s
import numpy as np

from openbook.index.arrays import opening
from openbook.index.filtering import top_masked


def load_bm25(path: Path) -> bm25s.BM25:
    """The bm25s index stored at ``path``, its arrays memory-mapped (opened under
    :func:`openbook.index.arrays.opening`: bm25s reads them with ``np.load``)."""
    # bm25s logs at INFO/WARNING when loading without a corpus; that is intended here.
    logging.getLogger("bm25s").setLevel(logging.ERROR)
    with opening():
        return bm25s.BM25.load(str(path), mmap=True, show_progress=False)


BM25_DIR = "bm25"
_STOPWORDS = "en"


def _tokenize(texts: Sequence[str]) -> list[list[str]]:
    # Strings, not ids: query ids from a fresh tokenize() call would not match the index vocab.
    return bm25s.tokenize(list(texts), stopwords=_STOPWORDS, show_progress=False, return_ids=False)


def build_bm25(texts: Sequence[str], out_dir: Path, progress: bool = False) -> None:
    """Index ``texts`` (title + passage, row order) and save to ``out_dir`` (no corpus copy)."""
    retriever = bm25s.BM25()
    retriever.index(_tokenize(texts), show_progress=progress)
    retriever.save(str(out_dir), show_progress=False)


def slice_bm25(src: Path, out_dir: Path, start: int, stop: int) -> None:
    """Save to ``out_dir`` the BM25 index of documents ``[start, stop)`` of the one at ``src``
    (renumbered from 0), scoring exactly as the parent does.

    bm25s stores each (term, document) pair's finished score, IDF and length normalisation
    included, in a sparse term x document matrix; a shard keeps its documents' entries, so its
    scores are the parent's, computed with the whole corpus's statistics (not the shard's:
    sharded BM25 merges exactly). Memory: the parent's matrix plus a mask over its entries.
    """
    retriever = load_bm25(src)
    scores = retriever.scores
    data, indices, indptr = scores["data"], scores["indices"], scores["indptr"]
    keep = (indices >= start) & (indices < stop)
    kept_before = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
    retriever.scores = {
        "data": np.asarray(data[keep]),
        "indices": np.asarray(indices[keep] - start).astype(indices.dtype),
        "indptr": kept_before[np.asarray(indptr)].astype(indptr.dtype),
        "num_docs": stop - start,
    }
    retriever.save(str(out_dir), show_progress=False)


class BM25Searcher:
    def __init__(self, path: Path) -> None:
        self._retriever = load_bm25(path)
        self.count = int(self._retriever.scores["num_docs"])

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows (-1 padded) and BM25 scores, best first."""
        k_eff = min(k, self.count)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.zeros((len(queries), k), dtype=np.float32)
        if k_eff == 0 or not queries:
            return scores, rows
        tokens = _tokenize(queries)
        res, sc = self._retriever.retrieve(
            tokens, k=k_eff, show_progress=False, n_threads=1, return_as="tuple"
        )
        rows[:, :k_eff] = res
        scores[:, :k_eff] = sc
        # A document with score 0 shares no term with the query; don't present it as a hit.
        rows[scores <= 0] = -1
        return scores, rows

    def search_masked(
        self, queries: Sequence[str], k: int, allowed: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`search`, among the rows ``allowed`` (a boolean mask) only: pre-filtered,
        every passage's score computed (``get_scores``, as :meth:`score_rows`) and the mask
        applied before the top k, so k matching hits come back whenever k match the query."""
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.zeros((len(queries), k), dtype=np.float32)
        if not queries or not allowed.any():
            return scores, rows
        for i, tokens in enumerate(_tokenize(queries)):
            ids = self._retriever.get_tokens_ids(tokens)
            if not ids:
                continue
            every = np.asarray(self._retriever.get_scores_from_ids(ids), dtype=np.float32)
            scores[i], rows[i] = top_masked(every, allowed, k)
        return scores, rows

    def score_rows(self, queries: Sequence[str], rows: np.ndarray) -> np.ndarray:
        """Exact BM25 scores of given documents: float32 ``(n, m)`` for ``rows`` ``(n, m)``
        (row -1: padding, scored 0); the scores :meth:`search` would give them.

        Cost per query: bm25s' ``get_scores``, every document's score (a sum over the query
        terms' posting lists, O(sum of their document frequencies), plus one float32 per
        document: ~84 MB and some tens of ms for Wikipedia's 21M passages), then a gather.
        """
        rows = np.asarray(rows, dtype=np.int64)
        out = np.zeros(rows.shape, dtype=np.float32)
        for i, tokens in enumerate(_tokenize(queries)):
            ids = self._retriever.get_tokens_ids(tokens)
            if not ids:
                continue  # no query term in the vocabulary: every document scores 0
            every = self._retriever.get_scores_from_ids(ids)
            valid = rows[i] >= 0
            out[i, valid] = every[rows[i, valid]]
        return out
