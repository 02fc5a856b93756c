"""BM25 scores of a live index's write segment, computed with its base's BM25 statistics.

bm25s stores finished (term, document) scores, not the statistics behind them, so the ones a
new passage needs are read back from the base's BM25 index:
  * N (documents) and each term's document frequency (the number of stored entries of its
    column of the score matrix), hence the lucene IDF ``log(1 + (N - df + 0.5) / (df + 0.5))``;
  * k1 and b from the index's parameters;
  * the average document length, which bm25s does not save: solved from the stored score of
    a term that occurs once in a sampled base passage,
    ``s = idf / (1 + k1 (1 - b + b·dl/avgdl))``, the median over a few passages.

What is exact and what is not (until the next compaction rebuilds the BM25 view over every
passage): a segment passage gets exactly the score the base's BM25 index would give it had it
been indexed with the base's statistics; a term no base passage contains counts with df = 0
(as rare as a term can be). The base's own scores keep the base's statistics, which do not
count the segment's passages nor forget the deleted ones; so neither view's scores equal the
compacted index's exactly, and both converge to it at compaction.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import bm25s
import numpy as np

from openbook.index.bm25 import _tokenize, load_bm25
from openbook.index.manifest import IndexLoadError

_AVGDL_SAMPLES = 16


@dataclass(frozen=True)
class PassageTerms:
    """A passage's term counts and length, as bm25s indexes ``"title text"``."""

    counts: Counter[str]
    length: int

    @classmethod
    def of(cls, title: str, text: str) -> PassageTerms:
        tokens = _tokenize([f"{title} {text}"])[0]
        return cls(Counter(tokens), len(tokens))


class BaseBM25Statistics:
    """The BM25 statistics of a base index's ``bm25/`` directory (module docstring); of no
    passages at all for a live index created empty (:meth:`empty`)."""

    def __init__(
        self,
        count: int,
        k1: float,
        b: float,
        vocab: dict[str, int],
        df: np.ndarray,
        retriever: bm25s.BM25 | None = None,
    ) -> None:
        self.count = count
        self.k1 = k1
        self.b = b
        self._vocab = vocab
        self._df = df
        self._retriever = retriever
        # None: no base passage to take it from; the segment's own mean length is used.
        self.avgdl: float | None = None

    @classmethod
    def load(cls, bm25_dir: Path, sample: Sequence[tuple[int, str, str]]) -> BaseBM25Statistics:
        """``sample``: a few base passages ``(row, title, text)`` to solve avgdl from."""
        retriever = load_bm25(bm25_dir)
        method = getattr(retriever, "method", "lucene")
        if method != "lucene":
            # openbook builds lucene only: another method is an index it cannot serve live
            raise IndexLoadError(f"{bm25_dir}: BM25 method {method!r}; live indexes score lucene")
        scores = retriever.scores
        stats = cls(
            count=int(scores["num_docs"]),
            k1=float(retriever.k1),
            b=float(retriever.b),
            vocab=dict(retriever.vocab_dict),
            df=np.diff(np.asarray(scores["indptr"], dtype=np.int64)),
            retriever=retriever,
        )
        stats.avgdl = stats._solve_avgdl(sample)
        return stats

    @classmethod
    def empty(cls, k1: float = 1.5, b: float = 0.75) -> BaseBM25Statistics:
        """No base passages (build_bm25's parameters): every term has df = 0."""
        return cls(0, k1, b, {}, np.zeros(0, np.int64))

    def idf(self, term: str) -> float:
        tid = self._vocab.get(term)
        df = int(self._df[tid]) if tid is not None and tid < len(self._df) else 0
        return math.log(1 + (self.count - df + 0.5) / (df + 0.5))

    def _solve_avgdl(self, sample: Sequence[tuple[int, str, str]]) -> float:
        lengths: list[int] = []
        solved: list[float] = []
        for row, title, text in sample[:_AVGDL_SAMPLES]:
            terms = PassageTerms.of(title, text)
            lengths.append(terms.length)
            once = [t for t, n in terms.counts.items() if n == 1 and t in self._vocab]
            if not once or terms.length == 0 or self.b == 0:
                continue
            tid = self._vocab[once[0]]
            assert self._retriever is not None  # loaded with the statistics
            stored = float(self._retriever.get_scores_from_ids([tid])[row])
            if stored <= 0:
                continue
            # s = idf / (1 + k1 (1 - b + b dl / avgdl))  =>  dl / avgdl = ((idf/s - 1)/k1 - 1 + b)/b
            ratio = ((self.idf(once[0]) / stored - 1) / self.k1 - 1 + self.b) / self.b
            if ratio > 0:
                solved.append(terms.length / ratio)
        if solved:
            return float(np.median(solved))
        # b == 0 (length does not matter) or no usable passage: the sample's mean length.
        return float(np.mean(lengths)) if lengths else 1.0

    def norms(self, lengths: np.ndarray) -> np.ndarray:
        """Each passage's ``k1 (1 - b + b dl / avgdl)`` for passage lengths ``lengths``
        (the segment's: its own mean length stands for avgdl when the base has none)."""
        avgdl = self.avgdl if self.avgdl is not None else float(lengths.mean()) or 1.0
        return self.k1 * (1 - self.b + self.b * lengths / avgdl)

    def score(self, queries: Sequence[str], segment: SegmentPostings) -> np.ndarray:
        """float32 ``(len(queries), len(segment))`` BM25 scores of the segment's passages."""
        out = np.zeros((len(queries), len(segment)), dtype=np.float64)
        if not len(segment):
            return out.astype(np.float32)
        norms = self.norms(segment.lengths)
        for qi, tokens in enumerate(_tokenize(queries)):
            for term in tokens:
                posting = segment.postings.get(term)
                if posting is None:
                    continue
                rows, tf = posting
                out[qi, rows] += self.idf(term) * tf / (tf + norms[rows])
        return out.astype(np.float32)


