"""Metadata filters (issue 33): the grammar, and every index type returning exactly the k best
matching passages, filtered inside retrieval (not the top k filtered afterwards).

The reference for "the k best matching" is the same index searched without a filter for every
passage (k = its size: a full ranking by its own scores), the non-matching dropped, the first k
kept. Built indexes match their built-in ``_id`` / ``_title``; live indexes their documents'
metadata, in the base (with deletions and replacements) and the write segment alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from openbook.errors import InvalidArgument
from openbook.index import filtering, open_index
from openbook.index.documents import Document
from openbook.index.live import LiveIndex
from openbook.index.request import SearchRequest
from openbook.index.shard import split_index
from openbook.types import Passage
from openbook.validation import limits
from openbook.validation.metadata_filter import (
    UNMATCHABLE,
    MetadataFilter,
    parse_filter,
    parse_filter_json,
    value_key,
)
from openbook_testkit.index import random_vectors, write_vector_index
from openbook_testkit.live import make_live_index, random_document

DENSE_TYPES = ["flat", "hnsw", "hnsw-sq8", "ivfpq"]


def _f(value: object) -> MetadataFilter:
    parsed = parse_filter(value)
    assert parsed is not None
    return parsed


# ------------------------------------------------------------------ grammar


def test_the_grammar_matches_exactly_and_typed() -> None:
    record = {"lang": "en", "year": 2018, "draft": False, "score": 0.5, "note": None}
    yes = [
        {"lang": "en"},
        {"lang": {"$eq": "en"}},
        {"year": {"$in": [2016, 2018]}},
        {"year": 2018.0},  # JSON has one number type
        {"lang": "en", "year": 2018},
        {"$and": [{"lang": "en"}, {"draft": False}]},
        {"$or": [{"lang": "fr"}, {"score": 0.5}]},
        {"note": None},
        {"$or": [{"missing": 1}, {"$and": [{"lang": "en"}, {"year": {"$in": [2018]}}]}]},
    ]
    no = [
        {"lang": "fr"},
        {"draft": 0},  # false is not 0
        {"year": True},
        {"missing": None},  # a key the record lacks matches nothing, null included
        {"lang": "en", "year": 2016},
        {"$or": [{"lang": "fr"}, {"year": "2018"}]},
    ]
    for value in yes:
        assert _f(value).matches(record), value
    for value in no:
        assert not _f(value).matches(record), value
    assert parse_filter(None) is None and parse_filter({}) is None
    assert parse_filter_json("") is None and parse_filter_json("{}") is None


def test_equal_meanings_have_one_canonical_form() -> None:
    a = _f({"year": {"$in": [2018, 2016]}, "lang": "en"})
    b = _f({"$and": [{"lang": {"$eq": "en"}}, {"year": {"$in": [2016, 2018.0]}}]})
    assert a.canonical() == b.canonical()
    assert parse_filter_json(a.canonical()).canonical() == a.canonical()  # type: ignore[union-attr]
    assert _f({"x": 1}).canonical() != _f({"x": True}).canonical()
    assert a.keys == {"lang", "year"}


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([1, 2], "filter must be an object"),
        ({"tags": ["a", "b"]}, "filter.tags must be a string, number, boolean or null"),
        ({"tags": {"nested": 1}}, "filter.tags: unknown operator 'nested'"),
        ({"year": {"$gt": 2016}}, "filter.year: unknown operator '$gt'"),
        ({"year": {"$in": []}}, "filter.year.$in must be a non-empty list"),
        ({"year": {"$in": [1, [2]]}}, "filter.year.$in[1] must be a string"),
        ({"year": {"$eq": 1, "$in": [1]}}, "filter.year must be a scalar"),
        ({"$and": []}, "filter.$and must be a non-empty list"),
        ({"$or": [{}]}, "filter.$or[0] must hold at least one condition"),
        ({"$or": ["lang"]}, "filter.$or[0] must be an object"),
        ({"$not": {"a": 1}}, "filter.$not: unknown operator"),
        ({"x": float("nan")}, "filter.x must be a finite number"),
        ({"x": 10**400}, "filter.x must be an integer from -9007199254740991 to"),
        ({"x": -(2**53)}, "filter.x must be an integer from"),
        ({"x": {"$in": [1, 2**53]}}, "filter.x.$in[1] must be an integer from"),
        ({"x" * 200: 1}, "filter: keys must be strings of 1 to 128 characters"),
        ({"": 1}, "filter: keys must be strings of 1 to 128 characters"),
        ({f"k{i}": i for i in range(65)}, "filter: at most 64 conditions"),
    ],
)
def test_a_bad_filter_is_refused_naming_where(value: object, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field.replace("$", r"\$").replace("[", r"\[")):
        parse_filter(value)


def test_an_integer_is_bounded_to_what_a_float64_holds_exactly() -> None:
    with pytest.raises(InvalidArgument, match="filter.x must be an integer"):
        parse_filter_json(json.dumps({"x": 10**400}))  # the retriever's filter_json
    edge = 2**53 - 1
    assert _f({"x": edge}).matches({"x": float(edge)})
    assert _f({"x": -edge}).matches({"x": -edge})


def test_a_stored_value_no_filter_can_hold_matches_nothing_and_never_raises() -> None:
    # Metadata written before integers were bounded: 10**400 overflows a float.
    assert value_key(10**400) == value_key(-(2**53)) == value_key(float("inf")) == UNMATCHABLE
    record = {"big": 10**400, "lang": "en", "edge": 2**53}
    for where in ({"big": 1}, {"big": 1e308}, {"edge": 2.0**53}, {"lang": "fr"}):
        assert not _f(where).matches(record), where
    assert _f({"lang": "en"}).matches(record)
    columns = filtering.MetadataColumns(
        np.array([0, 1]), ["a", "b"], ["A", "B"], [record, {"big": 1, "lang": "fr"}]
    )
    assert columns.mask(_f({"big": 1})).tolist() == [False, True]
    assert columns.mask(_f({"lang": "en"})).tolist() == [True, False]


def test_filter_json_that_does_not_parse_names_filter() -> None:
    with pytest.raises(InvalidArgument, match="filter is not valid JSON"):
        parse_filter_json("{lang: en}")


# ------------------------------------------------------------------ built indexes


def _reference(index, query: np.ndarray, keep: set[str], k: int) -> list[str]:
    """The index's own full ranking of ``query``, the non-matching dropped, the first k."""
    full = index.search(SearchRequest(k=len(index), query_vectors=query[None, :]))[0]
    return [p.id for p in full if p.id in keep][:k]


