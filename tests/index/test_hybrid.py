"""Hybrid retrieval in the index layer: the dense + BM25 views of one index, the fused prior,
its fit on training questions, and that shards, imports and parallel builds keep both views."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from openbook.index import (
    RETRIEVAL_MODES,
    Fusion,
    LoadedIndex,
    build_index,
    fit_fusion,
    load_encoder,
    open_index,
    split_index,
    store_fusion,
)
from openbook.index.fusion import Question, fit_weights, marginal_log_likelihood, read_questions
from openbook.index.manifest import Manifest
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import FACTS, QUESTIONS, write_jsonl

TITLES = {pid: title for pid, title, _ in FACTS}


def _fact_questions() -> list[Question]:
    """The facts' questions, answered by their passage's title (it occurs in the passage)."""
    return [Question(q, (TITLES[pid],)) for pid, q in QUESTIONS.items()]


@pytest.fixture()
def hybrid_dir(facts_index_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the session's facts index (both views), safe to re-fit."""
    return Path(shutil.copytree(facts_index_dir, tmp_path / "facts"))


def test_build_keeps_both_views_by_default(facts_index: LoadedIndex) -> None:
    m = facts_index.manifest
    assert m.views == ["dense", "bm25"] and m.fusion is None
    assert any(rel.startswith("bm25/") for rel in m.files)
    assert facts_index.views == ("dense", "bm25")
    assert facts_index.default_retrieval == "hybrid"
    assert RETRIEVAL_MODES == ("dense", "bm25", "hybrid")
    # Unfitted: each view's own served score as a logit (fusion.py's docstring).
    assert facts_index.fusion == Fusion.default(m.score_scale)
    assert (facts_index.fusion.dense_weight, facts_index.fusion.bm25_weight) == (20.0, 1.0)


def test_no_bm25_and_bm25_only_builds(facts_jsonl: Path, tmp_path: Path) -> None:
    m = build_index(
        [facts_jsonl], tmp_path / "d", IndexSpec(name="d", bm25=False), BuildOptions(progress=False)
    )
    assert m.views == ["dense"] and not any(r.startswith("bm25/") for r in m.files)
    with open_index(tmp_path / "d") as idx:
        assert idx.views == ("dense",) and idx.default_retrieval == "dense"
        with pytest.raises(ValueError, match=r"^retrieval: index 'd' has no hybrid .*dense\)"):
            idx.search(SearchRequest(["Who wrote Hamlet?"], k=2, retrieval="hybrid"))
        with pytest.raises(ValueError, match=r"^retrieval: index 'd' has no bm25"):
            idx.search(SearchRequest(["Who wrote Hamlet?"], k=2, retrieval="bm25"))
        with pytest.raises(ValueError, match="^retrieval: .*no hybrid fusion|has views"):
            _ = idx.fusion
    m = build_index(
        [facts_jsonl],
        tmp_path / "b",
        IndexSpec(name="b", index_type="bm25"),
        BuildOptions(progress=False),
    )
    assert m.views == ["bm25"]
    with open_index(tmp_path / "b") as idx:
        assert idx.default_retrieval == "bm25"
        with pytest.raises(ValueError, match=r"^retrieval: index 'b' has no dense .*bm25\)"):
            idx.search(SearchRequest(["Who wrote Hamlet?"], k=2, retrieval="dense"))
        with pytest.raises(ValueError, match=r"^retrieval: unknown mode 'sparse'"):
            idx.search(SearchRequest(["Who wrote Hamlet?"], k=2, retrieval="sparse"))


