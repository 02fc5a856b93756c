"""The typed search request (issue 44): what a search asks for, checked once where it is made
(InvalidArgument naming the field), and the one rule every engine applies on its index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openbook.errors import InvalidArgument
from openbook.index import LoadedIndex, build_index, open_index
from openbook.index.empty_base import EmptyBase, template_of
from openbook.index.engine import RetrievalMode
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec


def test_the_request_is_checked_where_it_is_made() -> None:
    request = SearchRequest(["a", "b"], k=3, retrieval="bm25")
    assert request.queries == ("a", "b") and request.k == 3 and request.n == 2
    assert request.retrieval is RetrievalMode.BM25 and not request.by_vectors
    assert SearchRequest(["a"], k=1, retrieval="").retrieval is None
    for fields, field in [
        ({"k": 0}, "k must be >= 1"),
        ({"k": True}, "k must be a whole number"),
        ({"k": 1, "retrieval": "rrf"}, "retrieval: unknown mode 'rrf'"),
        ({"k": 1, "query_vectors": np.ones((1, 2, 3))}, "query_vectors: shape"),
        ({"k": 1, "query_vectors": np.ones((2, 4))}, "query_vectors: 2 rows for 1 queries"),
    ]:
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            SearchRequest(["q"], **fields)
    with pytest.raises(InvalidArgument, match="^queries: a list of strings"):
        SearchRequest("q", k=1)
    with pytest.raises(InvalidArgument, match=r"^queries\[1\]"):
        SearchRequest(["q", 3], k=1)


def test_query_vectors_are_rows_of_float32_kept_read_only() -> None:
    given = np.ones(4, dtype=np.float64)
    request = SearchRequest(k=2, query_vectors=given)
    assert request.by_vectors and request.n == 1
    assert request.query_vectors is not None
    assert request.query_vectors.shape == (1, 4) and request.query_vectors.dtype == np.float32
    assert not request.query_vectors.flags.writeable
    mine = np.ones((2, 4), dtype=np.float32)
    SearchRequest(k=1, query_vectors=mine)
    assert mine.flags.writeable  # the caller's array is left as it was


def test_the_mode_on_an_index_is_one_rule(facts_index: LoadedIndex, tmp_path: Path) -> None:
    both = facts_index
    dim = both.manifest.dim
    assert SearchRequest(["q"], k=1).mode_on(both) == both.default_retrieval
    vectors = SearchRequest(k=1, query_vectors=np.ones((1, dim), np.float32))
    assert vectors.mode_on(both) is RetrievalMode.DENSE  # vectors alone: dense
    with pytest.raises(InvalidArgument, match="^retrieval: hybrid reads the query texts"):
        SearchRequest(k=1, query_vectors=np.ones((1, dim)), retrieval="hybrid").mode_on(both)
    with pytest.raises(InvalidArgument, match=rf"^query_vectors: index 'facts'.* \(n, {dim}\)"):
        SearchRequest(k=1, query_vectors=np.ones((1, dim + 1))).mode_on(both)
    empty = EmptyBase(tmp_path, template_of(both.manifest, name="e"), name="e")
    with pytest.raises(InvalidArgument, match=r"^query_vectors: index 'e'"):
        empty.search(SearchRequest(k=1, query_vectors=np.ones((1, 3))))
    assert empty.search(SearchRequest(["q", "r"], k=1)) == [[], []]


def test_a_bm25_index_takes_texts_only(facts_jsonl: Path, tmp_path: Path) -> None:
    spec = IndexSpec(name="b", index_type="bm25")
    build_index([facts_jsonl], tmp_path / "b", spec, BuildOptions(progress=False))
    with open_index(tmp_path / "b") as idx:
        assert SearchRequest(["q"], k=1).mode_on(idx) is RetrievalMode.BM25
        with pytest.raises(InvalidArgument, match="^retrieval: index 'b' has no dense"):
            idx.search(SearchRequest(["Who wrote Hamlet?"], k=1, retrieval="dense"))
        with pytest.raises(InvalidArgument, match="is bm25; search it by text"):
            idx.search(SearchRequest(k=1, query_vectors=np.zeros((1, 4), np.float32)))
        with pytest.raises(InvalidArgument, match="is bm25 and stores no vectors"):
            idx.search(SearchRequest(["Who wrote Hamlet?"], k=1, return_vectors=True))
        assert idx.search(SearchRequest([], k=1)) == []
