"""The BM25 view of an index held in Milvus: the files engine's BM25 scores as sparse vectors.

Read side and write side of ``milvus_engine.py``'s ``sparse`` field (issue 41). A BM25 score
is a sum over the query's tokens of a (term, passage) weight, which bm25s stores finished
(IDF and length normalisation included: ``openbook/index/bm25.py``). So a passage's sparse
vector holds, at each of its terms' dimensions (:func:`term_dim`), that weight, and a query's
vector holds each of its tokens' counts: their inner product, which Milvus's
``SPARSE_INVERTED_INDEX`` ranks by (metric ``IP``), is the passage's BM25 score, the score the
files engine serves, with the same tokenizer (``bm25._tokenize``) and the same statistics.

Why not Milvus's built-in BM25 function: its analyzer and its IDF (per segment in Milvus
Lite) are not bm25s's, so its scores, and the hybrid fusion calibrated on bm25s's, would
differ from the files engine's for the same index; scores computed here keep the two engines
interchangeable (``tests/index/test_milvus_bm25.py`` checks they agree).

Where the weights come from:

* an index copied from a built files index (``MilvusEngine.copy_index``): each passage's
  stored bm25s weights, exactly (a source without a BM25 view is indexed by bm25s first);
* a passage written later (the documents API): the weights the files engine's live layer
  gives a passage of its write segment (``segment_bm25``), ``idf(t)·tf / (tf + k1·(1 - b +
  b·dl/avgdl))`` with the index's statistics (:class:`BM25Statistics`: passages N, each
  term's document frequency, k1, b, avgdl) as they were when it was copied. They stay frozen:
  like a live index between compactions, written passages are scored with the base's
  statistics, which neither count them nor forget deleted ones. An index created empty has
  N = 0 (every term as rare as can be) and takes its first write's mean passage length for
  avgdl.

Dimensions are a 32-bit hash of the term (no vocabulary to share between replicas); two terms
of one hash (about one pair among 100,000 terms) share a dimension, their weights summed.
Dimension 0 is never a term's: a passage with no term (only stop words) holds it, since
Milvus refuses an empty sparse vector, and no query ever asks for it.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from openbook.index.bm25 import _tokenize, load_bm25
from openbook.index.segment_bm25 import BaseBM25Statistics, PassageTerms

NO_TERM = 0  # the dimension of a passage with no term (module docstring)
_DIMS = 2**32 - 2  # term dimensions are 1 .. 2**32 - 2 (Milvus: below 2**32 - 1)
SparseVector = dict[int, float]


def term_dim(term: str) -> int:
    """The sparse dimension of ``term``: a 32-bit hash, never :data:`NO_TERM`."""
    digest = hashlib.blake2b(term.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _DIMS + 1


def query_vectors(queries: Sequence[str]) -> list[SparseVector]:
    """Each query's tokens as bm25s scores them: each token's count, at its dimension (empty
    for a query of stop words only: it matches nothing)."""
    out = []
    for tokens in _tokenize(list(queries)):
        vector: Counter[int] = Counter()
        for token in tokens:
            vector[term_dim(token)] += 1
        out.append({d: float(n) for d, n in vector.items()})
    return out


def sparse_score(query: SparseVector, passage: SparseVector) -> float:
    """The inner product Milvus ranks by: the passage's BM25 score for the query."""
    return float(sum(weight * passage.get(dim, 0.0) for dim, weight in query.items()))


def stored(vector: SparseVector) -> SparseVector:
    """``vector`` as Milvus holds it: never empty (:data:`NO_TERM`)."""
    return vector or {NO_TERM: 1.0}


