"""Approximate index types against exact search, on small random vectors."""

from __future__ import annotations

import numpy as np
import pytest

from openbook.index import faiss_index
from openbook_testkit.index import random_vectors

N, DIM, NQ, K = 3000, 32, 50, 10


def _recall(got: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(g) & set(t)) / K for g, t in zip(got, truth, strict=True)]))


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Un-normalised vectors with varied norms: the case where MIPS != nearest neighbour.
    x = random_vectors(N, DIM, seed=1) * np.random.default_rng(2).uniform(0.5, 2.0, (N, 1))
    q = random_vectors(NQ, DIM, seed=3)
    flat, params = faiss_index.build_faiss(x.astype(np.float32), "flat", {})
    _, truth = faiss_index.search(flat, "flat", params, q, K)
    np.testing.assert_array_equal(truth[:, 0], np.argmax(q @ x.T, axis=1))
    return x.astype(np.float32), q, truth


@pytest.mark.parametrize(
    ("index_type", "extra", "min_recall"),
    [
        ("hnsw", {}, 0.95),
        ("hnsw-sq8", {}, 0.9),
        ("ivfpq", {"pq_m": 16, "nprobe": 64}, 0.6),
        # DPR's augmentation is exact in score but the graph is harder to search.
        ("hnsw", {"hnsw_transform": "mips_to_l2", "ef_search": 256}, 0.6),
        ("hnsw-sq8", {"hnsw_transform": "mips_to_l2", "ef_search": 256}, 0.6),
    ],
)
def test_recall_vs_flat(data, index_type: str, extra: dict, min_recall: float) -> None:
    x, q, truth = data
    kw = {"hnsw_m": 16, "ef_search": 64, **extra}
    params = faiss_index.default_params(index_type, N, DIM, **kw)
    index, params = faiss_index.build_faiss(x, index_type, params)
    scores, rows = faiss_index.search(index, index_type, params, q, K)
    assert _recall(rows, truth) >= min_recall
    assert np.all(np.diff(scores, axis=1) <= 1e-4)  # best first
    exact = np.take_along_axis(q @ x.T, rows, axis=1)
    tol = 1e-3 if index_type == "hnsw" else 0.35 * float(np.abs(exact).max())
    np.testing.assert_allclose(scores, exact, atol=tol)


def test_mips_augmentation_preserves_order() -> None:
    x = random_vectors(200, 8, seed=5) * np.arange(1, 201, dtype=np.float32)[:, None] / 50
    q = random_vectors(5, 8, seed=6)
    phi = faiss_index.max_sq_norm(x)
    xa, qa = faiss_index.augment_documents(x, phi), faiss_index.augment_queries(q)
    np.testing.assert_allclose(np.linalg.norm(xa, axis=1) ** 2, phi, rtol=1e-4)
    l2 = ((qa[:, None, :] - xa[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(np.argsort(l2, 1)[:, :5], np.argsort(-(q @ x.T), 1)[:, :5])


def test_exact_rerank_lifts_compressed_recall(data) -> None:
    x, q, truth = data
    params = faiss_index.default_params("ivfpq", N, DIM, pq_m=8, nprobe=64)
    index, params = faiss_index.build_faiss(x, "ivfpq", params)
    _, plain = faiss_index.search(index, "ivfpq", params, q, K)
    _, cand = faiss_index.search(index, "ivfpq", params, q, K * 8)
    scores, rows = faiss_index.rerank_exact(q, cand, x, K)
    assert _recall(rows, truth) > _recall(plain, truth) + 0.1
    np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, rows, axis=1), rtol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)
