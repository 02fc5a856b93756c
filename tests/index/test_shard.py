"""split_index / merge_results: shards merged by score reproduce the unsharded index."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from openbook.index import (
    IndexLoadError,
    LoadedIndex,
    build_index,
    open_index,
    split_index,
)
from openbook.index import shard as shard_mod
from openbook.index.cli import app
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.types import Passage
from openbook_gateway.retrieval import merge_results
from openbook_testkit.index import QUESTIONS, random_vectors, write_vector_index

K = 10


def _vectors(n: int, dim: int, seed: int) -> np.ndarray:
    # Spread norms: inner-product order differs from cosine order.
    scale = np.random.default_rng(seed + 100).uniform(0.5, 2.0, (n, 1))
    return (random_vectors(n, dim, seed=seed) * scale).astype(np.float32)


def _open_all(paths: list[Path]) -> list[LoadedIndex]:
    return [open_index(p, verify=True) for p in paths]


def _merged_vectors(shards: list[LoadedIndex], q: np.ndarray, k: int) -> list[list[Passage]]:
    return merge_results([s.search(SearchRequest(k=k, query_vectors=q)) for s in shards], k)


def _assert_same(got: list[list[Passage]], want: list[list[Passage]]) -> None:
    assert [[p.id for p in hits] for hits in got] == [[p.id for p in hits] for hits in want]
    for g, w in zip(got, want, strict=True):  # per query: bm25 may find fewer than k
        np.testing.assert_allclose([p.score for p in g], [p.score for p in w], atol=1e-5)


def _check_shards(parent: LoadedIndex, shards: list[LoadedIndex], n: int) -> None:
    pm = parent.manifest
    assert sum(len(s) for s in shards) == len(parent)
    offset = 0
    for i, s in enumerate(shards):
        m = s.manifest
        assert (m.name, m.encoder, m.query_encoder, m.dim) == (
            pm.name,
            pm.encoder,
            pm.query_encoder,
            pm.dim,
        )
        assert m.index_type == pm.index_type
        assert m.shard == {
            "index": i,
            "count": n,
            "row_offset": offset,
            "parent_count": pm.count,
            "parent_checksum": pm.checksum,
        }
        rows = list(range(m.count))
        parent_rows = list(range(offset, offset + m.count))
        assert [p.id for p in s.get_passages(rows)] == [
            p.id for p in parent.get_passages(parent_rows)
        ]
        if pm.dense:
            np.testing.assert_array_equal(s.get_vectors(rows), parent.get_vectors(parent_rows))
        offset += m.count


def test_flat_random_merge_equals_unsharded(tmp_path: Path) -> None:
    src = write_vector_index(tmp_path / "vec", _vectors(1000, 16, seed=1))
    paths = split_index(src, 3, tmp_path / "shards", progress=False)
    assert paths == [tmp_path / "shards" / f"shard-{i}" / "vec" for i in range(3)]
    assert not (tmp_path / ".shards.partial").exists()
    q = random_vectors(20, 16, seed=2)
    with open_index(src) as parent:
        shards = _open_all(paths)
        _check_shards(parent, shards, 3)
        assert [len(s) for s in shards] == [333, 333, 334]
        _assert_same(
            _merged_vectors(shards, q, K), parent.search(SearchRequest(k=K, query_vectors=q))
        )
        # k beyond a shard's size: shards return what they have, the merge still matches.
        _assert_same(
            _merged_vectors(shards, q[:3], 400),
            parent.search(SearchRequest(k=400, query_vectors=q[:3])),
        )
        for s in shards:
            s.close()


def test_flat_minilm_facts(facts_index_dir: Path, facts_index: LoadedIndex, tmp_path: Path):
    paths = split_index(facts_index_dir, 4, tmp_path / "s", progress=False)
    shards = _open_all(paths)
    _check_shards(facts_index, shards, 4)
    questions = list(QUESTIONS.values())
    for retrieval in ("hybrid", "dense", "bm25"):  # every view merges exactly
        hits = [s.search(SearchRequest(questions, k=5, retrieval=retrieval)) for s in shards]
        merged = merge_results(hits, 5)
        _assert_same(merged, facts_index.search(SearchRequest(questions, k=5, retrieval=retrieval)))
    assert [hits[0].id for hits in merged] == list(QUESTIONS)
    for s in shards:
        s.close()


@pytest.mark.parametrize(("index_type", "min_recall"), [("hnsw", 0.95), ("hnsw-sq8", 0.9)])
def test_hnsw_shards_recall(tmp_path: Path, index_type: str, min_recall: float) -> None:
    x = _vectors(2000, 32, seed=3)
    src = write_vector_index(tmp_path / "h", x, index_type, hnsw_m=16, ef_search=64)
    paths = split_index(src, 4, tmp_path / "shards", progress=False)
    shards = _open_all(paths)
    with open_index(src) as parent:
        _check_shards(parent, shards, 4)
    q = random_vectors(50, 32, seed=4)
    truth = np.argsort(-(q @ x.T), axis=1)[:, :K]
    merged = _merged_vectors(shards, q, K)
    ids = [[int(p.id[1:]) for p in hits] for hits in merged]  # ids are "r<row>"
    recall = np.mean([len(set(g) & set(t)) / K for g, t in zip(ids, truth, strict=True)])
    assert recall >= min_recall
    for s in shards:
        assert s.manifest.index_params["ef_search"] == 64
        s.close()


def test_ivfpq_shards_reuse_parent_quantizer(tmp_path: Path) -> None:
    # Same coarse centroids and PQ codebooks: each shard probes the lists the parent probes and
    # scores each vector as the parent does, so merged results are the parent's.
    src = write_vector_index(tmp_path / "pq", _vectors(2000, 16, seed=5), "ivfpq", pq_m=4, nprobe=4)
    paths = split_index(src, 3, tmp_path / "shards", progress=False)
    shards = _open_all(paths)
    q = random_vectors(20, 16, seed=6)
    with open_index(src) as parent:
        for s in shards:
            assert s.manifest.index_params == parent.manifest.index_params
        _assert_same(
            _merged_vectors(shards, q, K), parent.search(SearchRequest(k=K, query_vectors=q))
        )
    for s in shards:
        s.close()


def test_bm25_shards(facts_jsonl: Path, tmp_path: Path) -> None:
    # Shards keep the parent's BM25 scores (its IDF and average length): merges are exact.
    src = tmp_path / "bm"
    build_index(
        [facts_jsonl], src, IndexSpec(name="bm", index_type="bm25"), BuildOptions(progress=False)
    )
    paths = split_index(src, 3, tmp_path / "shards", progress=False)
    shards = _open_all(paths)
    with open_index(src) as parent:
        _check_shards(parent, shards, 3)
        assert all(s.manifest.index_params == parent.manifest.index_params for s in shards)
        questions = [*QUESTIONS.values(), "zzzqqq"]
        for k in (1, 3, 10):
            merged = merge_results([s.search(SearchRequest(questions, k=k)) for s in shards], k)
            _assert_same(merged, parent.search(SearchRequest(questions, k=k)))
    merged = merge_results(
        [s.search(SearchRequest(["Who wrote Hamlet?"], k=3)) for s in shards], 3
    )[0]
    assert merged[0].id == "p21"
    assert all(a.score >= b.score > 0 for a, b in zip(merged, merged[1:], strict=False))
    for s in shards:
        s.close()


def _p(pid: str, score: float) -> Passage:
    return Passage(pid, "", "", score=score)


def test_merge_results_ties_dedupe_and_errors() -> None:
    a = [[_p("a1", 3.0), _p("a2", 1.0)], []]
    b = [[_p("b1", 3.0), _p("b2", 2.0), _p("a1", 0.5)], [_p("b3", 1.0)]]
    merged = merge_results([a, b], 3)
    assert [p.id for p in merged[0]] == ["a1", "b1", "b2"]  # tie: shard order
    assert [p.id for p in merged[1]] == ["b3"]
    assert [p.id for p in merge_results([b, a], 5)[0]] == ["b1", "a1", "b2", "a2"]
    assert merge_results([], 3) == []
    with pytest.raises(ValueError, match="different numbers of queries"):
        merge_results([a, b[:1]], 3)
    with pytest.raises(ValueError, match="k must be"):
        merge_results([a], 0)


def test_split_errors_and_atomicity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_vector_index(tmp_path / "v", _vectors(10, 4, seed=7))
    with pytest.raises(ValueError, match="at least 2 shards"):
        split_index(src, 1, tmp_path / "o")
    with pytest.raises(ValueError, match="cannot split 10 passages into 11"):
        split_index(src, 11, tmp_path / "o", progress=False)
    with pytest.raises(IndexLoadError, match="index directory not found"):
        split_index(tmp_path / "nope", 2, tmp_path / "o")
    with pytest.raises(ValueError, match="inside the source"):
        split_index(src, 2, src / "shards")

    real = shard_mod._write_shard

    def fail_second(*args, **kw):
        if args[5]["index"] == 1:
            raise RuntimeError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(shard_mod, "_write_shard", fail_second)
    with pytest.raises(RuntimeError, match="disk full"):
        split_index(src, 2, tmp_path / "o", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]  # nothing half-written
    monkeypatch.undo()

    paths = split_index(src, 2, tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="already exists"):
        split_index(src, 2, tmp_path / "o")
    with pytest.raises(ValueError, match="already shard 0 of 2"):
        split_index(paths[0], 2, tmp_path / "o2")


def test_manifest_shard_field(tmp_path: Path) -> None:
    src = write_vector_index(tmp_path / "v", _vectors(10, 4, seed=8))
    assert "shard" not in json.loads((src / "manifest.json").read_text())  # absent = unsharded
    with open_index(src) as idx:
        assert idx.manifest.shard is None
    path = split_index(src, 2, tmp_path / "o", progress=False)[1]
    data = json.loads((path / "manifest.json").read_text())
    data["shard"]["index"] = 2
    (path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(IndexLoadError, match="invalid shard field"):
        open_index(path)


def test_cli_shard(tmp_path: Path) -> None:
    runner = CliRunner()
    src = write_vector_index(tmp_path / "v", _vectors(10, 4, seed=9))
    out = tmp_path / "o"
    r = runner.invoke(app, ["shard", str(src), "--shards", "2", "--out-root", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.split() == [str(out / "shard-0" / "v"), str(out / "shard-1" / "v")]
    r = runner.invoke(app, ["info", str(out / "shard-1" / "v"), "--verify"])
    assert r.exit_code == 0 and json.loads(r.stdout)["shard"]["row_offset"] == 5

    for args, msg in [
        ([str(src), "--shards", "1", "--out-root", str(tmp_path / "x")], "at least 2 shards"),
        ([str(src), "--shards", "11", "--out-root", str(tmp_path / "x")], "cannot split 10"),
        ([str(tmp_path), "--shards", "2", "--out-root", str(tmp_path / "x")], "manifest.json"),
        ([str(src), "--shards", "2", "--out-root", str(out)], "already exists"),
    ]:
        r = runner.invoke(app, ["shard", *args])
        assert r.exit_code == 2, r.output
        assert "error: " in r.output and msg in r.output and "Traceback" not in r.output