@dataclass
class BM25Statistics:
    """An index's BM25 statistics (module docstring): ``df`` by term dimension."""

    count: int
    k1: float
    b: float
    avgdl: float | None

    def to_dict(self) -> dict[str, float | int | None]:
        return {"count": self.count, "k1": self.k1, "b": self.b, "avgdl": self.avgdl}

    @classmethod
    def from_dict(cls, data: dict) -> BM25Statistics:
        avgdl = data.get("avgdl")
        return cls(
            int(data["count"]),
            float(data["k1"]),
            float(data["b"]),
            None if avgdl is None else float(avgdl),
        )

    @classmethod
    def empty(cls) -> BM25Statistics:
        """Of no passage (``BaseBM25Statistics.empty``'s parameters: build_bm25's)."""
        base = BaseBM25Statistics.empty()
        return cls(0, base.k1, base.b, None)

    def idf(self, df: int) -> float:
        """Lucene's IDF, as bm25s and ``segment_bm25`` compute it."""
        return math.log(1 + (self.count - df + 0.5) / (df + 0.5))

    def vectors(
        self, passages: Sequence[PassageTerms], df: dict[int, int], avgdl: float
    ) -> list[SparseVector]:
        """The sparse vectors of new passages (``segment_bm25``'s weights); ``df``: the
        document frequency of their terms' dimensions (absent: 0)."""
        out = []
        for p in passages:
            norm = self.k1 * (1 - self.b + self.b * p.length / avgdl)
            vector: dict[int, float] = {}
            for term, tf in p.counts.items():
                dim = term_dim(term)
                weight = self.idf(df.get(dim, 0)) * tf / (tf + norm)
                vector[dim] = vector.get(dim, 0.0) + weight
            out.append(stored(vector))
        return out


def passage_terms(title: str, text: str) -> PassageTerms:
    """A passage's term counts and length, as bm25s indexes ``"title text"``."""
    return PassageTerms.of(title, text)


class StoredBM25:
    """A built index's ``bm25/`` directory read for copying: each passage's stored weights
    (:meth:`vectors`), each dimension's document frequency and the statistics."""

    def __init__(self, bm25_dir: Path, sample: Sequence[tuple[int, str, str]]) -> None:
        retriever = load_bm25(bm25_dir)
        scores = retriever.scores
        indptr = np.asarray(scores["indptr"], dtype=np.int64)
        n_terms = len(indptr) - 1
        self.count = int(scores["num_docs"])
        dims = np.zeros(n_terms, dtype=np.int64)
        for term, tid in retriever.vocab_dict.items():
            if tid < n_terms:
                dims[tid] = term_dim(term)
        self._dims = dims
        # Rows of passages: the term x passage matrix transposed (scipy: csc -> csr).
        matrix = sp.csc_matrix(
            (np.asarray(scores["data"]), np.asarray(scores["indices"]), indptr),
            shape=(self.count, n_terms),
        )
        self._rows = matrix.tocsr()
        self.df: dict[int, int] = {}
        for tid, n in enumerate(np.diff(indptr).tolist()):
            if n:
                self.df[int(dims[tid])] = self.df.get(int(dims[tid]), 0) + int(n)
        base = BaseBM25Statistics.load(bm25_dir, sample)
        self.statistics = BM25Statistics(self.count, base.k1, base.b, base.avgdl)

    def vectors(self, start: int, stop: int) -> list[SparseVector]:
        """The stored weights of passages ``[start, stop)`` (row order), as sparse vectors."""
        out = []
        for row in range(start, stop):
            lo, hi = self._rows.indptr[row], self._rows.indptr[row + 1]
            vector: dict[int, float] = {}
            for tid, weight in zip(
                self._rows.indices[lo:hi].tolist(), self._rows.data[lo:hi].tolist(), strict=True
            ):
                dim = int(self._dims[tid])
                vector[dim] = vector.get(dim, 0.0) + float(weight)
            out.append(stored(vector))
        return out


def df_batches(df: dict[int, int], size: int) -> Iterator[list[tuple[int, int]]]:
    """``df``'s (dimension, frequency) pairs in batches of ``size``, by dimension."""
    items = sorted(df.items())
    for start in range(0, len(items), size):
        yield items[start : start + size]


__all__ = [
    "NO_TERM",
    "BM25Statistics",
    "SparseVector",
    "StoredBM25",
    "df_batches",
    "passage_terms",
    "query_vectors",
    "sparse_score",
    "stored",
    "term_dim",
]
