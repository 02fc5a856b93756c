"""Retrieval inside the training loop: top-k with the *current* query encoder, scored with grad.

The index (and so every document vector) is frozen, as in the paper (§2.4): re-encoding
21M passages after each update would be prohibitive. Only q(x) changes, which still moves
p(z|x) because the scores are recomputed from q(x) with autograd.

``DenseRetrieval`` retrieves from the dense view; ``HybridRetrieval`` from the fused dense +
BM25 candidates of an index with both views (``openbook.index.fusion``), the encoder still
learning through the dense part of the fused score. :func:`make_retrieval` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from openbook.index import Encoder, LoadedIndex
from openbook.index.engine import RetrievalMode
from openbook.index.fusion import top_k_columns
from openbook.index.request import SearchRequest
from openbook.types import Passage


class DenseRetrieval:
    def __init__(self, index: LoadedIndex, encoder: Encoder, k: int) -> None:
        index.check_encoder(encoder)
        self.index = index
        self.encoder = encoder
        self.k = k

    def retrieve_with_scores(
        self, questions: Sequence[str], *, grad: bool
    ) -> tuple[list[list[Passage]], Tensor]:
        """Top-k passages per question and their scores, differentiable w.r.t. the encoder.

        q = E_q(x)                    (B, d)     query vectors; grad flows here iff ``grad``
        hits = MIPS(q, k)                        the search itself is not differentiable
        D = stored vectors of hits    (B, k, d)  constants (frozen document encoder)
        doc_scores = c · D @ q        (B, k)     s(z, x) = c d(z)·q(x); p(z|x) = softmax_k(s)

        c is the index's ``score_scale``, so the prior trained here is the one the services use.
        """
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            q = self.encoder.encode_tensor(list(questions)).float()  # (B, d)
        hits = self.index.search(
            SearchRequest(
                k=self.k,
                query_vectors=q.detach().cpu().numpy().astype(np.float32),
                return_vectors=True,
            )
        )
        if any(len(h) != self.k for h in hits):
            raise RuntimeError(f"index {self.index.name!r} returned fewer than k={self.k} hits")
        docs = torch.from_numpy(np.stack([np.stack([_vector(p) for p in h]) for h in hits]))
        docs = docs.to(q.device)  # (B, k, d)
        doc_scores = torch.bmm(docs, q.unsqueeze(2)).squeeze(2)  # (B, k)
        return hits, doc_scores * self.index.manifest.score_scale

    def search(self, questions: Sequence[str]) -> list[list[Passage]]:
        """Top-k without gradients (dev evaluation); ``Passage.score`` is c d(z)·q(x)."""
        return self.index.search(
            SearchRequest(k=self.k, query_vectors=self.encoder.encode(list(questions)))
        )


class HybridRetrieval:
    """Retrieval with the index's fused prior (dense + BM25), the interface of
    :class:`DenseRetrieval`.

    The BM25 part of the score does not depend on the encoder, so the gradient of
    ``s = w_d·d(z)·q(x) + w_b·bm25(z, x)`` w.r.t. q(x) is the dense one scaled by w_d: the
    query encoder trains through the dense part of the same prior the services use.
    """

    def __init__(self, index: LoadedIndex, encoder: Encoder, k: int) -> None:
        index.check_encoder(encoder)
        index.retrieval_mode("hybrid")  # ValueError "retrieval: ..." without both views
        self.index = index
        self.encoder = encoder
        self.k = k
        self.fusion = index.fusion

    def retrieve_with_scores(
        self, questions: Sequence[str], *, grad: bool
    ) -> tuple[list[list[Passage]], Tensor]:
        """Fused top-k passages per question and their scores, differentiable w.r.t. the
        encoder.

        q = E_q(x)                    (B, d)     grad flows here iff ``grad``
        cands = dense top N ∪ BM25 top N         N = max(k, fusion.candidates); not differentiable
        D = stored vectors of the top k (B, k, d) by the fused score, constants
        b = their BM25 scores         (B, k)     constants
        doc_scores = w_d·D @ q + w_b·b (B, k)    = Passage.score of the services' hybrid search
        """
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            q = self.encoder.encode_tensor(list(questions)).float()  # (B, d)
        q_np = q.detach().cpu().numpy().astype(np.float32)
        cands = self.index.hybrid_candidates(
            list(questions), max(self.k, self.fusion.candidates), query_vectors=q_np
        )
        cols = top_k_columns(self.fusion, cands, self.k)  # (B, k)
        rows = np.take_along_axis(cands.rows, cols, axis=1)
        if cols.shape[1] != self.k or (rows < 0).any():
            raise RuntimeError(f"index {self.index.name!r} returned fewer than k={self.k} hits")
        bm25 = torch.from_numpy(np.take_along_axis(cands.bm25, cols, axis=1)).to(q.device)
        vecs = self.index.get_vectors(rows.ravel()).reshape(*rows.shape, -1)  # (B, k, d)
        docs = torch.from_numpy(vecs).to(q.device)
        dense = torch.bmm(docs, q.unsqueeze(2)).squeeze(2)  # (B, k)
        doc_scores = self.fusion.dense_weight * dense + self.fusion.bm25_weight * bm25
        texts = self.index.get_passages(rows.ravel().tolist())
        flat_scores = doc_scores.detach().cpu().numpy().ravel()
        hits = [
            [
                Passage(p.id, p.title, p.text, score=float(flat_scores[i * self.k + j]), vector=v)
                for j, (p, v) in enumerate(
                    zip(texts[i * self.k : (i + 1) * self.k], vecs[i], strict=True)
                )
            ]
            for i in range(len(rows))
        ]
        return hits, doc_scores

    def search(self, questions: Sequence[str]) -> list[list[Passage]]:
        """Fused top-k without gradients (dev evaluation); ``Passage.score`` is ``s``."""
        qs = list(questions)
        return self.index.search(
            SearchRequest(
                qs, k=self.k, query_vectors=self.encoder.encode(qs), retrieval=RetrievalMode.HYBRID
            )
        )


def make_retrieval(
    index: LoadedIndex, encoder: Encoder, k: int, retrieval: str | None = None
) -> DenseRetrieval | HybridRetrieval:
    """The training retrieval for ``retrieval`` (None: the index's default: hybrid where it
    has a bm25 view too). bm25 alone gives no gradient to the encoder and is refused."""
    mode = index.retrieval_mode(retrieval)
    if mode == "hybrid":
        return HybridRetrieval(index, encoder, k)
    if mode == "dense":
        return DenseRetrieval(index, encoder, k)
    raise ValueError(f"retrieval: {mode} cannot train a query encoder; use dense or hybrid")


def _vector(passage: Passage) -> np.ndarray:
    """A hit's document vector, which a search with ``return_vectors`` always sets."""
    if passage.vector is None:
        raise RuntimeError(f"passage {passage.id!r} came back without its vector")
    return passage.vector
