from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from openbook.index import LoadedIndex, build_index, load_encoder, open_index
from openbook.index.request import SearchRequest
from openbook.index.spec import AnnParams, BuildOptions, IndexSpec
from openbook_testkit.index import FACTS, QUESTIONS, random_rows, write_jsonl


def test_flat_minilm_retrieves_answer_top1(facts_index: LoadedIndex) -> None:
    assert facts_index.manifest.count == len(FACTS) and facts_index.manifest.dim == 384
    ids, questions = zip(*QUESTIONS.items(), strict=True)
    results = facts_index.search(SearchRequest(list(questions), k=3))
    assert [hits[0].id for hits in results] == list(ids)
    for hits in results:
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True) and len(hits) == 3
        assert hits[0].title and hits[0].text and hits[0].vector is None


def test_scores_are_scaled_inner_products_and_vectors_by_row(facts_index: LoadedIndex) -> None:
    # MiniLM normalises its vectors: cosine scores get the scale it was trained with
    assert facts_index.manifest.score_scale == 20.0
    enc = load_encoder("all-MiniLM-L6-v2")
    q = enc.encode(["Who wrote Hamlet?"])
    (hits,) = facts_index.search(SearchRequest(k=2, query_vectors=q, return_vectors=True))
    for h in hits:
        assert h.vector is not None and h.vector.shape == (384,)
        assert h.score == pytest.approx(20.0 * float(q[0] @ h.vector), abs=1e-4)
    rows = facts_index.get_vectors([0, 29, 0])
    assert rows.shape == (3, 384) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[0], facts_index.get_vectors(["p00"])[0])
    with pytest.raises(IndexError):
        facts_index.get_vectors([30])


def test_manifest_contents(facts_index: LoadedIndex) -> None:
    m = facts_index.manifest
    assert (m.name, m.encoder, m.query_encoder, m.index_type) == (
        "facts",
        "all-MiniLM-L6-v2",
        "all-MiniLM-L6-v2",
        "flat",
    )
    # ... and the bm25 view of the same passages (hybrid retrieval, test_hybrid.py)
    assert {f for f in m.files if not f.startswith("bm25/")} == {
        "index.faiss",
        "passages.sqlite",
        "vectors.npy",
    }
    assert "bm25/params.index.json" in m.files and m.views == ["dense", "bm25"]
    assert m.normalize and m.created_at and len(m.checksum) == 64
    raw = json.loads((facts_index.path / "manifest.json").read_text())
    assert raw["format_version"] == 1 and raw["count"] == len(FACTS)


def test_passages_in_sqlite(facts_index: LoadedIndex) -> None:
    con = sqlite3.connect(facts_index.path / "passages.sqlite")
    assert con.execute("SELECT id, title FROM passages WHERE row=3").fetchone() == (
        "p03",
        "Python (programming language)",
    )
    con.close()


def test_bm25(facts_jsonl: Path, tmp_path: Path) -> None:
    m = build_index(
        [facts_jsonl],
        tmp_path / "bm",
        IndexSpec(name="bm", index_type="bm25"),
        BuildOptions(progress=False),
    )
    assert (m.encoder, m.dim, m.count) == (None, 0, len(FACTS))
    with open_index(tmp_path / "bm") as idx:
        res = idx.search(
            SearchRequest(["Who discovered penicillin?", "Hamlet Shakespeare", "zzzqqq"], k=2)
        )
        assert res[0][0].id == "p18" and res[1][0].id == "p21" and res[0][0].score > 0
        assert res[2] == []  # no shared term: no hits rather than zero-score noise
        with pytest.raises(ValueError, match="bm25"):
            idx.search(SearchRequest(k=1, query_vectors=np.zeros((1, 4), np.float32)))
        with pytest.raises(ValueError, match="bm25"):
            idx.get_vectors([0])


