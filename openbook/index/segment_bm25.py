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

from openbook.index.bm25 import _tokenize

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
        logging.getLogger("bm25s").setLevel(logging.ERROR)
        retriever = bm25s.BM25.load(str(bm25_dir), mmap=True, show_progress=False)
        method = getattr(retriever, "method", "lucene")
        if method != "lucene":
            raise ValueError(f"{bm25_dir}: BM25 method {method!r}; live indexes score lucene")
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

    def score(self, queries: Sequence[str], segment: SegmentPostings) -> np.ndarray:
        """float32 ``(len(queries), len(segment))`` BM25 scores of the segment's passages."""
        out = np.zeros((len(queries), len(segment)), dtype=np.float64)
        if not len(segment):
            return out.astype(np.float32)
        avgdl = self.avgdl if self.avgdl is not None else float(segment.lengths.mean()) or 1.0
        norms = self.k1 * (1 - self.b + self.b * segment.lengths / avgdl)
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
