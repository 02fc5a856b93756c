"""Approximate index types against exact search, on small random vectors."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from openbook.index import arrays, faiss_index
from openbook.index.arrays import open_array
from openbook.index.spec import AnnParams
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
    params = faiss_index.default_params(index_type, N, DIM, AnnParams(**kw))
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
    params = faiss_index.default_params("ivfpq", N, DIM, AnnParams(pq_m=8, nprobe=64))
    index, params = faiss_index.build_faiss(x, "ivfpq", params)
    _, plain = faiss_index.search(index, "ivfpq", params, q, K)
    _, cand = faiss_index.search(index, "ivfpq", params, q, K * 8)
    scores, rows = faiss_index.rerank_exact(q, cand, x, K)
    assert _recall(rows, truth) > _recall(plain, truth) + 0.1
    np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, rows, axis=1), rtol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)


def test_ivfpq_with_an_hnsw_coarse_quantizer_searches_like_the_flat_one(data, tmp_path) -> None:
    """coarse_quantizer="hnsw": the lists' centroids in a graph; saved, read back and searched
    with its efSearch (at least nprobe), it finds what the exact assignment finds."""
    x, q, truth = data
    kw = {"nlist": 32, "pq_m": 8, "nprobe": 8, "hnsw_m": 8, "ef_search": 4}
    flat_params = faiss_index.default_params("ivfpq", N, DIM, AnnParams(**kw))
    params = faiss_index.default_params("ivfpq", N, DIM, AnnParams(coarse_quantizer="hnsw", **kw))
    assert flat_params["coarse_quantizer"] == "flat" and "hnsw_m" not in flat_params
    assert (params["coarse_quantizer"], params["hnsw_m"], params["ef_search"]) == ("hnsw", 8, 4)
    index, params = faiss_index.build_faiss(x, "ivfpq", params)
    flat, flat_params = faiss_index.build_faiss(x, "ivfpq", flat_params)

    faiss_index.write(index, tmp_path / "index.faiss")
    again = faiss_index.read(tmp_path / "index.faiss")
    faiss_index.configure(again, "ivfpq", params)
    ivf = faiss.extract_index_ivf(again)
    graph = faiss.downcast_index(ivf.quantizer)
    assert isinstance(graph, faiss.IndexHNSWFlat) and graph.ntotal == 32
    assert (graph.hnsw.efSearch, ivf.nprobe) == (8, 8)  # at least nprobe: all 8 lists found
    faiss_index.prepare_add(again, "ivfpq", params)
    assert graph.hnsw.efSearch == 4  # adding: the best of ef_search candidates
    faiss_index.configure(again, "ivfpq", params)
    _, rows = faiss_index.search(again, "ivfpq", params, q, K)
    _, flat_rows = faiss_index.search(flat, "ivfpq", flat_params, q, K)
    assert _recall(rows, truth) >= _recall(flat_rows, truth) - 0.1
    assert _recall(rows, truth) >= 0.3  # 8 of 32 lists: far above chance

    # a shard's copy (fill_trained) keeps the graph and its assignment
    template = faiss.clone_index(index)
    template.reset()
    filled = faiss_index.fill_trained(template, x, "ivfpq", params)
    _, filled_rows = faiss_index.search(filled, "ivfpq", params, q, K)
    np.testing.assert_array_equal(filled_rows, rows)


def test_an_unknown_coarse_quantizer_is_refused() -> None:
    with pytest.raises(ValueError, match="^coarse_quantizer"):
        faiss_index.default_params("ivfpq", N, DIM, AnnParams(coarse_quantizer="ivf"))


def test_rerank_from_a_file_map_reads_the_rows_and_scores_the_same(data, tmp_path) -> None:
    """rerank_exact on a memory-mapped vectors.npy (what the loader serves) reads the
    candidates' rows from the file (gather_rows: pread, the map left unfaulted) and scores
    exactly as in memory."""
    x, q, _ = data
    np.save(tmp_path / "vectors.npy", x.astype(np.float16))
    mapped = open_array(tmp_path / "vectors.npy")
    cand = np.random.default_rng(4).integers(-1, N, (len(q), 40))
    cand[:, -1] = N - 1  # the file's last row
    got = faiss_index.rerank_exact(q, cand, mapped, K)
    want = faiss_index.rerank_exact(q, cand, np.asarray(mapped), K)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    rows = np.array([N - 1, 0, 7, 7, 3])
    gathered = faiss_index.gather_rows(mapped, rows)
    assert gathered.dtype == np.float32
    np.testing.assert_array_equal(gathered, np.asarray(mapped[rows], dtype=np.float32))


def test_rows_gathered_from_a_file_are_not_mapped_into_the_process(tmp_path) -> None:
    """The point of reading rows with pread: a shard's RSS is its own memory, not the pages of
    its vectors.npy that re-ranking touched (the 21M run: 15 GB of mapped file pages)."""
    rows, dim = 65_536, 256  # 64 MiB of float32
    np.save(tmp_path / "vectors.npy", np.ones((rows, dim), dtype=np.float32))
    mapped = open_array(tmp_path / "vectors.npy")

    def rss_file_kib() -> int:
        status = Path("/proc/self/status").read_text()
        return int(
            next(line for line in status.splitlines() if line.startswith("RssFile")).split()[1]
        )

    before = rss_file_kib()
    every_row = np.arange(0, rows, dtype=np.int64)
    assert float(faiss_index.gather_rows(mapped, every_row).sum()) == rows * dim
    assert rss_file_kib() - before < 8 * 1024  # not the file's 64 MiB


def test_rows_are_read_from_the_file_the_map_was_opened_on(tmp_path) -> None:
    """A swap, an adoption or a compaction renames or removes an index directory while a
    search still holds the old view: its rows come from the file it opened, and a view (a
    slice) of the map reads its own rows."""
    x = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    (tmp_path / "a").mkdir()
    np.save(tmp_path / "a" / "vectors.npy", x)
    mapped = open_array(tmp_path / "a" / "vectors.npy")
    assert arrays.file_of(mapped) is not None
    (tmp_path / "a").rename(tmp_path / "b")
    (tmp_path / "b" / "vectors.npy").unlink()
    np.testing.assert_array_equal(
        faiss_index.gather_rows(mapped, np.array([39, 0, 5])), x[[39, 0, 5]]
    )
    part = mapped[10:20]
    np.testing.assert_array_equal(faiss_index.gather_rows(part, np.array([0, 9])), x[[10, 19]])
    # an array mapped some other way is read through its map
    np.save(tmp_path / "c.npy", x)
    other = np.load(tmp_path / "c.npy", mmap_mode="r")
    assert arrays.file_of(other) is None
    np.testing.assert_array_equal(faiss_index.gather_rows(other, np.array([3])), x[[3]])
