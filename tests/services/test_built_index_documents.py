"""The documents of a built index, listed and read through the retriever and the gateway: one
entry per document, never one of its passage ids, each one GetDocument finds.

The corpus is laid out as data/squad/paragraphs.jsonl is: rows ``<doc>#<n>`` are paragraphs of
document ``<doc>``, and a paragraph too long for one passage is built as ``<doc>#<n>#<m>``.
Document ids with characters sorting below ``#`` (``A`` < ``A B``, while ``A B#0`` < ``A#0``)
put documents and their passages in different orders; pages are read with cursors across
every scan size, so each page boundary falls inside and between such runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from openbook.index import build_index, built_documents
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.serving.grpc_server import bearer_metadata
from openbook.v1 import retriever_pb2
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.index import write_jsonl
from openbook_testkit.stack import free_port, retriever_service

TOKEN = "built-documents-token"
INDEX = "paragraphs"
LONG = " ".join(f"crude{i}" for i in range(150))  # over max_words (100): two passages
ROWS = [
    {"id": "oil#0", "title": "Oil crisis", "text": "The embargo began in October. " + LONG},
    {"id": "oil#1", "title": "Oil crisis", "text": "Prices rose fourfold by March."},
    {"id": "oil#2", "title": "Oil crisis", "text": "Rationing followed in Europe."},
    {"id": "A B#0", "title": "A B", "text": "Alpha beta paragraph."},
    {"id": "A C#0", "title": "A C", "text": "Alpha gamma paragraph."},
    {"id": "A D#0", "title": "A D", "text": "Alpha delta paragraph."},
    {"id": "A#0", "title": "A", "text": "Alpha paragraph zero."},
    {"id": "A#1", "title": "A", "text": "Alpha paragraph one."},
    {"id": "A!x", "title": "A!x", "text": "A one-passage row is its own document."},
    {"id": "C#_lang#0", "title": "C#", "text": "A hash that is not a passage number."},
    *({"id": f"b-{i}", "title": "B", "text": f"Bravo number {i}."} for i in range(4)),
]
DOCUMENTS = sorted(
    ["oil", "A B", "A C", "A D", "A", "A!x", "C#_lang", *(f"b-{i}" for i in range(4))]
)
PASSAGES = {
    "oil": ["oil#0#0", "oil#0#1", "oil#1", "oil#2"],
    "A": ["A#0", "A#1"],
    "A!x": ["A!x"],
    "C#_lang": ["C#_lang#0"],
}


@pytest.fixture(scope="module")
def built_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("built")
    source = write_jsonl(root / "paragraphs.jsonl", ROWS)
    build_index([source], root / INDEX, IndexSpec(name=INDEX), BuildOptions(progress=False))
    return root


@pytest.fixture
def index_root(built_root: Path, tmp_path: Path) -> Path:
    """A fresh copy of the built index per test: a write adopts it in place."""
    shutil.copytree(built_root / INDEX, tmp_path / "indexes" / INDEX)
    return tmp_path / "indexes"


@pytest.fixture
def retriever(index_root, redis_url):
    settings = RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=index_root,
        default_index=INDEX,
        redis_url=redis_url,
        admin_token=TOKEN,
    )
    with retriever_service(settings) as running:
        yield running


def list_all(stub, limit: int) -> list[str]:
    ids: list[str] = []
    cursor = ""
    while True:
        page = stub.ListDocuments(
            retriever_pb2.ListDocumentsRequest(index=INDEX, cursor=cursor, limit=limit)
        )
        assert len(page.ids) <= limit
        ids += page.ids
        if not page.next_cursor:
            return ids
        assert page.next_cursor == page.ids[-1]
        cursor = page.next_cursor


def get(stub, doc_id: str):
    return stub.GetDocument(retriever_pb2.GetDocumentRequest(index=INDEX, id=doc_id))


@pytest.mark.parametrize("scan", [1, 2, 3, 5, 1000])
def test_each_built_document_is_listed_once_in_id_order(retriever, monkeypatch, scan):
    stub, _, _ = retriever
    monkeypatch.setattr(built_documents, "_SCAN", scan)  # passage ids read per step
    for limit in (1, 2, 3, 4, 100):
        assert list_all(stub, limit) == DOCUMENTS, (scan, limit)
    page = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index=INDEX, cursor="A", limit=2))
    assert (list(page.ids), page.next_cursor, page.version) == (["A B", "A C"], "A C", 0)
    page = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index=INDEX, cursor="b-3"))
    assert (list(page.ids), page.next_cursor) == (["oil"], "")


def test_every_listed_document_is_found_and_no_passage_id_is_a_document(retriever):
    stub, _, _ = retriever
    for doc_id in list_all(stub, 100):
        got = get(stub, doc_id)
        assert got.id == doc_id and got.passage_ids
        assert list(got.passage_ids) == PASSAGES.get(doc_id, list(got.passage_ids))
    oil = get(stub, "oil")
    assert oil.title == "Oil crisis" and oil.text.startswith("The embargo began in October.")
    assert oil.text.endswith("Rationing followed in Europe.")
    for passage in ("oil#0", "oil#0#1", "oil#1", "A#0"):
        with pytest.raises(grpc.RpcError) as err:
            get(stub, passage)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, passage


def test_a_filter_on_id_takes_every_passage_of_the_document(retriever):
    stub, _, _ = retriever
    reply = stub.Retrieve(
        retriever_pb2.RetrieveRequest(
            queries=["embargo crude prices"],
            k=10,
            index=INDEX,
            retrieval="dense",  # every passage the filter keeps is scored
            filter_json=json.dumps({"_id": "oil"}),
        )
    )
    assert sorted(p.id for p in reply.results[0].passages) == PASSAGES["oil"]


def test_the_adoption_keeps_the_same_documents(retriever):
    stub, _, servicer = retriever
    before = {doc_id: get(stub, doc_id) for doc_id in DOCUMENTS}
    stub.PutDocuments(
        retriever_pb2.PutDocumentsRequest(
            index=INDEX,
            documents=[retriever_pb2.Document(id="zz", title="Z", text="Zulu.")],
        ),
        metadata=bearer_metadata(TOKEN),
    )
    assert servicer.registry.is_live(INDEX)
    assert list_all(stub, 3) == [*DOCUMENTS, "zz"]
    for doc_id, was in before.items():
        now = get(stub, doc_id)
        assert (now.title, now.text, list(now.passage_ids)) == (
            was.title,
            was.text,
            list(was.passage_ids),
        )
    # Replacing the document replaces every passage the build gave it.
    stub.PutDocuments(
        retriever_pb2.PutDocumentsRequest(
            index=INDEX,
            documents=[retriever_pb2.Document(id="oil", title="Oil", text="One passage now.")],
        ),
        metadata=bearer_metadata(TOKEN),
    )
    assert list(get(stub, "oil").passage_ids) == ["oil#0"]
    reply = stub.Retrieve(
        retriever_pb2.RetrieveRequest(
            queries=["embargo crude"], k=20, index=INDEX, retrieval="bm25"
        )
    )
    assert not {p.id for p in reply.results[0].passages} & set(PASSAGES["oil"][1:])


def test_the_gateway_lists_and_gets_built_documents(retriever, redis_url, monkeypatch):
    _, service, _ = retriever
    monkeypatch.setattr(built_documents, "_SCAN", 3)
    settings = GatewaySettings(
        retriever_addr=f"127.0.0.1:{service.port}",
        generator_addr=f"127.0.0.1:{free_port()}",  # nothing listens: no answers asked here
        redis_url=redis_url,
        admin_token=TOKEN,
    )
    with TestClient(create_app(settings)) as client:
        seen: list[str] = []
        cursor = ""
        while True:
            page = client.get(f"/indexes/{INDEX}/documents", params={"cursor": cursor, "limit": 2})
            assert page.status_code == 200, page.text
            seen += page.json()["ids"]
            cursor = page.json()["next_cursor"]
            if cursor is None:
                break
        assert seen == DOCUMENTS
        got = client.get(f"/indexes/{INDEX}/documents/oil")
        assert got.status_code == 200, got.text
        assert got.json()["passage_ids"] == PASSAGES["oil"]
        assert client.get(f"/indexes/{INDEX}/documents/oil%230").status_code == 404
