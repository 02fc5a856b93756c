"""bench/index/scale.py (issue 41, item 4): the command end to end at a tiny size, the
synthetic corpus's determinism, the streamed exact top-k, and the resume of an interrupted
build (same shards, same ground truth as an uninterrupted one)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.index import scale_build
from bench.index.scale_build import ScaleConfig, ScaleRun, build
from bench.index.scale_data import SyntheticCorpus
from bench.index.scale_truth import RunningTopK, recall_at_k
from openbook.index.loaded import open_index
from openbook.index.request import SearchRequest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "passages",
    "shards",
    "build_s",
    "disk_bytes",
    "rss_bytes",
    "p50_ms_k5",
    "p99_ms_k5",
    "p50_ms_k100",
    "p99_ms_k100",
    "recall_at_100",
)


def test_scale_command_end_to_end(tmp_path):
    out = tmp_path / "scale.json"
    args = [
        sys.executable,
        "bench/index/scale.py",
        "--passages",
        "20000",
        "--shards",
        "2",
        "--queries",
        "20",
        "--nlist",
        "64",
        "--train-size",
        "8192",
        "--sweep",
        "4:0",
        "--no-progress",
        "--work",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    for name in FIELDS:
        assert name in report, name
    assert report["passages"] == 20000 and report["shards"] == 2
    assert report["build_s"] > 0
    files = report["disk_bytes_by_file"]
    assert files["vectors.npy"] >= 20000 * 768 * 4  # float32 vectors, as every files index
    assert report["disk_bytes"] >= sum(files.values())
    assert len(report["rss_bytes"]) == 2 and all(r > 0 for r in report["rss_bytes"])
    for k in (5, 100):
        assert 0 < report[f"p50_ms_k{k}"] <= report[f"p99_ms_k{k}"]
    assert 0.0 <= report["recall_at_100"] <= 1.0
    assert report["recall_at_100"] > 0.2  # far above chance (100 of 20,000 rows)
    assert report["sweep"][0]["nprobe"] == 4
    # each shard is a served files index: the project's loader opens it, checksums verified
    for i in range(2):
        shard = tmp_path / "work" / "index" / f"shard-{i}" / "scale"
        with open_index(shard, verify=True) as index:
            assert index.manifest.shard["index"] == i
            assert len(index) == 10000
    # a second run re-measures without building again
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(out.read_text())["build_s"] == report["build_s"]


def test_corpus_is_the_same_whatever_the_chunking():
    corpus = SyntheticCorpus(count=10_000, dim=32, noise_rank=8, block_rows=1000)
    whole = corpus.rows(0, 10_000)
    assert np.array_equal(corpus.rows(1500, 4321), whole[1500:4321])
    rows = np.array([9999, 3, 4500, 3])
    assert np.array_equal(corpus.pick(rows), whole[rows])
    q1, src1 = corpus.queries(7, seed=3)
    q2, src2 = corpus.queries(7, seed=3)
    assert np.array_equal(q1, q2) and np.array_equal(src1, src2)
    assert not np.array_equal(
        SyntheticCorpus(count=10_000, dim=32, noise_rank=8, seed=1).rows(0, 5), whole[:5]
    )


def test_running_top_k_is_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5000, 16)).astype(np.float32)
    q = rng.standard_normal((9, 16)).astype(np.float32)
    top = RunningTopK(q, 50)
    for s in range(0, 5000, 700):
        top.add(x[s : s + 700], s)
    exact = np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :50]
    assert np.array_equal(top.rows, exact)
    assert recall_at_k(exact.tolist(), top.rows) == 1.0
    with pytest.raises(ValueError, match="out of order"):
        top.add(x[:10], 0)


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("vectors_dtype", ["float32", "float16"])
def test_interrupted_build_resumes_to_the_same_index(tmp_path, monkeypatch, vectors_dtype):
    config = ScaleConfig(
        passages=30_000,
        shards=2,
        dim=32,
        nlist=16,
        pq_m=8,
        queries=12,
        vectors_dtype=vectors_dtype,
    )
    monkeypatch.setattr(scale_build, "STEP_ROWS", 4096)
    monkeypatch.setattr(scale_build, "SAVE_EVERY_S", 0.0)
    straight = build(ScaleRun(tmp_path / "straight", config), progress=False)

    real_rows = SyntheticCorpus.rows
    calls = {"n": 0}

    def rows_then_stop(self, start, stop):
        calls["n"] += 1
        if calls["n"] == 6:  # in shard 1, after shard 0 was published
            raise _Interrupted
        return real_rows(self, start, stop)

    monkeypatch.setattr(SyntheticCorpus, "rows", rows_then_stop)
    with pytest.raises(_Interrupted):
        build(ScaleRun(tmp_path / "resumed", config), progress=False)
    assert (tmp_path / "resumed" / "index" / "shard-0" / "scale").is_dir()
    assert not (tmp_path / "resumed" / "index" / "shard-1").exists()
    monkeypatch.setattr(SyntheticCorpus, "rows", real_rows)
    calls["n"] = 0
    resumed = build(ScaleRun(tmp_path / "resumed", config), progress=False)

    assert np.array_equal(resumed.truth, straight.truth)
    for a, b in zip(straight.shard_dirs, resumed.shard_dirs, strict=True):
        with open_index(a) as ia, open_index(b) as ib:
            assert ia.manifest.checksum == ib.manifest.checksum or (
                ia.manifest.files["index.faiss"] == ib.manifest.files["index.faiss"]
                and ia.manifest.files["vectors.npy"] == ib.manifest.files["vectors.npy"]
            )
            assert ia.manifest.files["vectors.npy"] == ib.manifest.files["vectors.npy"]
            assert str(np.load(a / "vectors.npy", mmap_mode="r").dtype) == vectors_dtype
            hits_a = ia.search(SearchRequest(k=10, query_vectors=straight.queries))
            hits_b = ib.search(SearchRequest(k=10, query_vectors=straight.queries))
            assert [[p.id for p in h] for h in hits_a] == [[p.id for p in h] for h in hits_b]
    with pytest.raises(ValueError, match="holds a run of"):
        ScaleRun(tmp_path / "resumed", ScaleConfig(passages=30_001, shards=2, dim=32, pq_m=8))
    # nprobe and rerank are set per search: a finished run is re-measured with others
    other = dataclasses.replace(config, nprobe=2, rerank=0)
    assert ScaleRun(tmp_path / "resumed", other).state["config"]["nprobe"] == 2


def test_an_hnsw_coarse_quantizer_is_built_into_every_shard(tmp_path):
    config = ScaleConfig(
        passages=12_000,
        shards=2,
        dim=32,
        nlist=32,
        pq_m=8,
        nprobe=8,
        queries=10,
        coarse_quantizer="hnsw",
        hnsw_m=8,
        ef_search=8,
        n_centres=64,
    )
    built = build(ScaleRun(tmp_path / "run", config), progress=False)
    found = [[] for _ in range(len(built.queries))]
    for d in built.shard_dirs:
        with open_index(d) as index:
            params = index.manifest.index_params
            assert (params["coarse_quantizer"], params["hnsw_m"]) == ("hnsw", 8)
            for i, hits in enumerate(
                index.search(SearchRequest(k=100, query_vectors=built.queries))
            ):
                found[i].extend((p.score, scale_build.row_of(p.id)) for p in hits)
    merged = [[r for _, r in sorted(f, reverse=True)[:100]] for f in found]
    assert recall_at_k(merged, built.truth) > 0.3  # 8 of 32 lists, far above chance


def test_each_rows_centre_is_the_one_it_was_drawn_around():
    corpus = SyntheticCorpus(count=6000, n_centres=16)
    rows = np.array([0, 17, 4095, 4096, 5999, 17])
    centres, _, _ = corpus._model
    nearest = np.argmax(corpus.pick(rows) @ centres.T, axis=1)  # clusters far apart at 768-d
    assert np.array_equal(corpus.centres_of(rows), nearest)
    assert corpus.cluster_sizes().sum() == pytest.approx(6000)
    from bench.index.scale_by_cluster import by_size

    bins = by_size(np.array([100.0, 6000.0, 7000.0]), np.array([1.0, 0.5, 0.7]))
    assert [(b["from"], b["queries"]) for b in bins] == [(0, 1), (5000, 2)]
    assert bins[1]["recall_at_100"] == pytest.approx(0.6)


def test_the_coarse_assignment_measure_compares_the_graph_with_the_exact_quantizer(tmp_path):
    from bench.index import coarse_assignment

    out = tmp_path / "assign.json"
    argv = "--passages 20000 --nlist 32 --train-size 2000 --vectors 500 --queries 20"
    assert (
        coarse_assignment.main([*argv.split(), "--ef", "4,64", "--nprobe", "4", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    low, high = result["hnsw"]
    assert [low["ef_search"], high["ef_search"]] == [4, 64]
    for row in (low, high):
        assert 0.0 <= row["assigned_as_exact"] <= 1.0 and 0.0 <= row["probe_found_of_exact"] <= 1.0
    # with more candidates than the 32 centroids the graph finds exactly what a flat one does
    assert high["assigned_as_exact"] == 1.0 and high["probe_found_of_exact"] == 1.0
