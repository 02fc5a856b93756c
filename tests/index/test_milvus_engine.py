"""The milvus engine (openbook/index/milvus_engine.py) on a real Milvus Lite in this process, no
mocks: it answers as the files engine does on the same passages (dense top-k, filters), its
documents round-trip with their versions, and no filter value or document id can widen what
an expression selects."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from openbook.errors import AlreadyExists, InvalidArgument, NotFound
from openbook.index import LoadedIndex
from openbook.index.documents import Document
from openbook.index.empty_base import template_of
from openbook.index.engine import DocumentIndex, RetrievalMode
from openbook.index.faiss_index import default_params
from openbook.index.live import DocumentNotFound, LiveIndex
from openbook.index.milvus_engine import (
    TEXT_CHUNK_CHARS,
    MilvusEngine,
    MilvusIndex,
    check_milvus_uri,
    filter_expression,
    milvus_index_of,
    milvus_string,
)
from openbook.index.request import SearchRequest
from openbook.validation.metadata_filter import parse_filter
from openbook_testkit.index import build_words_index

pytest.importorskip("milvus_lite")

INJECTIONS = [
    'a" or 1==1 or "',
    'x\\" || doc_id != "',
    "back\\slash\\",
    "it's ) or (true",
    "tab\tnew\nline",
    "ünï cødé ✓ 中文",
]


@pytest.fixture(scope="module")
def engine(milvus_engine: MilvusEngine) -> MilvusEngine:
    return milvus_engine  # tests/index/conftest.py


@pytest.fixture(scope="module")
def built(dpr_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> LoadedIndex:
    """A flat files index over 150 passages with the tiny DPR encoders (32-d)."""
    return build_words_index(tmp_path_factory.mktemp("built"), dpr_dirs)


def _ids(hits: list) -> list[str]:
    return [p.id for p in hits]


def test_dense_search_is_the_files_flat_index(engine: MilvusEngine, built: LoadedIndex) -> None:
    index = engine.copy_index("parity", built).index
    conforming: DocumentIndex = index  # the protocol the retriever talks to
    assert len(conforming) == len(built) == 150
    # DPR's encoders: the paper's retrieval, dense, by default; the BM25 view beside it.
    assert conforming.views == ("dense", "bm25") and conforming.default_retrieval == "dense"
    assert conforming.manifest.score_scale == built.manifest.score_scale
    queries = np.random.default_rng(0).standard_normal((6, built.manifest.dim)).astype("f4")
    want = built.search(SearchRequest(k=10, query_vectors=queries))
    got = index.search(SearchRequest(k=10, query_vectors=queries))
    for w, g in zip(want, got, strict=True):
        assert _ids(g) == _ids(w)
        assert [p.score for p in g] == pytest.approx([p.score for p in w], rel=1e-4, abs=1e-4)
        assert [(p.title, p.text) for p in g] == [(p.title, p.text) for p in w]
    texts = ["tower paris", "who wrote hamlet", "largest animal on earth"]
    for mode in (RetrievalMode.DENSE, "dense"):
        assert [_ids(h) for h in index.search(SearchRequest(texts, k=5, retrieval=mode))] == [
            _ids(h) for h in built.search(SearchRequest(texts, k=5, retrieval="dense"))
        ]
    request = SearchRequest(k=3, query_vectors=queries[:1], return_vectors=True)
    with_vectors = index.search(request)[0]
    np.testing.assert_allclose(
        np.stack([p.vector for p in with_vectors]), built.get_vectors(_ids(with_vectors))
    )
    with pytest.raises(ValueError, match=r"^retrieval: unknown mode 'sparse'"):
        index.search(SearchRequest(texts, k=5, retrieval="sparse"))
    # Built documents are read as the files engine reads them before an adoption.
    assert index.get("w7").document.text == built.get_passages([7])[0].text
    assert engine.open("parity").version == 0 and "parity" in engine.names()
    with pytest.raises(AlreadyExists):
        engine.copy_index("parity", built)


def _docs(rng: np.random.Generator, n: int) -> list[Document]:
    vocab = ["tower", "paris", "mountain", "python", "moon", "river", "tea", "coffee", "sun"]
    out = []
    for i in range(n):
        metadata = {
            "lang": "en" if i % 3 else "fr",
            # 2018 and 2018.0 are one JSON number; true is not 1.
            "year": [2016, 2018, 2018.0][i % 3],
            "flag": True if i % 2 else 1,
            "quote": INJECTIONS[i % len(INJECTIONS)],
        }
        if i % 4 == 0:
            metadata["note"] = None
        text = " ".join(rng.choice(vocab, int(rng.integers(5, 60))))
        out.append(Document.create(f"d{i}", f"Title {i % 5}", text, metadata))
    return out


FILTERS = [
    {"lang": "en"},
    {"year": 2018},
    {"year": {"$in": [2016, 2018.0]}},
    {"flag": True},
    {"flag": 1},
    {"note": None},
    {"missing": "x"},
    {"_title": "Title 2"},
    {"_id": {"$in": ["d3", "d4", "nope"]}},
    {"$or": [{"lang": "fr"}, {"flag": True}], "year": 2016},
    {"$and": [{"lang": "en"}, {"$or": [{"_title": "Title 1"}, {"year": 2016}]}]},
    {"quote": INJECTIONS[0]},
    {"quote": {"$in": INJECTIONS[1:3]}},
]


def test_filters_and_documents_match_a_files_live_index(
    engine: MilvusEngine, built: LoadedIndex, tmp_path: Path
) -> None:
    template = template_of(built.manifest, name="docs")
    live = LiveIndex.create_empty(tmp_path / "live", template)
    index = engine.create("docs", template)
    docs = _docs(np.random.default_rng(1), 24)
    assert live.put_many(docs).passages == index.put_many(docs).passages
    assert index.version == live.version == 1
    queries = np.random.default_rng(2).standard_normal((3, built.manifest.dim)).astype("f4")
    for raw in FILTERS:
        where = parse_filter(raw)
        want = live.search(SearchRequest(k=8, query_vectors=queries, where=where))
        got = index.search(SearchRequest(k=8, query_vectors=queries, where=where))
        assert [_ids(h) for h in got] == [_ids(h) for h in want], raw
        # Every matching passage, and only those: the filter is matched exactly.
        everything = index.search(SearchRequest(k=100, query_vectors=queries[:1], where=where))[0]
        kept = {d.id for d in docs if where is not None and where.matches(_record(d))}
        assert {p.id.split("#")[0] for p in everything} == kept, raw
    assert index.list(limit=5) == live.list(limit=5)
    assert index.list("d3", 100) == live.list("d3", 100)
    live.close()


def _record(doc: Document) -> dict:
    return {**doc.metadata, "_id": doc.id, "_title": doc.title}


def test_documents_round_trip_with_their_versions(engine: MilvusEngine, built: LoadedIndex) -> None:
    index = engine.create("roundtrip", template_of(built.manifest, name="roundtrip"))
    # A text longer than one stored chunk, with whitespace a passage split would lose.
    words = ["tower", "paris\n\n", "moon\t", "river  "] * (TEXT_CHUNK_CHARS // 12)
    long = Document.create("long", "Long", " ".join(words), {"pages": "many", "n": 3})
    put = index.put(long)
    assert put.version == 1 and put.passages["long"] == tuple(p.id for p in long.passages())
    stored = index.get("long")
    assert stored.document == long and stored.version == 1
    assert stored.passage_ids == put.passages["long"]
    # A second client (another replica) reads the write once it catches up.
    other = engine.open("roundtrip")
    assert other.version == 1 and other.get("long").document == long
    short = Document.create("long", "Short", "tower paris", {})
    assert index.put(short).version == 2
    assert other.catch_up() and other.version == 2
    assert other.get("long").passage_ids == ("long#0",)
    ones = np.ones((1, built.manifest.dim), "f4")
    hits = index.search(SearchRequest(k=50, query_vectors=ones))[0]
    assert _ids(hits) == ["long#0"]  # the replaced document's other passages are gone
    assert index.delete("long").version == 3
    with pytest.raises(DocumentNotFound):
        index.get("long")
    with pytest.raises(DocumentNotFound):
        index.delete("long")
    assert index.list().ids == () and len(index) == 0
    with pytest.raises(InvalidArgument, match=r"^documents\[1\]\.id: 'a' appears twice"):
        index.put_many([short.__class__("a", "", "x", {})] * 2)
    engine.drop("roundtrip")
    with pytest.raises(NotFound):
        engine.open("roundtrip")


def test_no_id_or_filter_value_widens_an_expression(
    engine: MilvusEngine, built: LoadedIndex
) -> None:
    index: MilvusIndex = engine.create("inject", template_of(built.manifest, name="inject"))
    # Ids hold no control characters (Document's rules); metadata values may.
    ids = [f"id {s}".replace("\t", " ").replace("\n", " ") for s in INJECTIONS]
    pairs = zip(ids, INJECTIONS, strict=True)
    docs = [Document.create(i, "T", "tower paris", {"k": s}) for i, s in pairs]
    docs.append(Document.create("plain", "T", "tower paris", {"k": "plain", 'a" or 1': 1}))
    index.put_many(docs)
    for doc in docs:
        assert index.get(doc.id).document == doc  # exactly that one, by its quoted id
        got = index.search(
            SearchRequest(["tower"], k=50, where=parse_filter({"k": doc.metadata["k"]}))
        )[0]
        assert {p.id for p in got} == {f"{doc.id}#0"}
    got = index.search(SearchRequest(["tower"], k=50, where=parse_filter({'a" or 1': 1})))[0]
    assert _ids(got) == ["plain#0"]
    # The expression holds hex digests and keywords only: no user text at all.
    expr = filter_expression(parse_filter({"$or": [{"k": s} for s in INJECTIONS]}))
    digests = re.sub(r'"[0-9a-f]{64}"', "H", expr)
    assert '"' not in digests and "\\" not in digests
    assert set(re.findall(r"[A-Za-z_]+", digests)) == {"array_contains_any", "terms", "or", "H"}
    assert milvus_string('a"b\\c') == '"a\\"b\\\\c"'
    with pytest.raises(ValueError, match="control character"):
        milvus_string("a\x00b")
    index.delete(docs[0].id)
    assert list(index.list().ids) == sorted(d.id for d in docs[1:])
    with pytest.raises(DocumentNotFound):
        index.get(ids[0])


def test_uri_and_index_type_are_checked(engine: MilvusEngine, built: LoadedIndex) -> None:
    assert check_milvus_uri("http://milvus:19530") == "http://milvus:19530"
    assert check_milvus_uri("var/milvus.db") == "var/milvus.db"
    with pytest.raises(InvalidArgument, match="^OPENBOOK_MILVUS_URI: "):
        check_milvus_uri("var/milvus")
    bm25 = dataclasses.replace(built.manifest, name="b", index_type="bm25")
    with pytest.raises(InvalidArgument, match="^index_type: 'bm25' is not offered"):
        engine.create("b", bm25)
    # ivfpq is IVF_PQ, planned for a million passages when created empty; the shards asked
    # for are the collection's num_shards on a server, and Milvus Lite keeps one.
    pq = engine.create("pq", template_of(built.manifest, name="pq", index_type="ivfpq"), shards=3)
    planned = default_params("ivfpq", 1_000_000, built.manifest.dim)
    assert milvus_index_of(pq.manifest) == (
        "IVF_PQ",
        {"nlist": planned["nlist"], "m": planned["pq_m"], "nbits": planned["nbits"]},
    )
    assert engine.client.describe_collection(pq.passages)["num_shards"] == 1
    pq.put(Document.create("a", "T", "tower paris moon", {}))
    assert _ids(pq.search(SearchRequest(["tower"], k=3))[0]) == ["a#0"]
    hnsw = engine.create("hnsw", template_of(built.manifest, name="hnsw", index_type="hnsw"))
    hnsw.put(Document.create("a", "T", "tower paris moon", {}))
    assert _ids(hnsw.search(SearchRequest(["tower"], k=3))[0]) == ["a#0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_clients_share_a_milvus_lite_server(built: LoadedIndex, tmp_path: Path) -> None:
    """``milvus-lite server`` speaks Milvus's protocol: two engines (two replicas) over one
    http URI read each other's writes, as they would on a cluster."""
    port = _free_port()
    command = [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(tmp_path)]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        uri = f"http://127.0.0.1:{port}"
        first = _connect(uri, server)
        second = MilvusEngine(uri)
        a = first.create("shared", template_of(built.manifest, name="shared"))
        doc = Document.create("x", "X", "tower paris moon", {"lang": "en"})
        assert a.put(doc).version == 1
        b = second.open("shared")
        assert b.version == 1 and b.get("x").document == doc
        assert _ids(
            b.search(SearchRequest(["tower"], k=3, where=parse_filter({"lang": "en"})))[0]
        ) == ["x#0"]
        assert b.delete("x").version == 2
        assert a.catch_up() and a.version == 2 and a.list().ids == ()
        first.close()
        second.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def _connect(uri: str, server: subprocess.Popen) -> MilvusEngine:
    deadline = time.monotonic() + 60
    while True:
        try:
            return MilvusEngine(uri, timeout_s=5)
        except Exception:
            if server.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
