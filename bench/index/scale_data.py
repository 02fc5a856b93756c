"""Synthetic DPR-shaped passage vectors for the scale benchmark: deterministic, clustered,
generated block by block so that no run ever holds the corpus in memory.

How a vector is made (``SyntheticCorpus``), and why:

* **Clusters.** ``n_centres`` (4,096) Gaussian centres ``c_j ~ N(0, I_768)`` plus one shared
  offset ``m ~ N(0, 0.5^2 I)`` (real encoder outputs share a large common component). A
  passage picks its centre with Zipf-like weights ``p_j ~ 1 / (j + 10)^0.7``: topics are not
  equally frequent, so some inverted lists are much longer than others, as with Wikipedia.
* **Anisotropic noise.** Around its centre a passage varies in a shared 128-dimensional
  subspace (a fixed random orthonormal basis ``B``, 128 x 768) with a power-law spectrum:
  the i-th direction's standard deviation is ``sigma / sqrt(i + 1)``, ``sigma`` chosen so the
  noise carries the energy of ``bench/retriever``'s isotropic ``0.6``-per-dimension noise
  (``0.6^2 * 768``). The participation ratio of that spectrum is ~25 dimensions: the
  decaying, low effective dimension that measured sentence/passage embeddings show, where an
  isotropic 768-d noise would make every neighbour equidistant (the worst case of any ANN
  index, not a model of embeddings). Only 128 normals per passage are drawn, which keeps 21M
  passages to minutes of generation on two cores.
* **Norms.** DPR scores by unnormalised inner product, and its passage norms spread: each
  vector is scaled by ``lognormal(0, 0.1)``. Nothing is normalised.
* **Queries** are perturbed passages: passage ``r`` (rows spread over the whole corpus,
  drawn with the query seed) plus the same kind of noise at ``query_noise`` (0.5) of the
  passages' strength: a question near, not on, a passage.

Determinism: block ``b`` (rows ``[b * block_rows, (b + 1) * block_rows)``) is drawn from
``SeedSequence([seed, b])`` alone, so any row range, a training sample, or a query's source
passage can be regenerated without the rows before it, and every chunking of a run gives the
same vectors (the resume of an interrupted build relies on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

DIM = 768  # DPR's
NOISE_RANK = 128
BLOCK_ROWS = 4096


@dataclass(frozen=True)
class SyntheticCorpus:
    """``count`` vectors of ``dim`` dimensions, defined by ``seed`` (module docstring)."""

    count: int
    dim: int = DIM
    seed: int = 0
    n_centres: int = 4096
    noise_rank: int = NOISE_RANK
    block_rows: int = BLOCK_ROWS
    noise_per_dim: float = 0.6  # the energy of bench/retriever's isotropic noise
    norm_spread: float = 0.1  # sigma of the lognormal norm factor

    def __post_init__(self) -> None:
        if self.count < 1 or self.dim < 1 or self.n_centres < 1 or self.block_rows < 1:
            raise ValueError("count, dim, n_centres and block_rows must be >= 1")
        if not 1 <= self.noise_rank <= self.dim:
            raise ValueError(f"noise_rank must be in [1, dim], got {self.noise_rank}")

    @cached_property
    def _model(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(centres + shared offset, cumulative centre weights, scaled noise basis)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x5CA1E]))
        offset = rng.standard_normal(self.dim, dtype=np.float32) * 0.5
        centres = rng.standard_normal((self.n_centres, self.dim), dtype=np.float32) + offset
        weights = 1.0 / (np.arange(self.n_centres) + 10.0) ** 0.7
        cumulative = np.cumsum(weights / weights.sum())
        basis, _ = np.linalg.qr(rng.standard_normal((self.dim, self.noise_rank)))
        spectrum = 1.0 / np.sqrt(np.arange(1, self.noise_rank + 1))
        spectrum *= self.noise_per_dim * np.sqrt(self.dim) / np.linalg.norm(spectrum)
        scaled_basis = (spectrum[:, None] * basis.T).astype(np.float32)  # rank x dim
        return centres.astype(np.float32), cumulative, scaled_basis

    @property
    def n_blocks(self) -> int:
        return -(-self.count // self.block_rows)

    def block(self, b: int) -> np.ndarray:
        """The vectors of rows ``[b * block_rows, min((b + 1) * block_rows, count))``."""
        if not 0 <= b < self.n_blocks:
            raise IndexError(f"block {b} outside [0, {self.n_blocks})")
        n = min(self.block_rows, self.count - b * self.block_rows)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, b]))
        return self._draw(rng, n)

    def _draw(self, rng: np.random.Generator, n: int, strength: float = 1.0) -> np.ndarray:
        centres, cumulative, scaled_basis = self._model
        which = np.searchsorted(cumulative, rng.random(n), side="right")
        which = np.minimum(which, self.n_centres - 1)
        z = rng.standard_normal((n, self.noise_rank), dtype=np.float32)
        if strength != 1.0:
            z *= np.float32(strength)
        x = z @ scaled_basis
        x += centres[which]
        x *= rng.lognormal(0.0, self.norm_spread, (n, 1)).astype(np.float32)
        return x

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (any range: the blocks it overlaps are drawn and cut)."""
        if not 0 <= start <= stop <= self.count:
            raise IndexError(f"rows [{start}, {stop}) outside [0, {self.count})")
        out = np.empty((stop - start, self.dim), dtype=np.float32)
        b = start // self.block_rows
        at = start
        while at < stop:
            first = b * self.block_rows
            vecs = self.block(b)
            take = min(stop, first + len(vecs)) - at
            out[at - start : at - start + take] = vecs[at - first : at - first + take]
            at += take
            b += 1
        return out

    def centres_of(self, rows: np.ndarray) -> np.ndarray:
        """The centre (cluster) each of ``rows`` was drawn around (each block's draw redone)."""
        rows = np.asarray(rows, dtype=np.int64)
        _, cumulative, _ = self._model
        out = np.empty(len(rows), dtype=np.int64)
        blocks = rows // self.block_rows
        for b in np.unique(blocks):
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, int(b)]))
            n = min(self.block_rows, self.count - int(b) * self.block_rows)
            which = np.searchsorted(cumulative, rng.random(n), side="right")  # as _draw
            at = np.nonzero(blocks == b)[0]
            out[at] = np.minimum(which, self.n_centres - 1)[rows[at] - int(b) * self.block_rows]
        return out

    def cluster_sizes(self) -> np.ndarray:
        """The expected number of passages around each centre (count x its weight)."""
        _, cumulative, _ = self._model
        return self.count * np.diff(np.concatenate([[0.0], cumulative]))

    def pick(self, rows: np.ndarray) -> np.ndarray:
        """The vectors of arbitrary ``rows`` (each block drawn once)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        blocks = rows // self.block_rows
        for b in np.unique(blocks):
            at = np.nonzero(blocks == b)[0]
            out[at] = self.block(int(b))[rows[at] - int(b) * self.block_rows]
        return out

    def sample(self, n: int) -> np.ndarray:
        """About ``n`` vectors for training quantizers: whole blocks spread evenly over the
        corpus (every cluster weight and every part of the corpus represented)."""
        want = max(1, min(self.n_blocks, -(-n // self.block_rows)))
        picks = np.unique(np.linspace(0, self.n_blocks - 1, want).round().astype(np.int64))
        return np.concatenate([self.block(int(b)) for b in picks])[: max(n, 1)]

    def queries(
        self, n: int, seed: int = 1, query_noise: float = 0.5
    ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` query vectors and the rows of the passages they perturb (module docstring)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, seed]))
        sources = np.sort(rng.choice(self.count, size=n, replace=n > self.count))
        _, _, scaled_basis = self._model
        z = rng.standard_normal((n, self.noise_rank), dtype=np.float32) * np.float32(query_noise)
        return (self.pick(sources) + z @ scaled_basis).astype(np.float32), sources
