"""A live index's writes are visible to the next search, for every index type; a deleted or
replaced passage is never returned (random operations against a brute-force model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openbook.errors import InvalidArgument
from openbook.index import load_encoder, open_index
from openbook.index.documents import Document
from openbook.index.live import DocumentNotFound, LiveIndex
from openbook.index.request import SearchRequest
from openbook.types import Passage
from openbook_testkit.live import make_live_index, random_document

DENSE_TYPES = ["flat", "hnsw", "hnsw-sq8", "ivfpq"]


def _ids(hits: list[Passage]) -> list[str]:
    return [p.id for p in hits]


def _tag(doc_id: str) -> str:
    return f"tag{doc_id.replace('-', '')}"


def _doc_vectors(dpr_dirs: tuple[Path, Path], doc: Document) -> np.ndarray:
    enc = load_encoder(str(dpr_dirs[0]), role="document")
    passages = doc.passages()
    return enc.encode([p.text for p in passages], titles=[p.title for p in passages])


def _assert_segment_exact(hits: list[Passage], want: dict[str, float]) -> None:
    """Every passage of ``want`` (id -> exact score) scoring above the last hit is a hit,
    with that score: the segment's part of the top k is exact whatever the base's type."""
    got = {p.id: p.score for p in hits}
    floor = min(got.values())
    for pid, score in want.items():
        if score > floor + 1e-4:
            assert pid in got, (pid, score, floor)
        if pid in got:
            assert got[pid] == pytest.approx(score, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("index_type", [*DENSE_TYPES, "bm25"])
def test_put_replace_delete_are_visible_to_the_next_search(
    index_type: str, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    live = make_live_index(tmp_path, index_type, dpr_dirs)
    rng = np.random.default_rng(1)
    dense = index_type != "bm25"
    base_vectors = open_index(tmp_path / "built").get_vectors(["w7"]) if dense else None
    if index_type == "flat":
        assert "w7" in _ids(live.search(SearchRequest(k=10, query_vectors=base_vectors))[0])  # type: ignore[arg-type]

    doc = random_document(rng, "new-1")
    put = live.put(doc)
    assert put.version == 1 and live.version == 1
    assert put.passages["new-1"] == tuple(p.id for p in doc.passages())
    assert _ids(live.search(SearchRequest([_tag("new-1")], k=3, retrieval="bm25"))[0])[:1] == [
        doc.passages()[-1].id  # the tag ends the text: it is in the last passage
    ]
    if dense:
        scale = live.manifest.score_scale
        vecs = _doc_vectors(dpr_dirs, doc)
        hits = live.search(SearchRequest(k=10, query_vectors=vecs[:1]))[0]
        want = {p.id: float(vecs[0] @ v) * scale for p, v in zip(doc.passages(), vecs, strict=True)}
        _assert_segment_exact(hits, want)
        if index_type == "flat":  # approximate types may over-score base passages
            assert "new-1#0" in _ids(hits)
        hybrid = live.search(SearchRequest([_tag("new-1")], k=5, retrieval="hybrid"))[0]
        assert doc.passages()[-1].id in _ids(hybrid)

    # Replace: the old passages go, the new come, in one step.
    new = random_document(rng, "new-1", words=30)
    assert live.put(new).version == 2
    texts = {p.id: p.text for p in new.passages()}
    for mode in live.views if not dense else ("dense", "bm25", "hybrid"):
        for hits in live.search(
            SearchRequest([_tag("new-1"), "tower paris water"], k=20, retrieval=mode)
        ):
            for p in hits:
                if p.id.startswith("new-1#"):
                    assert texts.get(p.id) == p.text, (mode, p.id)
    assert live.get("new-1").document == new

    # Replace and delete documents of the base.
    w5 = random_document(rng, "w5", words=20)
    live.put(w5)
    assert "w5" not in _ids(
        live.search(SearchRequest([_tag("w5"), "tower"], k=50, retrieval="bm25"))[0]
    )
    assert _ids(live.search(SearchRequest([_tag("w5")], k=1, retrieval="bm25"))[0]) == ["w5#0"]
    assert live.delete("w7").version == 4
    if dense:
        assert "w7" not in _ids(live.search(SearchRequest(k=10, query_vectors=base_vectors))[0])  # type: ignore[arg-type]
    with pytest.raises(DocumentNotFound):
        live.delete("w7")
    with pytest.raises(KeyError):
        live.get("w7")
    assert live.version == 4
    assert len(live) == 120 - 2 + len(new.passages()) + 1
    page = live.list(limit=3)
    assert page.ids == ("new-1", "w0", "w1") and page.next_cursor == "w1"
    assert live.list(cursor="w98").ids == ("w99",)

    # Compaction keeps what is served; so does reopening.
    before = live.search(SearchRequest([_tag("new-1"), _tag("w5"), "tower"], k=5, retrieval="bm25"))
    result = live.compact()
    assert result is not None and result.version == 4 and live.base_version == 4
    assert live.segment_size == 0 and live.version == 4
    after = live.search(SearchRequest([_tag("new-1"), _tag("w5"), "tower"], k=5, retrieval="bm25"))
    assert [_ids(h)[:1] for h in after[:2]] == [_ids(h)[:1] for h in before[:2]]
    if dense:
        assert "w7" not in _ids(live.search(SearchRequest(k=10, query_vectors=base_vectors))[0])  # type: ignore[arg-type]
        _assert_segment_exact(live.search(SearchRequest(k=10, query_vectors=vecs[:1]))[0], {})
    assert live.put(random_document(rng, "after")).version == 5
    served = live.search(SearchRequest(["tower paris", _tag("after")], k=5, retrieval="bm25"))
    live.close()
    with LiveIndex(tmp_path / "live") as again:
        assert again.version == 5 and again.base_version == 4
        assert (
            again.search(SearchRequest(["tower paris", _tag("after")], k=5, retrieval="bm25"))
            == served
        )
        assert again.get("w5").document == w5
        assert sorted(p.name for p in (tmp_path / "live").iterdir()) == [
            "base-000000000004",
            "compaction.lock",  # the locks' files stay (flock: the kernel drops the lock)
            "documents.sqlite",
            "documents.sqlite-shm",
            "documents.sqlite-wal",
            "wal.log",
            "writer.lock",
        ]


@pytest.mark.parametrize("index_type", ["flat", "bm25"])
def test_random_operations_match_a_brute_force_model(
    index_type: str, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Random puts, replacements, deletes and compactions; after each, every query's top k is
    the model's (exact scores over the live passages) and no deleted passage comes back."""
    live = make_live_index(tmp_path, index_type, dpr_dirs, passages=60)
    rng = np.random.default_rng(7)
    dense = index_type == "flat"
    base = open_index(tmp_path / "built")
    model: dict[str, dict[str, np.ndarray | None]] = {}  # doc -> passage id -> vector
    for row, p in enumerate(base.get_passages(list(range(len(base))))):
        model[p.id] = {p.id: base.get_vectors([row])[0] if dense else None}
    gone: set[str] = set()
    queries = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    for step in range(40):
        action = rng.choice(["put", "replace", "delete", "compact"], p=[0.35, 0.3, 0.3, 0.05])
        docs = sorted(model)
        if action == "put" or (action != "compact" and not docs):
            doc = random_document(rng, f"n{step}")
        elif action == "replace":
            doc = random_document(rng, str(rng.choice(docs)))
        if action == "delete" and docs:
            victim = str(rng.choice(docs))
            live.delete(victim)
            gone |= set(model.pop(victim))
        elif action == "compact":
            live.compact()
        else:
            live.put(doc)
            gone |= set(model.get(doc.id, {}))
            vecs = _doc_vectors(dpr_dirs, doc) if dense else [None] * len(doc.passages())
            model[doc.id] = {p.id: v for p, v in zip(doc.passages(), vecs, strict=True)}
            gone -= set(model[doc.id])
        live_ids = {pid for passages in model.values() for pid in passages}
        assert len(live) == len(live_ids)
        if dense:
            ids = sorted(live_ids)
            mat = np.stack([model_vec(model, pid) for pid in ids])
            for q, hits in zip(
                queries, live.search(SearchRequest(k=5, query_vectors=queries)), strict=True
            ):
                exact = np.sort(mat.astype(np.float64) @ q.astype(np.float64))[::-1][:5]
                assert [p.score for p in hits] == pytest.approx(list(exact), rel=1e-4, abs=1e-4)
                assert not gone & set(_ids(hits))
        for hits in live.search(
            SearchRequest([_tag(d) for d in sorted(model)[:5]], k=10, retrieval="bm25")
        ):
            assert set(_ids(hits)) <= live_ids and not gone & set(_ids(hits))
        for doc_id in rng.choice(sorted(model), 3):
            assert set(live.get(str(doc_id)).passage_ids) == set(model[str(doc_id)])
    live.close()