class SegmentPostings:
    """The segment's inverted index: term -> (passage positions, term counts), and each
    passage's length; scoring costs the query terms' postings, not the segment's size."""

    def __init__(self, passages: Sequence[PassageTerms]) -> None:
        by_term: dict[str, tuple[list[int], list[int]]] = {}
        for i, p in enumerate(passages):
            for term, n in p.counts.items():
                rows, counts = by_term.setdefault(term, ([], []))
                rows.append(i)
                counts.append(n)
        self.postings = {
            t: (np.asarray(r, dtype=np.int64), np.asarray(c, dtype=np.float64))
            for t, (r, c) in by_term.items()
        }
        self.lengths = np.asarray([p.length for p in passages], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.lengths)


def fold_bm25(
    base_dir: Path | None,
    base_rows: np.ndarray,
    stats: BaseBM25Statistics,
    segment: Sequence[PassageTerms],
    out_dir: Path,
) -> None:
    """Save to ``out_dir`` a BM25 index of the base's rows ``base_rows`` (ascending; renumbered
    from 0) followed by the segment's passages, in which every score is the one the live index
    serves today: a base row keeps its stored (term, passage) scores, a segment passage gets
    those :meth:`BaseBM25Statistics.score` gives it (``stats``: the base's statistics).

    For a compacted shard (openbook.index.compaction): its base's scores carry the parent's
    statistics, and a view indexed anew would carry the shard's own instead. Terms no base
    passage has are appended to the vocabulary. ``base_dir`` None: no base rows.
    """
    import scipy.sparse as sp

    logging.getLogger("bm25s").setLevel(logging.ERROR)
    if base_dir is not None:
        retriever = load_bm25(base_dir)
        scores = retriever.scores
        data = np.asarray(scores["data"])
        indices = np.asarray(scores["indices"])
        indptr = np.asarray(scores["indptr"], dtype=np.int64)
        num_docs = int(scores["num_docs"])
        vocab = dict(retriever.vocab_dict)
    else:
        retriever = bm25s.BM25(k1=stats.k1, b=stats.b, method="lucene")
        data = np.zeros(0, np.float32)
        indices = np.zeros(0, np.int32)
        indptr = np.zeros(1, np.int64)
        num_docs, vocab = 0, {}
    # Base entries: the kept rows' (renumbered), their columns (terms) as stored.
    new_row = np.full(num_docs, -1, dtype=np.int64)
    new_row[base_rows] = np.arange(len(base_rows))
    cols = np.repeat(np.arange(len(indptr) - 1, dtype=np.int64), np.diff(indptr))
    keep = new_row[indices] >= 0
    rows_parts, cols_parts = [new_row[indices[keep]]], [cols[keep]]
    data_parts = [data[keep].astype(np.float64)]
    # Segment entries: idf(t) tf / (tf + norm), the terms' ids appended after the base's.
    next_id = max(vocab.values(), default=-1) + 1
    lengths = np.asarray([p.length for p in segment], dtype=np.float64)
    norms = stats.norms(lengths) if len(segment) else lengths
    seg_rows, seg_cols, seg_data = [], [], []
    for j, passage in enumerate(segment):
        for term, tf in passage.counts.items():
            tid = vocab.get(term)
            if tid is None:
                tid = vocab[term] = next_id
                next_id += 1
            seg_rows.append(len(base_rows) + j)
            seg_cols.append(tid)
            seg_data.append(stats.idf(term) * tf / (tf + norms[j]))
    rows_parts.append(np.asarray(seg_rows, dtype=np.int64))
    cols_parts.append(np.asarray(seg_cols, dtype=np.int64))
    data_parts.append(np.asarray(seg_data, dtype=np.float64))
    n_docs = len(base_rows) + len(segment)
    n_terms = max(len(indptr) - 1, next_id)
    matrix = sp.csc_matrix(
        (np.concatenate(data_parts), (np.concatenate(rows_parts), np.concatenate(cols_parts))),
        shape=(n_docs, n_terms),
    )
    matrix.sort_indices()
    retriever.scores = {
        "data": matrix.data.astype(data.dtype if len(data) else np.float32),
        "indices": matrix.indices.astype(indices.dtype if len(indices) else np.int32),
        "indptr": matrix.indptr.astype(np.int64),
        "num_docs": n_docs,
    }
    retriever.vocab_dict = vocab
    retriever.unique_token_ids_set = set(vocab.values())
    retriever.save(str(out_dir), show_progress=False)
