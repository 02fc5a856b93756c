"""Retrieval inside the training loop: top-k with the *current* query encoder, scored with grad.

The index (and so every document vector) is frozen, as in the paper (§2.4): re-encoding
21M passages after each update would be prohibitive. Only q(x) changes, which still moves
p(z|x) because the scores are recomputed from q(x) with autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from openbook.index import Encoder, LoadedIndex
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
        hits = self.index.search_vectors(
            q.detach().cpu().numpy().astype(np.float32), self.k, return_vectors=True
        )
        if any(len(h) != self.k for h in hits):
            raise RuntimeError(f"index {self.index.name!r} returned fewer than k={self.k} hits")
        docs = torch.from_numpy(np.stack([np.stack([p.vector for p in h]) for h in hits]))
        docs = docs.to(q.device)  # (B, k, d)
        doc_scores = torch.bmm(docs, q.unsqueeze(2)).squeeze(2)  # (B, k)
        return hits, doc_scores * self.index.manifest.score_scale

    def search(self, questions: Sequence[str]) -> list[list[Passage]]:
        """Top-k without gradients (dev evaluation); ``Passage.score`` is c d(z)·q(x)."""
        return self.index.search_vectors(self.encoder.encode(list(questions)), self.k)