def test_manifest_round_trip_and_old_manifests(hybrid_dir: Path, tmp_path: Path) -> None:
    path = hybrid_dir / "manifest.json"
    m = Manifest.from_file(path)
    fusion = Fusion(3.0, 0.5, 20, {"questions": 2, "source": "x", "sha256": "0" * 64}, -0.7)
    m.fusion = fusion.to_dict()
    m.to_file(path)
    again = Manifest.from_file(path)
    assert again == m and Fusion.from_dict(again.fusion) == fusion

    # A manifest written before views existed: no "views", no "fusion" -> derived from the type.
    raw = json.loads(path.read_text())
    del raw["views"], raw["fusion"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    assert Manifest.from_file(old).views == ["dense"]
    raw["index_type"] = "bm25"
    old.write_text(json.dumps(raw))
    assert Manifest.from_file(old).views == ["bm25"]
    # ... and an index without views and without bm25/ opens as the dense index it was.
    d = tmp_path / "old-index"
    shutil.copytree(hybrid_dir, d)
    raw = json.loads((d / "manifest.json").read_text())
    del raw["views"], raw["fusion"]
    for rel in [r for r in raw["files"] if r.startswith("bm25/")]:
        del raw["files"][rel], raw["sizes"][rel]
    from openbook.index.manifest import combined_checksum

    raw["checksum"] = combined_checksum(raw["files"])
    shutil.rmtree(d / "bm25")
    (d / "manifest.json").write_text(json.dumps(raw))
    with open_index(d) as idx:
        assert idx.views == ("dense",) and idx.default_retrieval == "dense"
        assert idx.search(SearchRequest(["Who wrote Hamlet?"], k=1))[0][0].id == "p21"

    for bad, why in (
        ({"views": ["bm25"]}, "do not fit index_type"),
        ({"views": ["dense", "bm25", "x"]}, "do not fit"),
        ({"fusion": {"dense_weight": 1.0}}, "fusion: missing bm25_weight"),
        ({"fusion": {"dense_weight": "a", "bm25_weight": 1.0}}, "fusion: dense_weight"),
        ({"fusion": {"dense_weight": 1, "bm25_weight": 1, "candidates": 0}}, "candidates"),
    ):
        raw = json.loads(path.read_text())
        raw.update(bad)
        old.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=why):
            Manifest.from_file(old)


def test_hybrid_is_the_default_and_scores_are_fused(facts_index: LoadedIndex) -> None:
    questions = list(QUESTIONS.values())
    fusion = facts_index.fusion
    default = facts_index.search(SearchRequest(questions, k=4))
    hybrid = facts_index.search(SearchRequest(questions, k=4, retrieval="hybrid"))
    assert [[(p.id, p.score) for p in h] for h in default] == [
        [(p.id, p.score) for p in h] for h in hybrid
    ]
    assert [h[0].id for h in hybrid] == list(QUESTIONS)
    # Each hit's score is w_d·(q·d) + w_b·BM25, computed here from the two views apart.
    q = load_encoder("all-MiniLM-L6-v2").encode(questions)
    bm25 = facts_index.search(SearchRequest(questions, k=len(FACTS), retrieval="bm25"))
    for i, hits in enumerate(hybrid):
        b = {p.id: p.score for p in bm25[i]}
        for p in hits:
            d = float(facts_index.get_vectors([p.id])[0] @ q[i])
            want = fusion.dense_weight * d + fusion.bm25_weight * b.get(p.id, 0.0)
            assert p.score == pytest.approx(want, rel=1e-4, abs=1e-4)
        assert [p.score for p in hits] == sorted((p.score for p in hits), reverse=True)
    # Already-encoded queries (a server batching its encoder) give the same hits.
    again = facts_index.search(SearchRequest(questions, k=4, query_vectors=q, return_vectors=True))
    assert [[p.id for p in h] for h in again] == [[p.id for p in h] for h in hybrid]
    assert again[0][0].vector is not None and again[0][0].vector.shape == (384,)


def test_dense_and_bm25_modes_equal_the_single_view_indexes(
    facts_index: LoadedIndex, facts_jsonl: Path, tmp_path: Path
) -> None:
    questions = [*QUESTIONS.values(), "zzzqqq"]
    enc = load_encoder("all-MiniLM-L6-v2")
    dense = facts_index.search(SearchRequest(questions, k=5, retrieval="dense"))
    assert _hits(dense) == _hits(
        facts_index.search(SearchRequest(k=5, query_vectors=enc.encode(questions)))
    )
    build_index(
        [facts_jsonl],
        tmp_path / "b",
        IndexSpec(name="b", index_type="bm25"),
        BuildOptions(progress=False),
    )
    with open_index(tmp_path / "b") as bm25_only:
        want = bm25_only.search(SearchRequest(questions, k=5))
    got = facts_index.search(
        SearchRequest(questions, k=5, retrieval="bm25"), encoder=enc
    )  # encoder unused
    assert _hits(got) == _hits(want) and got[-1] == []


def _hits(results: list) -> list:
    return [[(p.id, round(p.score, 4)) for p in h] for h in results]