def _exact(vectors: np.ndarray, ids: list[str], query: np.ndarray, keep: set[str], k: int):
    scores = vectors @ query
    order = [i for i in np.argsort(-scores, kind="stable") if ids[i] in keep]
    return [ids[i] for i in order[:k]]


@pytest.fixture(scope="module")
def vector_indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vectors = random_vectors(600, 16, seed=3)
    root = tmp_path_factory.mktemp("filtered-vectors")
    return {t: write_vector_index(root / t, vectors, t) for t in DENSE_TYPES}


@pytest.mark.parametrize("index_type", DENSE_TYPES)
@pytest.mark.parametrize("path", ["exact-scan", "faiss-selector"])
def test_every_dense_type_returns_the_k_best_matching(
    index_type: str, path: str, vector_indexes: dict[str, Path], monkeypatch
) -> None:
    if path == "faiss-selector":  # as a large index would: faiss searches with an IDSelector
        monkeypatch.setattr(filtering, "EXACT_FILTER_ROWS", 0)
    index = open_index(vector_indexes[index_type])
    vectors = np.load(vector_indexes[index_type] / "vectors.npy")
    ids = [f"r{i}" for i in range(len(index))]
    queries = random_vectors(3, 16, seed=9)
    k = 10
    for share in (6, 60, 300):  # 1%, 10% and half of the passages
        keep = {f"r{i}" for i in range(0, 600, 600 // share)}
        where = _f({"_id": {"$in": sorted(keep)}})
        hits = index.search(SearchRequest(k=k, query_vectors=queries, where=where))
        for q, got in zip(queries, hits, strict=True):
            got_ids = [p.id for p in got]
            assert set(got_ids) <= keep and len(got_ids) == min(k, len(keep))
            if path == "exact-scan" or index_type in ("flat", "hnsw"):
                # exact scores: the exact k best (HNSW stores the float vectors)
                assert got_ids == _exact(vectors, ids, q, keep, k)
            else:  # the index's own (quantised) scores, restricted to the matching
                assert got_ids == _reference(index, q, keep, k)
    # No document has the key, or no passage the value: an empty result, not an error.
    none = SearchRequest(k=k, query_vectors=queries, where=_f({"lang": "en"}))
    assert index.search(none) == [[], [], []]
    index.close()


@pytest.fixture(scope="module")
def live_dirs(dpr_dirs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A built index of each kind with a BM25 view (flat: dense + bm25; bm25), 120 one-passage
    documents ``w<i>`` (tiny DPR encoders); its live copy is made per test."""
    out = {}
    for kind in ("flat", "bm25"):
        root = tmp_path_factory.mktemp(f"live-{kind}")
        make_live_index(root, kind, dpr_dirs).close()
        out[kind] = root / "built"
    return out


QUERIES = ["who wrote hamlet", "highest mountain on earth", "the capital city of france"]


@pytest.mark.parametrize(("kind", "retrieval"), [("flat", "hybrid"), ("bm25", "bm25")])
def test_bm25_and_hybrid_return_the_k_best_matching(
    kind: str, retrieval: str, live_dirs: dict[str, Path]
) -> None:
    index = open_index(live_dirs[kind])
    keep = {f"w{i}" for i in range(0, 120, 10)}
    where = _f({"_id": {"$in": sorted(keep)}})
    got = index.search(SearchRequest(QUERIES, k=5, retrieval=retrieval, where=where))
    full = index.search(SearchRequest(QUERIES, k=len(index), retrieval=retrieval))
    for hits, ranking in zip(got, full, strict=True):
        want = [p for p in ranking if p.id in keep][:5]
        assert [p.id for p in hits] == [p.id for p in want]
        assert [p.score for p in hits] == pytest.approx([p.score for p in want], rel=1e-5)
    index.close()


def test_shards_filter_their_own_rows_and_merge_to_the_unsharded_result(
    live_dirs: dict[str, Path], tmp_path: Path
) -> None:
    parent = open_index(live_dirs["flat"])
    shards = [open_index(p) for p in split_index(live_dirs["flat"], 2, tmp_path / "sh", False)]
    where = _f({"$or": [{"_id": {"$in": ["w3", "w70", "w71", "w100"]}}, {"_title": "tea"}]})
    for retrieval in ("dense", "bm25", "hybrid"):
        want = parent.search(SearchRequest(QUERIES, k=4, retrieval=retrieval, where=where))
        per_shard = [
            s.search(SearchRequest(QUERIES, k=4, retrieval=retrieval, where=where)) for s in shards
        ]
        for q, hits in enumerate(want):
            merged = sorted((p for s in per_shard for p in s[q]), key=lambda p: -p.score)[:4]
            assert [p.id for p in merged] == [p.id for p in hits], retrieval
    for index in (parent, *shards):
        index.close()


def test_the_cli_searches_with_a_filter(live_dirs: dict[str, Path]) -> None:
    from typer.testing import CliRunner

    from openbook.index.cli import app

    query = "tower paris mountain earth python moon walk animal planet hamlet river tea sun"
    args = ["search", str(live_dirs["bm25"]), query, "-k", "3"]
    keep = [f"w{i}" for i in range(20)]
    r = CliRunner().invoke(app, [*args, "--filter", json.dumps({"_id": {"$in": keep}})])
    assert r.exit_code == 0, r.output
    ids = [line.split()[2] for line in r.output.splitlines()[1:]]
    assert len(ids) == 3 and set(ids) <= set(keep)
    bad = CliRunner().invoke(app, [*args, "--filter", '{"_id": ["w5"]}'])
    assert bad.exit_code != 0 and "--filter._id must be a string" in bad.output


# ------------------------------------------------------------------ live indexes


def _live_reference(live: LiveIndex, retrieval: str, keep: set[str], k: int, q) -> list[list[str]]:
    full = live.search(SearchRequest(QUERIES, k=len(live), query_vectors=q, retrieval=retrieval))
    return [[p.id for p in hits if p.id in keep][:k] for hits in full]


def _doc(p: Passage) -> str:
    return p.id.rsplit("#", 1)[0]


@pytest.mark.parametrize("kind", ["flat", "bm25"])
def test_live_base_and_segment_with_deletions_return_the_k_best_matching(
    kind: str, live_dirs: dict[str, Path], tmp_path: Path
) -> None:
    live = LiveIndex.create(tmp_path / "live", live_dirs[kind])
    rng = np.random.default_rng(4)
    docs = []
    for i in range(12):  # the segment: documents in French and English, by year
        doc = random_document(rng, f"new-{i}", words=int(rng.integers(20, 150)))
        meta = {"lang": "fr" if i % 3 == 0 else "en", "year": 2016 + i % 3}
        docs.append(Document.create(doc.id, doc.title, doc.text, meta))
    # ... and a replaced base document
    docs.append(Document.create("w32", "Tea", "tea coffee water tea", {"lang": "fr"}))
    live.put_many(docs)
    for i in (2, 12, 22):  # deleted base documents
        live.delete(f"w{i}")
    live.delete("new-3")  # a deleted French segment document

    where = _f({"$or": [{"lang": "fr"}, {"_id": {"$in": ["w2", "w12", "w40", "w41", "w42"]}}]})
    passages = {
        p.id: p
        for hits in live.search(SearchRequest(QUERIES, k=len(live), retrieval="bm25"))
        for p in hits
    }
    fr_docs = {f"new-{i}" for i in (0, 6, 9)} | {"w32"}
    base_ok = {"w40", "w41", "w42"}  # w2 and w12 are deleted: never returned
    assert {"w2", "w12", "new-3"}.isdisjoint(_doc(p) for p in passages.values())

    modes = ("bm25",) if kind == "bm25" else ("dense", "bm25", "hybrid")
    q = live.query_encoder.encode(QUERIES) if kind != "bm25" else None
    for _ in range(2):  # before and after a compaction folds the segment into the base
        keep = {pid for pid in _all_ids(live) if _doc_of(pid) in fr_docs | base_ok}
        for retrieval in modes:
            vecs = q if retrieval != "bm25" else None
            got = live.search(
                SearchRequest(QUERIES, k=4, query_vectors=vecs, retrieval=retrieval, where=where)
            )
            want = _live_reference(live, retrieval, keep, 4, vecs)
            assert [[p.id for p in hits] for hits in got] == want, retrieval
            assert all(_doc(p) in fr_docs | base_ok for hits in got for p in hits)
        assert live.search(
            SearchRequest(QUERIES, k=4, retrieval=modes[0], where=_f({"nope": 1}))
        ) == [[], [], []]
        live.compact()
    live.close()


def test_a_live_index_holding_an_oversized_integer_still_filters(
    live_dirs: dict[str, Path], tmp_path: Path, monkeypatch
) -> None:
    """A document whose metadata holds 10**400, stored before integers were bounded: every
    filtered search after a restart (the base's columns read from the store) and after a
    compaction still answers; the value matches nothing."""
    live = LiveIndex.create(tmp_path / "live", live_dirs["bm25"])
    with pytest.raises(InvalidArgument, match="documents.metadata.big must be an integer"):
        Document.create("big", "Big", "tea coffee big", {"big": 10**400}, field="documents")
    monkeypatch.setattr(limits, "MAX_SAFE_INTEGER", 10**500)  # as an older release wrote it
    live.put_many(
        [
            Document.create("big", "Big", "tea coffee big", {"big": 10**400, "lang": "en"}),
            Document.create("small", "Small", "tea coffee small", {"big": 1, "lang": "en"}),
        ]
    )
    monkeypatch.undo()
    live.compact()  # into the base: its metadata columns come from the document store
    live.close()
    for _ in range(2):  # reopened (a restart), then after another write and compaction
        live = LiveIndex(tmp_path / "live")
        for where, want in (
            ({"big": 1}, {"small"}),
            ({"lang": "en"}, {"big", "small"}),
            ({"$or": [{"big": 1e308}, {"big": 2**53 - 1}]}, set()),
        ):
            hits = live.search(
                SearchRequest(["tea coffee"], k=5, retrieval="bm25", where=_f(where))
            )
            assert {_doc(p) for p in hits[0]} == want, where
        live.put(Document.create("other", "Other", "tea other", {"lang": "fr"}))
        live.compact()
        live.close()


def _doc_of(pid: str) -> str:
    return pid.rsplit("#", 1)[0] if "#" in pid else pid


def _all_ids(live: LiveIndex) -> set[str]:
    ids: set[str] = set()
    cursor = None
    while True:
        page = live.list(cursor, 1000)
        for doc_id in page.ids:
            ids.update(live.get(doc_id).passage_ids)
        if page.next_cursor is None:
            return ids
        cursor = page.next_cursor


def test_also_matching_widens_one_keys_string_values_everywhere_in_the_tree():
    """What a tenant's ``_id`` condition becomes (openbook_gateway.principal.Principal.where):
    each string value also matches its alias, in every branch; other keys and kinds stay."""
    from openbook.validation.metadata_filter import parse_filter, record_of

    where = parse_filter({"$or": [{"_id": "report"}, {"_id": {"$in": ["a", 7]}}], "year": "x"})
    assert where is not None
    widened = where.also_matching("_id", lambda v: "~t~" + v)
    for doc_id in ("report", "~t~report", "~t~a", "a"):
        assert widened.matches(record_of(doc_id, "", {"year": "x"}))
    assert not widened.matches(record_of("~t~7", "", {"year": "x"}))  # numbers are not ids
    assert not widened.matches(record_of("~t~report", "", {"year": "y"}))
    assert not where.matches(record_of("~t~report", "", {"year": "x"}))  # the original holds
