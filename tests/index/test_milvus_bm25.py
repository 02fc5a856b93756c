"""The BM25 view and hybrid retrieval of the milvus engine (openbook/index/milvus_bm25.py) on a
real Milvus Lite in this process, no mocks: on the same passages its BM25 and hybrid top-k
are the files engine's (the same passage ids, the same scores to float32 precision), filtered
too, and still after the same documents are written to both (a files live index over the
same built base: its write segment is scored with the base's statistics, as Milvus's written
passages are). A copy cut short resumes from its last batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openbook.index import LoadedIndex
from openbook.index.documents import Document, built_document_id
from openbook.index.live import LiveIndex
from openbook.index.manifest import IndexLoadError
from openbook.index.milvus_bm25 import NO_TERM, query_vectors, term_dim
from openbook.index.milvus_engine import MilvusEngine, MilvusIndex
from openbook.index.request import SearchRequest
from openbook.validation.metadata_filter import parse_filter
from openbook_testkit.index import build_words_index

pytest.importorskip("milvus_lite")

QUESTIONS = [
    "tower paris",
    "who wrote hamlet",
    "highest mountain on earth",
    "python language created",
    "first person to walk on the moon",
    "the of a",  # stop words only: no BM25 hit
]
FILTERS = [None, {"_id": {"$in": [f"w{i}" for i in range(0, 150, 3)]}}, {"_title": "tower"}]


@pytest.fixture(scope="module")
def engine(milvus_engine: MilvusEngine) -> MilvusEngine:
    return milvus_engine  # tests/index/conftest.py


@pytest.fixture(scope="module")
def built(dpr_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> LoadedIndex:
    """A flat files index over 150 passages, dense and BM25, with the tiny DPR encoders."""
    index = build_words_index(tmp_path_factory.mktemp("built"), dpr_dirs)
    assert set(index.views) == {"dense", "bm25"}
    return index


def _same(got: list, want: list, context: object) -> None:
    """The same passages in the same order with the same scores, but for passages whose
    scores tie (to float32 precision), which may come in either order: at the end of the
    list, a tie may put another passage of that score in (the engines break ties their own
    way)."""
    assert len(got) == len(want), context
    assert [p.score for p in got] == pytest.approx([p.score for p in want], rel=1e-5, abs=1e-5)

    def tie(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-5 * max(1.0, abs(b))

    last = want[-1].score if want else 0.0
    for g, w in zip(got, want, strict=True):
        if g.id == w.id:
            assert (g.title, g.text) == (w.title, w.text), context
        elif not tie(w.score, last):  # a tie inside the list: the same passages
            assert g.id in {p.id for p in want if tie(p.score, w.score)}, context


def _compare(milvus: MilvusIndex, files: LoadedIndex | LiveIndex, k: int) -> None:
    for raw in FILTERS:
        where = parse_filter(raw) if raw is not None else None
        for mode in ("bm25", "hybrid"):
            got = milvus.search(SearchRequest(QUESTIONS, k=k, retrieval=mode, where=where))
            want = files.search(SearchRequest(QUESTIONS, k=k, retrieval=mode, where=where))
            for question, g, w in zip(QUESTIONS, got, want, strict=True):
                _same(g, w, (mode, raw, question))


def test_bm25_and_hybrid_are_the_files_engines(engine: MilvusEngine, built: LoadedIndex) -> None:
    index = engine.copy_index("words", built).index
    assert index.views == ("dense", "bm25")
    for k in (1, 5, 20):
        _compare(index, built, k)
    hits = index.search(SearchRequest(QUESTIONS[:1], k=5, retrieval="bm25"))[0]
    assert hits and all(p.score > 0 for p in hits)  # raw BM25 scores
    assert index.search(SearchRequest(["the of a"], k=5, retrieval="bm25")) == [[]]
    with_vectors = index.search(
        SearchRequest(QUESTIONS[:2], k=3, retrieval="hybrid", return_vectors=True)
    )
    for p in (p for hits in with_vectors for p in hits):
        np.testing.assert_allclose(p.vector, built.get_vectors([p.id])[0])


def test_written_documents_score_as_a_files_live_index(
    engine: MilvusEngine, built: LoadedIndex, tmp_path: Path
) -> None:
    live = LiveIndex.create(tmp_path / "live", built.path)
    index = engine.copy_index("written", built).index
    docs = [
        Document.create("eiffel", "Tower", "the tower of paris was the highest tower on earth", {}),
        Document.create("w3", "Moon", "first person to walk on the moon", {}),  # replaces w3
        Document.create("stop", "The", "of the a an", {}),  # no term but stop words
        Document.create("zq", "Zq", "zqxj unknown words only here", {}),  # df = 0 terms
    ]
    assert index.put_many(docs).passages == live.put_many(docs).passages
    live.delete("w5")
    index.delete("w5")
    try:
        for k in (3, 10):
            _compare(index, live, k)
        got = index.search(SearchRequest(["zqxj"], k=3, retrieval="bm25"))[0]
        assert [p.id for p in got] == ["zq#0"]
    finally:
        live.close()


def test_dimensions_and_query_vectors() -> None:
    words = ["tower", "paris", "moon", "zqxj", "ünï", "中文"]
    dims = [term_dim(w) for w in words]
    assert len(set(dims)) == len(dims) and NO_TERM not in dims
    assert all(0 < d < 2**32 - 1 for d in dims)
    # bm25s counts a repeated query token once per occurrence.
    assert query_vectors(["tower tower paris", "the of"]) == [
        {term_dim("tower"): 2.0, term_dim("paris"): 1.0},
        {},
    ]


def test_a_copy_cut_short_resumes_from_its_last_batch(
    engine: MilvusEngine, built: LoadedIndex
) -> None:
    class Interrupted(Exception):
        pass

    seen: list[int] = []

    def cut(done: int, total: int) -> None:
        seen.append(done)
        if done == 40:
            raise Interrupted  # killed after its second batch was recorded

    with pytest.raises(Interrupted):
        engine.copy_index("resumed", built, batch=20, progress=cut)
    assert seen == [20, 40]
    with pytest.raises(IndexLoadError, match=r"copy from .* cut short \(40 of 150 passages\)"):
        engine.open("resumed")
    assert "resumed" in engine.names()
    seen.clear()
    copied = engine.copy_index("resumed", built, batch=20, progress=lambda d, t: seen.append(d))
    assert copied.resumed_at == 40 and seen == [60, 80, 100, 120, 140, 150]
    index = copied.index
    assert len(index) == 150 and index.version == 0
    ids = sorted({built_document_id(p.id) for p in built.get_passages(range(len(built)))})
    assert list(index.list(limit=1000).ids) == ids
    _compare(index, built, 5)
    with pytest.raises(Exception, match="already exists"):
        engine.copy_index("resumed", built)
