"""The retriever's documents RPCs over gRPC on loopback (issue 32): live indexes, writes seen by
the next Retrieve, built indexes adopted on their first write, writes kept across restarts."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from openbook.index.documents import Document
from openbook.index.live import LiveIndex
from openbook.security.sealing import default_sealer
from openbook.serving.grpc_server import bearer_metadata
from openbook.state.redis_protocol import INDEX_STATE_KEY, open_index_state
from openbook.state.shared_state import redis_client
from openbook.v1 import retriever_pb2
from openbook_retriever.registry import IndexRegistry
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.stack import build_fact_indexes, retriever_service

TOKEN = "documents-admin-token"
ADMIN = bearer_metadata(TOKEN)
ZORBLAX = "The zorblax lighthouse of Quentaria was built from green glass in 1907."


@pytest.fixture(scope="module")
def built_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("built")
    build_fact_indexes(root)
    return root


@pytest.fixture
def index_root(built_root: Path, tmp_path: Path) -> Path:
    """A fresh copy of the two built fact indexes per test: writes change them."""
    root = tmp_path / "indexes"
    root.mkdir()
    for name in ("facts-a", "facts-b"):
        shutil.copytree(built_root / name, root / name)
    return root


def settings_for(index_root: Path, redis_url: str, **overrides) -> RetrieverSettings:
    return RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=index_root,
        default_index="facts-a",
        redis_url=redis_url,
        admin_token=TOKEN,
        **overrides,
    )


@pytest.fixture
def retriever(index_root, redis_url):
    with retriever_service(settings_for(index_root, redis_url)) as running:
        yield running


def document(doc_id: str, text: str, title: str = "Quentaria", **metadata):
    return retriever_pb2.Document(
        id=doc_id, title=title, text=text, metadata_json=json.dumps(metadata)
    )


def put(stub, index: str, *docs, metadata=ADMIN):
    return stub.PutDocuments(
        retriever_pb2.PutDocumentsRequest(index=index, documents=list(docs)), metadata=metadata
    )


def top_ids(stub, index: str, query: str, k: int = 3) -> tuple[list[str], int]:
    reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=[query], k=k, index=index))
    return [p.id for p in reply.results[0].passages], reply.index_version


def hidden_dirs(root: Path, name: str) -> list[str]:
    """What an adoption or a delete of ``name`` left beside it, once its background removal
    had a few seconds."""
    for _ in range(100):
        left = sorted(
            p.name for p in root.iterdir() if p.name.startswith(f".{name}.") and p.is_dir()
        )
        if not left:
            break
        time.sleep(0.05)
    return left


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value


def test_put_replace_delete_are_seen_by_the_next_retrieve(retriever):
    stub, service, servicer = retriever
    reply = put(stub, "facts-b", document("zorblax", ZORBLAX, lang="en"))
    assert (reply.index, reply.version, list(reply.passages)) == ("facts-b", 1, [1])
    assert servicer.registry.is_live("facts-b")  # the built index was adopted

    ids, version = top_ids(stub, "facts-b", ZORBLAX)
    assert ids[0] == "zorblax#0" and version == 1
    for mode in ("dense", "bm25", "hybrid"):
        reply = stub.Retrieve(
            retriever_pb2.RetrieveRequest(
                queries=["zorblax lighthouse"], k=2, index="facts-b", retrieval=mode
            )
        )
        assert reply.results[0].passages[0].id == "zorblax#0", mode
        assert (reply.retrieval, reply.index_version) == (mode, 1)
    got = stub.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-b", id="zorblax"))
    assert (got.text, json.loads(got.metadata_json), list(got.passage_ids)) == (
        ZORBLAX,
        {"lang": "en"},
        ["zorblax#0"],
    )

    replaced = "Penguins of the southern ice sheets dive for krill in winter darkness."
    assert put(stub, "facts-b", document("zorblax", replaced)).version == 2
    reply = stub.Retrieve(
        retriever_pb2.RetrieveRequest(queries=[ZORBLAX, replaced], k=3, index="facts-b")
    )
    texts = [p.text for r in reply.results for p in r.passages]
    assert ZORBLAX not in texts and reply.results[1].passages[0].id == "zorblax#0"
    assert reply.index_version == 2

    page = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index="facts-b", limit=100))
    assert "zorblax" in page.ids and "b-p21" in page.ids and page.version == 2

    deleted = stub.DeleteDocument(
        retriever_pb2.DeleteDocumentRequest(index="facts-b", id="zorblax"), metadata=ADMIN
    )
    assert deleted.version == 3
    ids, version = top_ids(stub, "facts-b", replaced, k=10)
    assert "zorblax#0" not in ids and version == 3
    err = rpc_error(
        stub.GetDocument, retriever_pb2.GetDocumentRequest(index="facts-b", id="zorblax")
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(
        stub.DeleteDocument,
        retriever_pb2.DeleteDocumentRequest(index="facts-b", id="zorblax"),
        metadata=ADMIN,
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    infos = {i.name: i for i in stub.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes}
    assert infos["facts-b"].version == 3 and infos["facts-b"].count == 30
    assert infos["facts-b"].problem == "" and infos["facts-a"].version == 0

    scraped = generate_latest(service.metrics.registry).decode()
    assert 'openbook_index_version{index="facts-b",service="retriever"} 3.0' in scraped

    # A live index swaps in as a built one does, and swaps back out.
    swapped = stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="facts-b"), metadata=ADMIN)
    assert swapped.info.active and swapped.info.version == 3
    reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=[replaced], k=1))
    assert (reply.index, reply.index_version) == ("facts-b", 3)
    if swapped.previous and swapped.previous != "facts-b":
        stub.SwapIndex(retriever_pb2.SwapIndexRequest(name=swapped.previous), metadata=ADMIN)


def test_list_documents_pages_with_a_cursor(retriever):
    stub, _, _ = retriever
    put(stub, "facts-b", document("zz-1", ZORBLAX), document("zz-2", ZORBLAX + " Again."))
    ids: list[str] = []
    cursor = ""
    while True:
        page = stub.ListDocuments(
            retriever_pb2.ListDocumentsRequest(index="facts-b", cursor=cursor, limit=7)
        )
        ids += page.ids
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert ids == sorted(ids) and len(ids) == 32 and ids[-2:] == ["zz-1", "zz-2"]


def test_create_write_and_delete_an_index(retriever, index_root):
    stub, _, _ = retriever
    info = stub.CreateIndex(
        retriever_pb2.CreateIndexRequest(name="fresh", like="facts-a"), metadata=ADMIN
    )
    assert (info.name, info.count, info.index_type, info.problem) == ("fresh", 0, "flat", "")
    err = rpc_error(
        stub.CreateIndex, retriever_pb2.CreateIndexRequest(name="fresh"), metadata=ADMIN
    )
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS

    assert put(stub, "fresh", document("zorblax", ZORBLAX)).version == 1
    ids, version = top_ids(stub, "fresh", ZORBLAX)
    assert ids == ["zorblax#0"] and version == 1
    names = [i.name for i in stub.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes]
    assert "fresh" in names

    stub.DeleteIndex(retriever_pb2.DeleteIndexRequest(name="fresh"), metadata=ADMIN)
    assert hidden_dirs(index_root, "fresh") == [] and not (index_root / "fresh").exists()
    err = rpc_error(stub.Retrieve, retriever_pb2.RetrieveRequest(queries=["q"], k=1, index="fresh"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    active = stub.ListIndexes(retriever_pb2.ListIndexesRequest()).active
    err = rpc_error(stub.DeleteIndex, retriever_pb2.DeleteIndexRequest(name=active), metadata=ADMIN)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = rpc_error(
        stub.DeleteIndex, retriever_pb2.DeleteIndexRequest(name="nowhere"), metadata=ADMIN
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("index_type", "views"), [("", ["dense", "bm25"]), ("bm25", ["bm25"])])
def test_an_index_created_without_like_has_the_default_encoder(retriever, index_type, views):
    stub, _, _ = retriever
    info = stub.CreateIndex(
        retriever_pb2.CreateIndexRequest(name="plain", type=index_type), metadata=ADMIN
    )
    like = {i.name: i for i in stub.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes}
    assert (info.index_type, list(info.views)) == (index_type or "flat", views)
    if index_type != "bm25":  # the facts indexes were built with the default encoder
        assert (info.encoder, info.dim) == (like["facts-a"].encoder, like["facts-a"].dim)
    put(stub, "plain", document("zorblax", ZORBLAX), document("other", "Krill and penguins."))
    ids, version = top_ids(stub, "plain", "zorblax lighthouse Quentaria", k=1)
    assert ids == ["zorblax#0"] and version == 1


BAD = "facts-b"


@pytest.mark.parametrize(
    ("rpc", "request_message", "field"),
    [
        ("PutDocuments", retriever_pb2.PutDocumentsRequest(index=BAD), "documents"),
        (
            "PutDocuments",
            retriever_pb2.PutDocumentsRequest(index="bad/name", documents=[document("a", ZORBLAX)]),
            "index",
        ),
        (
            "PutDocuments",
            retriever_pb2.PutDocumentsRequest(
                index=BAD,
                documents=[
                    document("a", ZORBLAX),
                    document("b", ZORBLAX),
                    document("c", ZORBLAX),
                    retriever_pb2.Document(id="d", title="t", text=ZORBLAX, metadata_json="[1]"),
                ],
            ),
            "documents[3].metadata",
        ),
        (
            "PutDocuments",
            retriever_pb2.PutDocumentsRequest(
                index=BAD, documents=[document("a", ZORBLAX, tags="x"), document("a/b", "t")]
            ),
            "documents[1].id",
        ),
        (
            "PutDocuments",
            retriever_pb2.PutDocumentsRequest(index=BAD, documents=[document("a", "   ")]),
            "documents[0].text",
        ),
        (
            "PutDocuments",
            retriever_pb2.PutDocumentsRequest(
                index=BAD,
                documents=[retriever_pb2.Document(id="a", text="t", metadata_json="{bad")],
            ),
            "documents[0].metadata",
        ),
        ("DeleteDocument", retriever_pb2.DeleteDocumentRequest(index=BAD, id=""), "id"),
        ("GetDocument", retriever_pb2.GetDocumentRequest(index="", id="a"), "index"),
        ("ListDocuments", retriever_pb2.ListDocumentsRequest(index=BAD, limit=-1), "limit"),
        ("ListDocuments", retriever_pb2.ListDocumentsRequest(index=BAD, limit=5000), "limit"),
        ("CreateIndex", retriever_pb2.CreateIndexRequest(name="-x"), "name"),
        ("CreateIndex", retriever_pb2.CreateIndexRequest(name="x", type="btree"), "type"),
        (
            "CreateIndex",
            retriever_pb2.CreateIndexRequest(name="x", type="bm25", like="facts-a"),
            "type",
        ),
        ("DeleteIndex", retriever_pb2.DeleteIndexRequest(name=""), "name"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    retriever, index_root, rpc, request_message, field
):
    stub, _, _ = retriever
    before = sorted(p.name for p in (index_root / "facts-b").iterdir())
    err = rpc_error(getattr(stub, rpc), request_message, metadata=ADMIN)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(field), err.details()
    assert sorted(p.name for p in (index_root / "facts-b").iterdir()) == before  # unchanged


def test_unknown_index_is_not_found(retriever):
    stub, _, _ = retriever
    for call, request in (
        (
            stub.PutDocuments,
            retriever_pb2.PutDocumentsRequest(index="nowhere", documents=[document("a", ZORBLAX)]),
        ),
        (stub.DeleteDocument, retriever_pb2.DeleteDocumentRequest(index="nowhere", id="a")),
        (stub.GetDocument, retriever_pb2.GetDocumentRequest(index="nowhere", id="a")),
        (stub.ListDocuments, retriever_pb2.ListDocumentsRequest(index="nowhere")),
        (stub.CreateIndex, retriever_pb2.CreateIndexRequest(name="x", like="nowhere")),
    ):
        assert rpc_error(call, request, metadata=ADMIN).code() == grpc.StatusCode.NOT_FOUND


def test_writes_without_the_admin_token_are_unauthenticated(retriever, index_root):
    stub, _, _ = retriever
    for call, request in (
        (
            stub.PutDocuments,
            retriever_pb2.PutDocumentsRequest(index="facts-b", documents=[document("a", ZORBLAX)]),
        ),
        (stub.DeleteDocument, retriever_pb2.DeleteDocumentRequest(index="facts-b", id="b-p21")),
        (stub.CreateIndex, retriever_pb2.CreateIndexRequest(name="x")),
        (stub.DeleteIndex, retriever_pb2.DeleteIndexRequest(name="facts-b")),
    ):
        for metadata in ((), bearer_metadata("wrong")):
            err = rpc_error(call, request, metadata=metadata)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (index_root / "facts-b" / "manifest.json").is_file()  # still the built index


def test_a_built_index_is_adopted_on_its_first_write_without_failing_a_search(
    retriever, index_root
):
    stub, _, servicer = retriever
    active = stub.ListIndexes(retriever_pb2.ListIndexesRequest()).active
    failures: list[str] = []
    answered = [0]
    done = threading.Event()

    def search() -> None:
        while not done.is_set():
            try:
                reply = stub.Retrieve(
                    retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=3, index=active),
                    timeout=30,
                )
                assert len(reply.results[0].passages) == 3
                answered[0] += 1
            except (grpc.RpcError, AssertionError) as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=search) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        while answered[0] < 3 and not failures:  # searches are running when the write comes
            threading.Event().wait(0.02)
        reply = put(stub, active, document("zorblax", ZORBLAX))
        after = answered[0]
        ids, version = top_ids(stub, active, ZORBLAX)
        while answered[0] < after + 6 and not failures:
            threading.Event().wait(0.05)
    finally:
        done.set()
        for t in threads:
            t.join(30)
    assert failures == []
    assert reply.version == 1 and ids[0] == "zorblax#0" and version == 1
    assert servicer.registry.is_live(active)
    assert hidden_dirs(index_root, active) == []  # the built one went after its last search
    # The adopted index keeps the built one's passages and identity.
    info = {i.name: i for i in stub.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes}
    assert info[active].count == 31 and info[active].active and info[active].problem == ""


def test_a_restart_keeps_every_acknowledged_write(index_root, redis_url):
    settings = settings_for(index_root, redis_url)
    with retriever_service(settings) as (stub, _, servicer):
        for i in range(5):
            put(stub, "facts-b", document(f"zz-{i}", f"{ZORBLAX} Number {i}."))
        stub.DeleteDocument(
            retriever_pb2.DeleteDocumentRequest(index="facts-b", id="zz-2"), metadata=ADMIN
        )
        stub.DeleteDocument(
            retriever_pb2.DeleteDocumentRequest(index="facts-b", id="b-p21"), metadata=ADMIN
        )
        before = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index="facts-b", limit=1000))
    # What a process exit does: the indexes close and the writer lock is dropped.
    servicer.close()
    servicer.registry.close()
    assert before.version == 7
    with retriever_service(settings) as (stub, _, _):
        after = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index="facts-b", limit=1000))
        assert (list(after.ids), after.version) == (list(before.ids), 7)
        got = stub.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-b", id="zz-4"))
        assert got.text == f"{ZORBLAX} Number 4."
        ids, version = top_ids(stub, "facts-b", f"{ZORBLAX} Number 2.", k=10)
        assert "zz-2#0" not in ids and "b-p21" not in ids and version == 7
        assert put(stub, "facts-b", document("zz-9", ZORBLAX)).version == 8


def test_another_replica_catches_up_and_writes_too(retriever, index_root):
    stub, _, _ = retriever
    other = IndexRegistry(index_root)  # another replica on the same volume
    try:
        with other.lease("facts-b") as index:
            assert not isinstance(index, LiveIndex)  # built, until the first write
        put(stub, "facts-b", document("zorblax", ZORBLAX))
        with other.lease("facts-b") as index:  # sees the adoption and the write
            assert isinstance(index, LiveIndex) and index.version == 1
        penguins = "Penguins of the southern ice sheets dive for krill in winter darkness."
        with other.writer("facts-b") as live:  # a write reaching the other replica lands
            assert live.put(Document.create("penguins", "Ice", penguins)).version == 2
        ids, version = top_ids(stub, "facts-b", penguins)  # and this one serves it next
        assert ids[0] == "penguins#0" and version == 2
        got = stub.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-b", id="penguins"))
        assert got.text == penguins
        assert put(stub, "facts-b", document("zz-3", ZORBLAX)).version == 3  # versions follow
        with other.lease("facts-b") as index:
            assert index.version == 3 and index.get("zz-3").document.text == ZORBLAX
    finally:
        other.close()


def test_a_built_index_lists_and_gets_its_documents_before_any_write(retriever, index_root):
    stub, _, servicer = retriever
    page = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index="facts-b", limit=7))
    ids, cursor = list(page.ids), page.next_cursor
    while cursor:
        page = stub.ListDocuments(
            retriever_pb2.ListDocumentsRequest(index="facts-b", cursor=cursor, limit=7)
        )
        ids, cursor = ids + list(page.ids), page.next_cursor
    got = stub.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-b", id=ids[0]))
    assert page.version == 0 and len(got.passage_ids) >= 1
    err = rpc_error(stub.GetDocument, retriever_pb2.GetDocumentRequest(index="facts-b", id="no"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert not servicer.registry.is_live("facts-b")  # a read adopts nothing
    # The same documents its adoption makes: the first write changes nothing else.
    put(stub, "facts-b", document("zz-new", ZORBLAX))
    after = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index="facts-b", limit=1000))
    assert list(after.ids) == sorted([*ids, "zz-new"]) and ids == sorted(ids)
    adopted = stub.GetDocument(retriever_pb2.GetDocumentRequest(index="facts-b", id=ids[0]))
    assert (adopted.title, adopted.text, list(adopted.passage_ids)) == (
        got.title,
        got.text,
        list(got.passage_ids),
    )


def test_an_index_removed_out_of_band_raises_its_cache_epoch(retriever, index_root, redis_url):
    stub, _, servicer = retriever
    client = redis_client(redis_url)
    put(stub, "facts-b", document("zorblax", ZORBLAX))

    def state():
        raw = client.hget(INDEX_STATE_KEY, "facts-b")
        return open_index_state(default_sealer(), "facts-b", raw)

    before = state()
    assert before is not None and before["versions"] == {"": 1}
    servicer.notice_vanished_indexes()  # nothing gone
    assert state() == before
    shutil.rmtree(index_root / "facts-b")  # an operator's rm -rf, not DeleteIndex
    servicer.notice_vanished_indexes()  # what the retriever's watch does every 2 s
    after = state()
    assert after is not None and after["epoch"] != before["epoch"] and after["versions"] == {}
    err = rpc_error(
        stub.Retrieve, retriever_pb2.RetrieveRequest(queries=["q"], k=1, index="facts-b")
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND  # not served from memory either


def test_writes_past_the_threshold_compact_in_the_background(index_root, redis_url):
    with retriever_service(settings_for(index_root, redis_url, compact_passages=2)) as running:
        stub, _, servicer = running
        put(stub, "facts-b", document("zz-1", ZORBLAX))
        put(stub, "facts-b", document("zz-2", f"{ZORBLAX} Twice."))
        servicer.compactor.wait(120)
        with servicer.registry.lease("facts-b") as live:
            assert live.base_version == 2 and live.segment_size == 0
        ids, version = top_ids(stub, "facts-b", ZORBLAX)
        assert set(ids[:2]) == {"zz-1#0", "zz-2#0"} and version == 2
        assert put(stub, "facts-b", document("zz-3", ZORBLAX)).version == 3


def test_concurrent_first_writes_adopt_once_and_all_land(retriever, index_root):
    stub, _, _ = retriever
    versions: list[int] = []
    errors: list[str] = []

    def write(i: int) -> None:
        try:
            versions.append(put(stub, "facts-b", document(f"zz-{i}", f"{ZORBLAX} {i}.")).version)
        except grpc.RpcError as err:
            errors.append(f"{err.code()}: {err.details()}")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and sorted(versions) == [1, 2, 3, 4]
    page = stub.ListDocuments(retriever_pb2.ListDocumentsRequest(index="facts-b", limit=100))
    assert [i for i in page.ids if i.startswith("zz-")] == [f"zz-{i}" for i in range(4)]
    assert hidden_dirs(index_root, "facts-b") == []


def test_an_adoption_cut_short_by_a_crash_is_finished_or_undone(index_root):
    # Crashed between its two renames: the built directory gone, the live copy complete.
    LiveIndex.create(index_root / ".facts-b.adopting", from_index=index_root / "facts-b").close()
    (index_root / "facts-b").rename(index_root / ".facts-b.retired-dead")
    # Crashed while copying: the built index still in place, a partial copy beside it.
    (index_root / ".facts-a.adopting").mkdir()
    registry = IndexRegistry(index_root)
    try:
        assert registry.available() == ["facts-a", "facts-b"]
        assert registry.is_live("facts-b") and not registry.is_live("facts-a")
        assert sorted(p.name for p in index_root.iterdir() if p.name.startswith(".")) == []
        with registry.lease("facts-b") as index:
            assert isinstance(index, LiveIndex) and len(index) == 30
        assert registry.status("facts-b").loadable
    finally:
        registry.close()