def test_fit_recovers_weights_on_a_synthetic_problem() -> None:
    rng = np.random.default_rng(0)
    n_q, m = 3000, 20
    dense = rng.uniform(-1, 1, (n_q, m)).astype(np.float32)  # cosine-like
    bm25 = rng.gamma(2.0, 3.0, (n_q, m)).astype(np.float32)  # BM25-like, other units
    true = (6.0, 0.4)
    s = true[0] * dense + true[1] * bm25
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    answer = np.array([rng.choice(m, p=row) for row in p])
    positive = np.zeros((n_q, m), dtype=bool)
    positive[np.arange(n_q), answer] = True
    valid = np.ones((n_q, m), dtype=bool)
    valid[::7, -3:] = False  # some questions have fewer candidates
    positive &= valid
    res = fit_weights(dense, bm25, positive, valid, init=(20.0, 1.0))
    assert res.dense_weight == pytest.approx(true[0], rel=0.1)
    assert res.bm25_weight == pytest.approx(true[1], rel=0.1)
    assert res.log_likelihood > res.initial_log_likelihood
    assert res.questions == int(positive.any(1).sum())
    ll = marginal_log_likelihood((res.dense_weight, res.bm25_weight), dense, bm25, positive, valid)
    assert np.mean(ll[positive.any(1)]) == pytest.approx(res.log_likelihood, rel=1e-6)
    with pytest.raises(ValueError, match="no question has an answer"):
        fit_weights(dense, bm25, np.zeros_like(positive), valid)


def test_fit_is_stored_in_the_manifest_and_used_at_search(hybrid_dir: Path) -> None:
    questions = _fact_questions() + [Question("Who wrote Hamlet?", ("no such answer",))]
    with open_index(hybrid_dir) as idx:
        before = idx.search(SearchRequest(list(QUESTIONS.values()), k=3))
        fusion = fit_fusion(idx, questions, candidates=10, source="facts", sha256="ab")
    assert fusion.fitted and fusion.candidates == 10
    assert fusion.fitted_on == {"questions": len(QUESTIONS), "source": "facts", "sha256": "ab"}
    default = Fusion.default(20.0)
    assert fusion.log_likelihood is not None and fusion.log_likelihood <= 0
    store_fusion(hybrid_dir, fusion)
    with open_index(hybrid_dir) as idx:  # verify=True: the files' checksums still hold
        assert idx.manifest.fusion == fusion.to_dict() and idx.fusion == fusion
        cands = idx.hybrid_candidates(list(QUESTIONS.values()), 10)
        after = idx.search(SearchRequest(list(QUESTIONS.values()), k=3))
    positive = np.array(
        [
            [r >= 0 and TITLES[f"p{r:02d}"] == TITLES[pid] for r in row]
            for row, pid in zip(cands.rows, QUESTIONS, strict=True)
        ]
    )
    fitted_ll = marginal_log_likelihood(
        (fusion.dense_weight, fusion.bm25_weight), cands.dense, cands.bm25, positive, cands.valid
    ).mean()
    default_ll = marginal_log_likelihood(
        (default.dense_weight, default.bm25_weight), cands.dense, cands.bm25, positive, cands.valid
    ).mean()
    assert fitted_ll == pytest.approx(fusion.log_likelihood, abs=1e-5)
    assert fitted_ll >= default_ll - 1e-9
    # Search uses the fitted weights: same top passages here, scores re-weighted.
    assert [h[0].id for h in after] == [h[0].id for h in before]
    for i, hits in enumerate(after):
        j = list(cands.rows[i]).index(int(hits[0].id[1:]))
        want = fusion.dense_weight * cands.dense[i, j] + fusion.bm25_weight * cands.bm25[i, j]
        assert hits[0].score == pytest.approx(float(want), rel=1e-4)
    store_fusion(hybrid_dir, None)
    assert Manifest.from_file(hybrid_dir / "manifest.json").fusion is None


def test_read_questions_excludes_titles(tmp_path: Path) -> None:
    rows = [
        {"question": "q1", "answers": ["a"], "title": "Train"},
        {"question": "q2", "answers": ["b"], "title": "Dev"},
        {"question": "q3", "answers": ["c"]},
    ]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    qs, sha = read_questions(path, exclude_titles=["Dev"])
    assert [q.question for q in qs] == ["q1", "q3"] and len(sha) == 64
    write_jsonl(path, [{"question": "q", "answers": "a"}])
    with pytest.raises(ValueError, match=r"q.jsonl:1: answers must be a list"):
        read_questions(path)


