"""The retriever on the Milvus engine (issue 41), real Milvus Lite, no mocks.

``OPENBOOK_INDEX_ENGINE=milvus``: the fact indexes are built as files, copied into Milvus with
``openbook index to-milvus`` (their stored vectors), and served from there by the real
retriever through the same servicer code paths as the files engine.

* Through the gateway (a retriever on an in-process Milvus Lite, a ``.db`` path; the real tiny
  generator): ``GET /indexes``, ``POST /answer`` with and without a ``filter``, in each
  retrieval mode (the BM25 view is in the engine too), the documents API (batch, PUT, GET,
  list, DELETE with versions), and a hot swap.
* Two retrievers sharing one ``milvus-lite server`` (as replicas share a cluster): a write
  through one is read and searched through the other, indexes created through one are listed
  by the other; a Milvus that is down answers UNAVAILABLE (the gateway's 503), never INTERNAL,
  and both serve again once it is back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from openbook.index.cli import app as index_cli
from openbook.index.engine import EngineKind
from openbook.serving.grpc_server import bearer_metadata
from openbook.v1 import retriever_pb2
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.index import PLAYS
from openbook_testkit.milvus import LiteServer, copy_to_milvus
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import (
    backends_serving,
    build_fact_indexes,
    free_port,
    retriever_service,
)

pytest.importorskip("milvus_lite")

TOKEN = "milvus-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = bearer_metadata(TOKEN)
SHORT = {"max_new_tokens": 2}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """facts-a and facts-b as built files indexes (MiniLM, flat, dense + BM25)."""
    root = tmp_path_factory.mktemp("built")
    build_fact_indexes(root)
    return root


def test_the_copy_command_refuses_what_milvus_cannot_hold(built, tmp_path):
    uri = str(tmp_path / "milvus.db")
    args = ["to-milvus", str(built / "facts-a"), "--uri", uri, "--name", "pq", "--type", "bm25"]
    refused = CliRunner().invoke(index_cli, args)
    assert refused.exit_code == 2
    assert "index_type: 'bm25' is not offered by the milvus engine" in refused.output
    missing = CliRunner().invoke(index_cli, ["to-milvus", str(tmp_path / "nope"), "--uri", uri])
    assert missing.exit_code == 2 and "error:" in missing.output
    hnsw = CliRunner().invoke(index_cli, [*args[:-1], "hnsw"])
    assert hnsw.exit_code == 0, hnsw.output
    assert "as 'pq' (hnsw, dim 384, views: dense, bm25)" in hnsw.output
    again = CliRunner().invoke(index_cli, [*args[:-1], "hnsw"])
    assert again.exit_code == 2 and "already exists" in again.output


def milvus_settings(uri: str, redis_url: str, workdir: Path) -> RetrieverSettings:
    return RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_engine=EngineKind.MILVUS,
        milvus_uri=uri,
        index_root=workdir / "no-indexes-here",  # the engine holds them: never read
        default_index="facts-a",
        redis_url=redis_url,
        checkpoint_dir=workdir / "checkpoints",
        admin_token=TOKEN,
    )


# --- one retriever on an in-process Milvus Lite, through the gateway -------------------------


@pytest.fixture(scope="module")
def lite_client(built, tmp_path_factory, redis_server) -> Iterator[TestClient]:
    work = tmp_path_factory.mktemp("lite")
    uri = str(work / "milvus.db")
    copy_to_milvus(built, uri, "facts-a", "facts-b")
    redis_server.flush()  # no active index, version or cached answer of another module
    retriever = milvus_settings(uri, redis_server.url, work)
    generator = GeneratorSettings(
        host="127.0.0.1",
        port=0,
        model=make_tiny_bart(work / "tiny-bart"),
        redis_url=redis_server.url,
        checkpoint_dir=work / "checkpoints",
        admin_token=TOKEN,
    )
    with backends_serving(retriever, generator) as backends:
        assert not (work / "no-indexes-here").exists()
        settings = backends.gateway_settings(redis_server.url, admin_token=TOKEN)
        with TestClient(create_app(settings)) as client:
            yield client
    redis_server.flush()


def _answer(client: TestClient, **body) -> dict:
    reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 3, **SHORT, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _docs(answer: dict) -> list[str]:
    return [p["id"].split("#")[0] for p in answer["passages"]]


def test_the_gateway_serves_answers_documents_and_swaps_from_milvus(lite_client):
    client = lite_client
    listed = client.get("/indexes")
    assert listed.status_code == 200, listed.text
    indexes = {i["name"]: i for i in listed.json()["indexes"]}
    assert listed.json()["active"] == "facts-a" and set(indexes) == {"facts-a", "facts-b"}
    assert indexes["facts-a"]["count"] == 30 and indexes["facts-a"]["index_type"] == "flat"
    assert indexes["facts-a"]["loadable"] and indexes["facts-a"]["problem"] is None
    assert {i["engine"] for i in indexes.values()} == {"milvus"}
    assert indexes["facts-a"]["views"] == ["dense", "bm25"]

    plain = _answer(client)
    assert plain["index"] == "facts-a" and "p21" in _docs(plain)  # Hamlet itself

    batch = client.post("/indexes/facts-a/documents:batch", json={"documents": PLAYS}, headers=AUTH)
    assert batch.status_code == 200, batch.text
    assert batch.json()["version"] == 1
    french = _answer(client, filter={"lang": "fr"})
    assert sorted(_docs(french)) == ["cid", "phedre"]  # the two matching, though k is 3
    mixed = _answer(client, filter={"$or": [{"year": {"$in": [1606, 1637]}}, {"_id": "p21"}]})
    assert sorted(_docs(mixed)) == ["cid", "macbeth", "p21"]
    assert _answer(client, filter={"lang": "de"})["passages"] == []

    hamlet = {
        "title": "Hamlet",
        "text": "Hamlet was written by William Shakespeare.",
        "metadata": {"lang": "en"},
    }
    put = client.put("/indexes/facts-a/documents/hamlet-note", json=hamlet, headers=AUTH)
    assert put.status_code == 200, put.text
    assert put.json() == {"index": "facts-a", "id": "hamlet-note", "passages": 1, "version": 2}
    got = client.get("/indexes/facts-a/documents/hamlet-note")
    assert got.status_code == 200, got.text
    assert {k: got.json()[k] for k in ("title", "text", "metadata")} == hamlet
    assert got.json()["passage_ids"] == ["hamlet-note#0"]
    english = _answer(client, filter={"lang": "en"})
    assert sorted(_docs(english)) == ["hamlet-note", "macbeth"]
    listed_docs = client.get("/indexes/facts-a/documents", params={"limit": 2})
    assert listed_docs.status_code == 200, listed_docs.text
    assert listed_docs.json()["ids"] == ["cid", "hamlet-note"]
    gone = client.delete("/indexes/facts-a/documents/hamlet-note", headers=AUTH)
    assert gone.status_code == 200, gone.text
    assert gone.json()["version"] == 3
    assert client.get("/indexes/facts-a/documents/hamlet-note").status_code == 404
    assert _docs(_answer(client, filter={"lang": "en"})) == ["macbeth"]
    assert client.get("/indexes").json()["indexes"][0]["count"] == 33  # 30 facts + 3 plays

    # Both views in the engine: BM25 and the fused hybrid, the filter applied to both.
    for mode in ("bm25", "hybrid"):
        found = _answer(client, retrieval=mode)
        assert found["retrieval"] == mode and "p21" in _docs(found), found
        assert _docs(_answer(client, retrieval=mode, filter={"lang": "en"})) == ["macbeth"]

    swapped = client.post("/admin/swap-index", json={"index": "facts-b"}, headers=AUTH)
    assert swapped.status_code == 200, swapped.text
    after = _answer(client)
    assert after["index"] == "facts-b" and "b-p21" in _docs(after)
    back = client.post("/admin/swap-index", json={"index": "facts-a"}, headers=AUTH)
    assert back.status_code == 200, back.text


# --- two retrievers sharing one milvus-lite server ------------------------------------------


def _gateway_settings(retriever_port: int, redis_url: str) -> GatewaySettings:
    return GatewaySettings(
        retriever_addr=f"127.0.0.1:{retriever_port}",
        generator_addr=f"127.0.0.1:{free_port()}",  # not asked: no answer is generated
        redis_url=redis_url,
        admin_token=TOKEN,
    )


def _document(doc_id: str, text: str, **metadata) -> retriever_pb2.Document:
    return retriever_pb2.Document(
        id=doc_id, title="Quentaria", text=text, metadata_json=json.dumps(metadata)
    )


def _top(stub, query: str, index: str = "facts-a", **request) -> list[str]:
    reply = stub.Retrieve(
        retriever_pb2.RetrieveRequest(queries=[query], k=3, index=index, **request)
    )
    return [p.id for p in reply.results[0].passages]


def _code(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value


def test_two_retrievers_share_one_milvus_lite_server(built, tmp_path, redis_url):
    server = LiteServer(tmp_path / "milvus-data")
    server.start()
    try:
        copy_to_milvus(built, server.uri, "facts-a")
        settings = milvus_settings(server.uri, redis_url, tmp_path)
        with (
            retriever_service(settings) as (one, service, _),
            retriever_service(settings) as (two, _, _),
            TestClient(create_app(_gateway_settings(service.port, redis_url))) as gateway,
        ):
            zorblax = "The zorblax lighthouse of Quentaria was built from green glass in 1907."
            put = one.PutDocuments(
                retriever_pb2.PutDocumentsRequest(
                    index="facts-a", documents=[_document("zorblax", zorblax, lang="en")]
                ),
                metadata=ADMIN,
            )
            assert put.version == 1
            # Read, searched and filtered through the other replica at once.
            got = two.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-a", id="zorblax"))
            assert got.text == zorblax and list(got.passage_ids) == ["zorblax#0"]
            question = "What was the zorblax lighthouse built from?"
            assert _top(two, question)[0] == "zorblax#0"
            reply = two.Retrieve(
                retriever_pb2.RetrieveRequest(
                    queries=[question], k=3, index="facts-a", filter_json='{"lang": "en"}'
                )
            )
            assert [p.id for p in reply.results[0].passages] == ["zorblax#0"]
            assert reply.index_version == 1
            assert _top(two, question, retrieval="bm25")[0] == "zorblax#0"
            assert _top(two, question, retrieval="hybrid")[0] == "zorblax#0"

            two.CreateIndex(
                retriever_pb2.CreateIndexRequest(name="notes", like="facts-a"), metadata=ADMIN
            )
            infos = one.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes
            assert [(i.name, i.engine) for i in infos] == [
                ("facts-a", "milvus"),
                ("notes", "milvus"),
            ]
            deleted = two.DeleteDocument(
                retriever_pb2.DeleteDocumentRequest(index="facts-a", id="zorblax"), metadata=ADMIN
            )
            assert deleted.version == 2
            missing = _code(
                one.GetDocument, retriever_pb2.GetDocumentRequest(index="facts-a", id="zorblax")
            )
            assert missing.code() == grpc.StatusCode.NOT_FOUND
            assert "zorblax#0" not in _top(one, question)

            # Milvus down: UNAVAILABLE for searches, reads and writes, never INTERNAL.
            assert gateway.get("/indexes").status_code == 200
            server.stop()
            listing = gateway.get("/indexes")
            assert listing.status_code == 503, listing.text
            for call, request in (
                (one.Retrieve, retriever_pb2.RetrieveRequest(queries=[question], k=3)),
                (two.GetDocument, retriever_pb2.GetDocumentRequest(index="facts-a", id="p1")),
                (one.ListIndexes, retriever_pb2.ListIndexesRequest()),
            ):
                down = _code(call, request, timeout=60)
                assert down.code() == grpc.StatusCode.UNAVAILABLE, down.details()
                assert "Milvus at http://127.0.0.1:" in down.details()
            down = _code(
                two.PutDocuments,
                retriever_pb2.PutDocumentsRequest(
                    index="facts-a", documents=[_document("late", "too late")]
                ),
                metadata=ADMIN,
                timeout=60,
            )
            assert down.code() == grpc.StatusCode.UNAVAILABLE, down.details()

            # Back on the same port and data: both serve again, the writes kept.
            server.start()
            assert _top(one, question)[0] != "zorblax#0"
            assert "p21" in _top(two, "Who wrote Hamlet?")
            names = [i.name for i in two.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes]
            assert names == ["facts-a", "notes"]
    finally:
        server.stop()


def test_a_retriever_copies_its_default_index_into_an_empty_milvus(built, tmp_path, redis_url):
    """compose's init builds the demo index as files: a retriever on the milvus engine whose
    Milvus lacks its default index copies it in from the index root, once, and serves it."""
    uri = str(tmp_path / "milvus.db")
    settings = milvus_settings(uri, redis_url, tmp_path).model_copy(update={"index_root": built})
    with retriever_service(settings) as (stub, _, servicer):
        listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
        assert [(i.name, i.engine, i.count) for i in listed.indexes] == [("facts-a", "milvus", 30)]
        assert listed.active == "facts-a"
        assert "p21" in [p.split("#")[0] for p in _top(stub, "Who wrote Hamlet?")]
        stub.PutDocuments(
            retriever_pb2.PutDocumentsRequest(
                index="facts-a", documents=[_document("kept", "A written document.")]
            ),
            metadata=ADMIN,
        )
    servicer.close()  # Milvus Lite's .db: one client at a time
    # Started again: Milvus's copy is served as it is (the write kept), never copied over.
    with retriever_service(settings) as (stub, _, _):
        got = stub.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-a", id="kept"))
        assert got.text == "A written document."
        listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
        assert [(i.name, i.version) for i in listed.indexes] == [("facts-a", 1)]