def model_vec(model: dict[str, dict[str, np.ndarray | None]], pid: str) -> np.ndarray:
    for passages in model.values():
        if pid in passages:
            v = passages[pid]
            assert v is not None
            return v
    raise KeyError(pid)


def test_segment_bm25_scores_as_the_base_would(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """A base passage put again under another id scores exactly as the base scores it: the
    segment's BM25 uses the base's statistics (average length solved from its scores)."""
    live = make_live_index(tmp_path, "bm25", None, passages=60)
    base = open_index(tmp_path / "built")
    for row in (3, 17, 42):
        p = base.get_passages([row])[0]
        live.put(Document.create(f"copy{row}", p.title, p.text))
        hits = live.search(SearchRequest([p.text], k=60, retrieval="bm25"))[0]
        scores = {h.id: h.score for h in hits}
        assert scores[f"copy{row}#0"] == pytest.approx(scores[p.id], rel=1e-5)
    live.close()


def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    live = make_live_index(tmp_path, "flat", dpr_dirs, passages=60)
    rng = np.random.default_rng(0)
    good = [random_document(rng, f"ok{i}") for i in range(3)]
    served = live.search(SearchRequest(["tower"], k=5, retrieval="bm25"))
    bad_batches: list[tuple[list[Document], str]] = [
        ([*good[:2], Document("a/b", "T", "words here")], r"^documents\[2\]\.id"),
        ([*good, Document("x", "T", " ")], r"^documents\[3\]\.text"),
        ([*good, Document("y", "T", "w", {"list": [1]})], r"^documents\[3\]\.metadata\.list"),
        ([good[0], good[0]], r"^documents\[1\]\.id: 'ok0' appears twice"),
        ([], "^documents must not be empty"),
    ]
    for docs, field in bad_batches:
        with pytest.raises(InvalidArgument, match=field):
            live.put_many(docs)
    with pytest.raises(InvalidArgument, match="^document.id"):
        live.put(Document("", "T", "text"))
    with pytest.raises(InvalidArgument, match="^id"):
        live.delete("a/b")
    with pytest.raises(InvalidArgument, match="^limit"):
        live.list(limit=0)
    assert live.version == 0 and len(live) == 60
    assert live.search(SearchRequest(["tower"], k=5, retrieval="bm25")) == served
    for doc in good:
        with pytest.raises(DocumentNotFound):
            live.get(doc.id)
    result = live.put_many(good)
    assert result.version == 1 and set(result.passages) == {"ok0", "ok1", "ok2"}
    live.close()


def test_a_replaced_document_is_never_half_old_half_new(
    dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Readers searching while a writer flips a document between two versions (of different
    passage counts) see all of one version's passages, never a mix."""
    import threading

    live = make_live_index(tmp_path, "flat", dpr_dirs, passages=40)
    rng = np.random.default_rng(9)
    versions = [random_document(rng, "flip", words=w) for w in (250, 120)]
    texts = [frozenset(p.text for p in d.passages()) for d in versions]
    live.put(versions[0])
    stop = threading.Event()
    seen: list[frozenset[str]] = []
    errors: list[BaseException] = []
    queries = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)

    def read() -> None:
        try:
            while not stop.is_set():
                for hits in live.search(
                    SearchRequest(k=100, query_vectors=queries)
                ):  # every live passage
                    seen.append(frozenset(p.text for p in hits if p.id.startswith("flip#")))
                for hits in live.search(SearchRequest(["tagflip"], k=100, retrieval="bm25")):
                    flip = [p for p in hits if p.id.startswith("flip#")]
                    assert len(flip) == 1 and any(p.text in t for t in texts for p in flip)
        except BaseException as e:  # surfaced below
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for i in range(20):
        live.put(versions[(i + 1) % 2])
    stop.set()
    for t in readers:
        t.join()
    assert not errors
    assert seen and all(s in texts for s in seen)
    live.close()


@pytest.mark.parametrize(
    ("like_type", "index_type"), [("flat", None), ("flat", "hnsw"), ("bm25", None)]
)
def test_an_index_created_empty_takes_writes_and_compacts_into_its_first_base(
    like_type: str, index_type: str | None, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from openbook.index.empty_base import template_of
    from openbook.index.loaded import read_index_manifest

    make_live_index(tmp_path / "like", like_type, dpr_dirs, passages=60).close()
    like = read_index_manifest(tmp_path / "like" / "built")
    template = template_of(like, name="fresh", index_type=index_type)
    live = LiveIndex.create_empty(tmp_path / "fresh", template)
    dense = like_type != "bm25"
    assert len(live) == 0 and live.version == 0 and live.list().ids == ()
    assert live.search(SearchRequest(["tower"], k=3, retrieval="bm25")) == [[]]
    if dense:
        # DPR encoders: the paper's dense retrieval is the default, hybrid on request
        assert live.default_retrieval == "dense"
        assert live.search(SearchRequest(["tower"], k=3, retrieval="hybrid")) == [[]]
    rng = np.random.default_rng(11)
    docs = [random_document(rng, f"e{i}") for i in range(40)]
    assert live.put_many(docs).version == 1
    live.delete("e3")
    for doc, hits in zip(
        docs,
        live.search(SearchRequest([_tag(d.id) for d in docs], k=2, retrieval="bm25")),
        strict=True,
    ):
        assert (_ids(hits)[:1] == [doc.passages()[-1].id]) != (doc.id == "e3")
    if dense:
        vecs = _doc_vectors(dpr_dirs, docs[0])
        hits = live.search(SearchRequest(k=3, query_vectors=vecs[:1]))[0]
        scale = live.manifest.score_scale
        assert hits[0].score == pytest.approx(
            max(float(vecs[0] @ v) * scale for v in _all_vectors(dpr_dirs, docs, skip="e3")),
            rel=1e-4,
        )
        hybrid = live.search(SearchRequest([_tag("e5")], k=5, retrieval="hybrid"))[0]
        assert docs[5].passages()[-1].id in _ids(hybrid)
    result = live.compact()
    assert result is not None and result.version == 2
    assert live.manifest.index_type == (index_type or like_type) and live.manifest.count == len(
        live
    )
    assert _ids(live.search(SearchRequest([_tag("e7")], k=1, retrieval="bm25"))[0]) == [
        docs[7].passages()[-1].id
    ]
    live.put(random_document(rng, "e40"))
    live.close()
    with LiveIndex(tmp_path / "fresh") as again:
        assert again.version == 3 and again.base_version == 2
        last = again.get("e40").passage_ids[-1]
        assert _ids(again.search(SearchRequest([_tag("e40")], k=1, retrieval="bm25"))[0]) == [last]


def _all_vectors(dpr_dirs: tuple[Path, Path], docs: list[Document], skip: str) -> np.ndarray:
    return np.concatenate([_doc_vectors(dpr_dirs, d) for d in docs if d.id != skip])