@pytest.mark.parametrize(
    ("index_type", "transform", "rerank"),
    [
        ("hnsw", "none", 0),
        ("hnsw", "mips_to_l2", 0),
        ("hnsw-sq8", "none", 0),
        ("ivfpq", "none", 0),
        ("ivfpq", "none", 3),
    ],
)
def test_dpr_build_all_dense_types(
    index_type: str, transform: str, rerank: int, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    ctx, q = dpr_dirs
    src = write_jsonl(tmp_path / "r.jsonl", random_rows(60))
    out = tmp_path / index_type
    m = build_index(
        [src],
        out,
        IndexSpec(
            name="dpr",
            encoder=str(ctx),
            query_encoder=str(q),
            index_type=index_type,
            ann=AnnParams(hnsw_transform=transform, rerank=rerank),
        ),
        BuildOptions(progress=False, shard_size=25),
    )
    assert (m.dim, m.count, m.normalize, m.score_scale) == (32, 60, False, 1.0)  # DPR: raw
    assert m.query_encoder == str(q.resolve()) and m.encoder == str(ctx.resolve())
    with open_index(out) as idx:
        q_enc = load_encoder(str(q))
        qv = q_enc.encode(["w1 w2 w3", "w4"])
        # The dense view's scores (the default would be hybrid: test_hybrid.py)
        hits = idx.search(
            SearchRequest(["w1 w2 w3", "w4"], k=5, retrieval="dense", return_vectors=True)
        )
        exact = qv @ idx.get_vectors(range(60)).T
        for i, row in enumerate(hits):
            assert len(row) == 5
            assert idx.get_vectors([h.id for h in row]).shape == (5, 32)
            if index_type == "hnsw" or idx.manifest.index_params.get("rerank"):
                # exact storage or exact re-ranking: scores are exact inner products
                for h in row:
                    assert h.score == pytest.approx(float(qv[i] @ h.vector), rel=1e-3, abs=1e-3)
                assert row[0].score == pytest.approx(float(exact[i].max()), rel=1e-3, abs=1e-3)


def test_query_encoder_dim_mismatch_at_build(
    facts_jsonl: Path, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"dim 32 != document encoder .* dim 384"):
        build_index(
            [facts_jsonl], tmp_path / "x", IndexSpec(name="x", query_encoder=str(dpr_dirs[1]))
        )
    assert not (tmp_path / "x").exists()


def test_duplicate_ids_and_bad_args(tmp_path: Path, facts_jsonl: Path) -> None:
    dup = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "title": "", "text": "x"}] * 2)
    with pytest.raises(ValueError, match="duplicate passage id 'a'"):
        build_index(
            [dup],
            tmp_path / "d",
            IndexSpec(name="d", index_type="bm25"),
            BuildOptions(progress=False),
        )
    with pytest.raises(ValueError, match="unknown index type"):
        build_index([facts_jsonl], tmp_path / "e", IndexSpec(name="e", index_type="lsh"))
    with pytest.raises(ValueError, match="no such file"):
        build_index([tmp_path / "missing.jsonl"], tmp_path / "e", IndexSpec(name="e"))
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no passages"):
        build_index(
            [empty],
            tmp_path / "e",
            IndexSpec(name="e", index_type="bm25"),
            BuildOptions(progress=False),
        )
    with pytest.raises(ValueError, match="pq_m=5 must divide the encoder dim 384"):
        build_index(
            [facts_jsonl],
            tmp_path / "e",
            IndexSpec(name="e", index_type="ivfpq", ann=AnnParams(pq_m=5)),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "empty.jsonl"]


def test_score_scale_can_be_set_and_is_validated(tmp_path: Path, facts_jsonl: Path) -> None:
    m = build_index(
        [facts_jsonl],
        tmp_path / "raw",
        IndexSpec(name="raw", score_scale=1.0),
        BuildOptions(progress=False),
    )
    assert m.score_scale == 1.0
    q = load_encoder("all-MiniLM-L6-v2").encode(["Who wrote Hamlet?"])
    with open_index(tmp_path / "raw") as idx:
        (hits,) = idx.search(SearchRequest(k=2, query_vectors=q, return_vectors=True))
        assert hits[0].score == pytest.approx(float(q[0] @ hits[0].vector), abs=1e-5)
    bm = build_index(
        [facts_jsonl],
        tmp_path / "bm",
        IndexSpec(name="bm", index_type="bm25"),
        BuildOptions(progress=False),
    )
    assert bm.score_scale == 1.0  # BM25 scores are left as they are
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="score_scale must be a positive number"):
            build_index([facts_jsonl], tmp_path / "bad", IndexSpec(name="bad", score_scale=bad))


def test_existing_out_dir_needs_overwrite(tmp_path: Path, facts_jsonl: Path) -> None:
    out = tmp_path / "o"
    build_index(
        [facts_jsonl], out, IndexSpec(name="one", index_type="bm25"), BuildOptions(progress=False)
    )
    with pytest.raises(ValueError, match="already exists"):
        build_index(
            [facts_jsonl],
            out,
            IndexSpec(name="two", index_type="bm25"),
            BuildOptions(progress=False),
        )
    build_index(
        [facts_jsonl],
        out,
        IndexSpec(name="two", index_type="bm25"),
        BuildOptions(progress=False, overwrite=True),
    )
    assert open_index(out).name == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no leftovers