def test_shards_keep_both_views_and_the_fusion(hybrid_dir: Path, tmp_path: Path) -> None:
    fusion = Fusion(15.0, 0.8, 10, {"questions": 8, "source": "t", "sha256": None}, -0.5)
    store_fusion(hybrid_dir, fusion)
    paths = split_index(hybrid_dir, 2, tmp_path / "shards", progress=False)
    questions = list(QUESTIONS.values())
    from openbook_gateway.retrieval import merge_results

    shards = [open_index(p) for p in paths]
    try:
        for s in shards:
            assert s.views == ("dense", "bm25") and s.default_retrieval == "hybrid"
            assert s.fusion == fusion
        # Both features of every candidate are the parent's (BM25 keeps the parent's
        # statistics): merged hybrid results are the unsharded index's.
        merged = merge_results([s.search(SearchRequest(questions, k=3)) for s in shards], 3)
        with open_index(hybrid_dir) as parent:
            want = parent.search(SearchRequest(questions, k=3))
        assert [[p.id for p in h] for h in merged] == [[p.id for p in h] for h in want]
        for got_hits, want_hits in zip(merged, want, strict=True):
            assert [p.score for p in got_hits] == pytest.approx([p.score for p in want_hits])
        assert [h[0].id for h in merged] == list(QUESTIONS)
    finally:
        for s in shards:
            s.close()


def test_cli_fit_fusion_info_and_search(hybrid_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from openbook.index.cli import app

    runner = CliRunner()
    rows = [
        {"question": q, "answers": [TITLES[pid]], "title": TITLES[pid]}
        for pid, q in QUESTIONS.items()
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    args = ["fit-fusion", str(hybrid_dir), "--questions", str(path), "--candidates", "10"]
    r = runner.invoke(
        app, [*args, "--exclude-titles", TITLES["p21"], "--exclude-titles", TITLES["p18"]]
    )
    assert r.exit_code == 0, r.output
    assert "fitted on 6 of 6 questions: s = " in r.output
    m = Manifest.from_file(hybrid_dir / "manifest.json")
    assert m.fusion is not None and m.fusion["fitted_on"]["questions"] == 6
    assert m.fusion["fitted_on"]["source"] == str(path) and m.fusion["candidates"] == 10

    r = runner.invoke(app, ["info", str(hybrid_dir), "--verify"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["views"] == ["dense", "bm25"]
    assert "views: dense, bm25; default retrieval hybrid; hybrid: s = " in r.stderr
    assert "fitted on 6 questions" in r.stderr

    r = runner.invoke(app, ["search", str(hybrid_dir), "Who wrote Hamlet?", "-k", "1"])
    assert r.exit_code == 0 and "p21" in r.stdout
    r = runner.invoke(
        app, ["search", str(hybrid_dir), "Who wrote Hamlet?", "-k", "1", "--retrieval", "bm25"]
    )
    assert r.exit_code == 0 and "p21" in r.stdout

    out = tmp_path / "dense-only"
    r = runner.invoke(
        app,
        ["build", "-p", str(tmp_path / "facts.jsonl"), "--name", "d", "--out", str(out)]
        + ["--no-bm25", "--no-progress"],
    )
    assert r.exit_code == 2  # no such passages file: a clear error, not a crash
    write_jsonl(tmp_path / "facts.jsonl", [{"id": p, "title": t, "text": x} for p, t, x in FACTS])
    r = runner.invoke(
        app,
        ["build", "-p", str(tmp_path / "facts.jsonl"), "--name", "d", "--out", str(out)]
        + ["--no-bm25", "--no-progress"],
    )
    assert r.exit_code == 0, r.output
    assert Manifest.from_file(out / "manifest.json").views == ["dense"]
    r = runner.invoke(app, ["search", str(out), "x", "--retrieval", "hybrid"])
    assert r.exit_code == 2 and "retrieval: index 'd' has no hybrid" in r.output
    r = runner.invoke(app, ["fit-fusion", str(out), "--questions", str(path)])
    assert r.exit_code == 2 and "needs dense and bm25" in r.output
