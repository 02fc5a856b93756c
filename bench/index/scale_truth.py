"""Exact top-k inner-product neighbours of a few hundred queries over a streamed corpus.

The ground truth of the scale benchmark's recall: every block of vectors is multiplied by the
queries once as it streams past (the build feeds it the same blocks it indexes) and only a
running top-k per query is kept, so exact search over 21M vectors needs memory for one block
and ``queries x k`` scores, never the corpus.

Invariant: after ``add(vectors, first_row)`` for blocks covering rows ``[0, rows_done)`` in
order, ``rows``/``scores`` are the exact top-k of those rows, best first (ties by lower row),
and ``save``/``load`` round-trip that state together with ``rows_done``, so a resumed run
continues exactly where the saved state ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class RunningTopK:
    """Exact running top-``k`` by inner product for fixed ``queries`` (module docstring)."""

    def __init__(self, queries: np.ndarray, k: int) -> None:
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)
        self.k = k
        n = len(self.queries)
        self.scores = np.full((n, k), -np.inf, dtype=np.float32)
        self.rows = np.full((n, k), -1, dtype=np.int64)
        self.rows_done = 0

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Fold in ``vectors`` (rows ``first_row ..``), which must start at ``rows_done``."""
        if first_row != self.rows_done:
            raise ValueError(f"blocks out of order: got row {first_row}, expected {self.rows_done}")
        block = vectors @ self.queries.T  # rows x queries
        take = min(self.k, len(vectors))
        part = np.argpartition(-block, take - 1, axis=0)[:take].T  # queries x take
        cand_scores = np.concatenate([self.scores, np.take_along_axis(block.T, part, 1)], axis=1)
        cand_rows = np.concatenate([self.rows, part + first_row], axis=1)
        # best first; among equal scores the lower row (lexsort: last key is primary)
        order = np.lexsort((cand_rows, -cand_scores), axis=1)[:, : self.k]
        self.scores = np.take_along_axis(cand_scores, order, 1)
        self.rows = np.take_along_axis(cand_rows, order, 1)
        self.rows_done += len(vectors)

    def save(self, path: Path) -> None:
        """Atomically write the state (a crash leaves the previous one)."""
        tmp = Path(f"{path}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, scores=self.scores, rows=self.rows, rows_done=self.rows_done)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def load(self, path: Path) -> None:
        with np.load(path) as z:
            if z["rows"].shape != self.rows.shape:
                raise ValueError(
                    f"{path}: state of shape {z['rows'].shape}, expected {self.rows.shape}"
                )
            self.scores, self.rows = z["scores"], z["rows"]
            self.rows_done = int(z["rows_done"])


def recall_at_k(found: list[list[int]], truth: np.ndarray) -> float:
    """Mean over queries of |found top-k ∩ exact top-k| / k (k = ``truth``'s width)."""
    k = truth.shape[1]
    hits = [len(set(f[:k]) & set(t.tolist())) for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits) / k)
