"""The index engine interface (openbook/index/engine.py): the enums spell the strings the rest
of openbook uses, one rule picks the retrieval mode, and the files engine's classes conform
(statically in files_engine.py; here, through their use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openbook.index import INDEX_TYPES, RETRIEVAL_MODES, LoadedIndex, files_engine
from openbook.index.empty_base import EmptyBase, template_of
from openbook.index.engine import (
    EngineKind,
    IndexType,
    RetrievalMode,
    SearchableIndex,
    View,
    check_retrieval,
)
from openbook.index.faiss_index import DENSE_TYPES
from openbook.index.manifest import VIEWS
from openbook.index.request import SearchRequest
from openbook.validation.limits import RETRIEVAL_MODES as WIRE_RETRIEVAL_MODES
from openbook.validation.limits import RETRIEVAL_VIEWS


def test_the_enums_are_the_strings_openbook_uses() -> None:
    assert tuple(RetrievalMode) == RETRIEVAL_MODES == WIRE_RETRIEVAL_MODES
    assert tuple(IndexType) == INDEX_TYPES
    assert tuple(t for t in IndexType if t.dense) == DENSE_TYPES
    assert tuple(View) == VIEWS
    assert {m: tuple(m.views) for m in RetrievalMode} == RETRIEVAL_VIEWS
    assert RetrievalMode.HYBRID == "hybrid" and f"{IndexType.HNSW_SQ8}" == "hnsw-sq8"
    assert EngineKind("milvus") is EngineKind.MILVUS


def test_check_retrieval_is_the_one_rule() -> None:
    both = ("dense", "bm25")
    assert check_retrieval("a", both, "hybrid", None) is RetrievalMode.HYBRID
    assert check_retrieval("a", both, "dense", "") is RetrievalMode.DENSE
    assert check_retrieval("a", both, "hybrid", "bm25") is RetrievalMode.BM25
    with pytest.raises(ValueError, match=r"^retrieval: unknown mode 'rrf' for index 'a'"):
        check_retrieval("a", both, "hybrid", "rrf")
    with pytest.raises(ValueError, match=r"^retrieval: index 'b' has no hybrid retrieval"):
        check_retrieval("b", ("dense",), "dense", "hybrid")


def test_files_engine_registers_its_classes() -> None:
    assert files_engine.KIND is EngineKind.FILES
    assert files_engine.BUILT is LoadedIndex and files_engine.EMPTY_BASE is EmptyBase


def _top_ids(index: SearchableIndex, retrieval: str | None) -> list[str]:
    """Searched through the protocol only."""
    request = SearchRequest(["Where is the Eiffel Tower?"], k=3, retrieval=retrieval)
    return [p.id for p in index.search(request)[0]]


def test_built_and_empty_indexes_search_through_the_protocol(
    facts_index: LoadedIndex, tmp_path: Path
) -> None:
    # The enum members and the strings they replace select the same search.
    for mode in RetrievalMode:
        assert _top_ids(facts_index, mode) == _top_ids(facts_index, mode.value)
    assert facts_index.retrieval_mode(None) == facts_index.manifest.default_retrieval
    empty = EmptyBase(tmp_path, template_of(facts_index.manifest, name="e"), name="e")
    assert _top_ids(empty, RetrievalMode.DENSE) == []
    assert empty.retrieval_mode(None) == facts_index.default_retrieval
    # An unknown mode is refused where the request is made, before any index sees it.
    with pytest.raises(ValueError, match=r"^retrieval: unknown mode 'x'; expected one of"):
        empty.search(SearchRequest(["q"], k=1, retrieval="x"))
