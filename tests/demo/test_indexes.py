"""prepare_demo_indexes on a tiny copy of the data (~25 passages per snapshot)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from openbook.index.request import SearchRequest

pytest.importorskip("openbook.index")

from openbook_trainer.demo.data import DEMO_SNAPSHOTS  # noqa: E402
from openbook_trainer.demo.indexes import index_is_complete, prepare_demo_indexes  # noqa: E402

ALL = [s.name for s in DEMO_SNAPSHOTS]


def test_builds_all_then_skips(tiny_index_root: Path, tiny_data_dir: Path) -> None:
    from openbook.index import open_index

    for snap in DEMO_SNAPSHOTS:
        manifest = open_index(tiny_index_root / snap.name).manifest
        assert manifest.name == snap.name and manifest.index_type == snap.index_type
        assert 15 < manifest.count < 60
    assert prepare_demo_indexes(tiny_index_root, tiny_data_dir, progress=False) == []


def test_dense_indexes_are_hybrid_with_a_fusion_fitted_on_training_articles(
    tiny_index_root: Path, tiny_data_dir: Path
) -> None:
    import hashlib

    from openbook.index import open_index
    from openbook.index.fusion import read_questions
    from openbook_trainer.demo.data import SQUAD_QUESTIONS
    from openbook_trainer.experiments.finetune import split_by_article

    questions = tiny_data_dir / SQUAD_QUESTIONS
    train_titles, dev_titles = split_by_article(questions, 10, 0)
    train_qs, _ = read_questions(questions, exclude_titles=dev_titles)
    for name in ("wiki-2016", "wiki-2018"):
        with open_index(tiny_index_root / name) as idx:
            assert idx.views == ("dense", "bm25") and idx.default_retrieval == "hybrid"
            fusion = idx.fusion
            assert fusion.fitted_on is not None
            assert fusion.fitted_on["excluded_titles"] == dev_titles  # dev articles held out
            assert 0 < fusion.fitted_on["questions"] <= len(train_qs)
            sha = hashlib.sha256(questions.read_bytes()).hexdigest()
            assert fusion.fitted_on["sha256"] == sha
            assert "split_by_article(10, seed 0)" in fusion.fitted_on["source"]
            hits = idx.search(SearchRequest(["When did the 1973 oil crisis begin?"], k=3))
            assert hits[0] and hits[0][0].score == max(p.score for p in hits[0])
    for name in ("wiki-2016-bm25", "wiki-2018-bm25"):
        with open_index(tiny_index_root / name) as idx:
            assert idx.views == ("bm25",) and idx.manifest.fusion is None


def test_snapshots_differ_in_leaders_passages(tiny_index_root: Path) -> None:
    from openbook.index import open_index

    counts = {n: open_index(tiny_index_root / n).manifest.count for n in ALL}
    assert counts["wiki-2016"] == counts["wiki-2016-bm25"]
    assert counts["wiki-2018"] == counts["wiki-2018-bm25"]


def test_rebuilds_only_a_damaged_index(
    tiny_index_root: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "indexes"
    shutil.copytree(tiny_index_root, root)
    victim = root / "wiki-2018-bm25"
    biggest = max((p for p in victim.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:-1])
    snap = next(s for s in DEMO_SNAPSHOTS if s.name == "wiki-2018-bm25")
    assert not index_is_complete(victim, snap)
    assert prepare_demo_indexes(root, tiny_data_dir, progress=False) == ["wiki-2018-bm25"]
    assert index_is_complete(victim, snap)


def test_names_and_missing_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown"):
        prepare_demo_indexes(tmp_path, tmp_path, names=["wiki-1999"])
    with pytest.raises(FileNotFoundError, match="paragraphs.jsonl"):
        prepare_demo_indexes(tmp_path / "i", tmp_path, progress=False, names=["wiki-2016-bm25"])
