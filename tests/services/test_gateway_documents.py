"""The documents API through the gateway (issue 32), against an in-memory retriever that keeps
the retriever's contract (openbook_testkit.fake_retriever), the real generator and a real Redis.

What is checked: every route's reply and status; writes need the admin token; every bad input
is a 4xx naming the field, refused before the retriever sees it; the retriever's gRPC codes map
to their HTTP statuses; answers report the index's version; a write invalidates a cached
answer (by the version the retriever publishes in Redis, and by the gateway's own memory of
its writes when Redis has none).
"""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis import GenerationMode

from openbook.security.sealing import default_sealer
from openbook.state.redis_protocol import INDEX_STATE_KEY, open_index_state
from openbook.validation.limits import (
    MAX_BATCH_DOCUMENTS,
    MAX_DOCUMENT_ID_CHARS,
    MAX_DOCUMENT_TEXT_CHARS,
    MAX_DOCUMENT_TITLE_CHARS,
    MAX_METADATA_KEYS,
)
from openbook_gateway.app import create_app
from openbook_gateway.retrieval import document_shard
from openbook_gateway.settings import GatewaySettings
from openbook_generator.server import build as build_generator
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.fake_retriever import FakeRetriever, fake_retriever
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import serving_gateway

TOKEN = "documents-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HAMLET = {
    "title": "Hamlet",
    "text": "Hamlet is a tragedy written by William Shakespeare around 1600.",
    "metadata": {"source": "encyclopedia", "year": 1600, "checked": True, "score": 0.5},
}


@pytest.fixture(scope="module")
def generator(tmp_path_factory, redis_server):
    """The real generator (a tiny random BART) on a free loopback port: its address."""

    workdir = tmp_path_factory.mktemp("generator")
    settings = GeneratorSettings(
        host="127.0.0.1",
        port=0,
        model=make_tiny_bart(workdir / "tiny-bart"),
        redis_url=redis_server.url,
        checkpoint_dir=workdir / "checkpoints",
        admin_token=TOKEN,
    )
    server, servicer = build_generator(settings)
    server.set_serving(True)
    server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop(0)
        servicer.close()


@pytest.fixture(scope="module")
def retriever(redis_server):
    with fake_retriever(TOKEN, redis=redis_server.client()) as running:
        yield running


def settings_for(retriever, generator, redis_url: str, **overrides) -> GatewaySettings:
    return GatewaySettings(
        **{
            "retriever_addr": retriever.addr,
            "generator_addr": generator,
            "redis_url": redis_url,
            "admin_token": TOKEN,
            **overrides,
        }
    )


@pytest.fixture
def servicer(retriever, redis_server) -> FakeRetriever:
    # Publishing to Redis as the module's retriever does, whatever an earlier test switched
    # off (test_without_a_published_version_nothing_is_cached): a retriever left silent made
    # every later test's answers uncacheable.
    fresh = FakeRetriever("live", redis_server.client())
    retriever.servicer.__dict__.update(fresh.__dict__)  # every test starts from one empty index
    return retriever.servicer


@pytest.fixture
def client(retriever, generator, redis_url, servicer):
    with TestClient(create_app(settings_for(retriever, generator, redis_url))) as client:
        yield client


def put(client, doc_id: str, body: dict, index: str = "live", headers=AUTH):
    return client.put(f"/indexes/{index}/documents/{doc_id}", json=body, headers=headers)


# --- the routes -----------------------------------------------------------------------------


def test_put_get_list_delete_a_document(client):
    reply = put(client, "hamlet", HAMLET)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"index": "live", "id": "hamlet", "passages": 1, "version": 1}

    got = client.get("/indexes/live/documents/hamlet")
    assert got.status_code == 200, got.text
    assert got.json() == {
        "index": "live",
        "id": "hamlet",
        "title": HAMLET["title"],
        "text": HAMLET["text"],
        "metadata": HAMLET["metadata"],
        "passage_ids": ["hamlet#0"],
    }

    long_text = " ".join(f"word{i}" for i in range(250))  # the paper's 100-word passages: 3
    replaced = put(client, "hamlet", {"title": "Hamlet", "text": long_text})
    assert replaced.json() == {"index": "live", "id": "hamlet", "passages": 3, "version": 2}
    assert client.get("/indexes/live/documents/hamlet").json()["metadata"] == {}

    listed = client.get("/indexes/live/documents")
    assert listed.json() == {"index": "live", "ids": ["hamlet"], "next_cursor": None, "version": 2}

    deleted = client.delete("/indexes/live/documents/hamlet", headers=AUTH)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"version": 3}
    assert client.get("/indexes/live/documents/hamlet").status_code == 404
    again = client.delete("/indexes/live/documents/hamlet", headers=AUTH)
    assert again.status_code == 404
    assert "hamlet" in again.json()["detail"]


def test_a_batch_is_one_version(client):
    documents = [
        {"id": f"doc-{i}", "title": f"Doc {i}", "text": f"text number {i}"} for i in range(5)
    ]
    reply = client.post(
        "/indexes/live/documents:batch", json={"documents": documents}, headers=AUTH
    )
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"index": "live", "version": 1, "passages": [1, 1, 1, 1, 1]}


def test_listing_pages_through_the_ids(client):
    documents = [{"id": f"d{i:02}", "title": "", "text": "some words"} for i in range(7)]
    client.post("/indexes/live/documents:batch", json={"documents": documents}, headers=AUTH)
    seen, cursor = [], ""
    while True:
        page = client.get("/indexes/live/documents", params={"cursor": cursor, "limit": 3})
        assert page.status_code == 200, page.text
        seen += page.json()["ids"]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"d{i:02}" for i in range(7)]


def test_create_and_delete_an_index(client):
    created = client.post("/indexes", json={"name": "notes", "type": "hnsw"}, headers=AUTH)
    assert created.status_code == 201, created.text
    body = created.json()
    assert (body["name"], body["index_type"], body["version"], body["count"]) == (
        "notes",
        "hnsw",
        0,
        0,
    )
    like = client.post("/indexes", json={"name": "notes-2", "like": "notes"}, headers=AUTH)
    assert like.json()["index_type"] == "hnsw"
    assert client.post("/indexes", json={"name": "notes"}, headers=AUTH).status_code == 409
    unknown_like = client.post("/indexes", json={"name": "x", "like": "nope"}, headers=AUTH)
    assert unknown_like.status_code == 404

    put(client, "a", HAMLET, index="notes")
    listed = {i["name"]: i for i in client.get("/indexes").json()["indexes"]}
    assert listed["notes"]["version"] == 1 and listed["live"]["version"] == 0
    assert 'openbook_index_version{index="notes"} 1.0' in client.get("/metrics").text

    assert client.delete("/indexes/notes", headers=AUTH).json() == {"name": "notes"}
    assert client.delete("/indexes/notes", headers=AUTH).status_code == 404
    active = client.delete("/indexes/live", headers=AUTH)
    assert active.status_code == 409
    assert "active" in active.json()["detail"]


def test_unknown_index_is_404(client):
    assert put(client, "a", HAMLET, index="nope").status_code == 404
    assert client.get("/indexes/nope/documents/a").status_code == 404
    assert client.get("/indexes/nope/documents").status_code == 404


def test_the_retrievers_refusal_of_a_type_is_422_naming_it(client):
    reply = client.post("/indexes", json={"name": "odd", "type": "annoy"}, headers=AUTH)
    assert reply.status_code == 422
    assert "type" in reply.json()["detail"]


def test_a_retriever_that_is_down_is_503(retriever, generator, redis_url, servicer):
    settings = settings_for(retriever, generator, redis_url, retriever_addr="127.0.0.1:9")
    with TestClient(create_app(settings)) as client:
        reply = put(client, "a", HAMLET)
    assert reply.status_code == 503
    assert "unavailable" in reply.json()["detail"]


# --- auth -----------------------------------------------------------------------------------

WRITES = [
    ("post", "/indexes", {"name": "new"}),
    ("delete", "/indexes/live", None),
    ("put", "/indexes/live/documents/a", HAMLET),
    ("post", "/indexes/live/documents:batch", {"documents": [{**HAMLET, "id": "a"}]}),
    ("delete", "/indexes/live/documents/a", None),
]


@pytest.mark.parametrize("method,path,body", WRITES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_writes_need_the_admin_token(client, servicer, method, path, body, headers):
    reply = client.request(method, path, json=body, headers=headers)
    assert reply.status_code == 401
    assert servicer.calls == []  # refused before the retriever


def test_writes_are_off_without_an_admin_token(retriever, generator, redis_url, servicer):
    settings = settings_for(retriever, generator, redis_url, admin_token=None)
    with TestClient(create_app(settings)) as client:
        reply = put(client, "a", HAMLET)
    assert reply.status_code == 401
    assert "disabled" in reply.json()["detail"]


def test_reads_are_open(client):
    put(client, "a", HAMLET)
    assert client.get("/indexes/live/documents/a").status_code == 200
    assert client.get("/indexes/live/documents").status_code == 200


# --- bad input: a 4xx naming the field, the retriever never asked ----------------------------


def _named(reply, field: str) -> bool:
    detail = reply.json()["detail"]
    return any(field in [str(part) for part in err["loc"]] or field in err["msg"] for err in detail)


BAD_DOCUMENTS = [
    ("empty text", {"title": "t", "text": ""}, "text"),
    ("blank text", {"title": "t", "text": " \n\t "}, "text"),
    ("oversize text", {"title": "t", "text": "a" * (MAX_DOCUMENT_TEXT_CHARS + 1)}, "text"),
    ("text with NUL", {"title": "t", "text": "a\x00b"}, "text"),
    ("missing text", {"title": "t"}, "text"),
    ("text not a string", {"title": "t", "text": 5}, "text"),
    ("oversize title", {"title": "t" * (MAX_DOCUMENT_TITLE_CHARS + 1), "text": "x"}, "title"),
    ("missing title", {"text": "x"}, "title"),
    ("title with a newline", {"title": "a\nb", "text": "x"}, "title"),
    ("nested metadata", {**HAMLET, "metadata": {"a": {"b": 1}}}, "metadata"),
    ("list in metadata", {**HAMLET, "metadata": {"a": [1, 2]}}, "metadata"),
    ("metadata not a map", {**HAMLET, "metadata": [1]}, "metadata"),
    ("empty metadata key", {**HAMLET, "metadata": {"": 1}}, "metadata"),
    (
        "too many metadata keys",
        {**HAMLET, "metadata": {f"k{i}": i for i in range(MAX_METADATA_KEYS + 1)}},
        "metadata",
    ),
    ("unknown field", {**HAMLET, "colour": "red"}, "colour"),
]


@pytest.mark.parametrize("case,body,field", BAD_DOCUMENTS, ids=[c[0] for c in BAD_DOCUMENTS])
def test_a_bad_document_is_422_naming_the_field(client, servicer, case, body, field):
    reply = put(client, "a", body)
    assert reply.status_code in (413, 422), reply.text
    if reply.status_code == 422:
        assert _named(reply, field), reply.text
    assert servicer.calls == []


def test_non_finite_metadata_is_refused(client, servicer):
    body = b'{"title": "t", "text": "x", "metadata": {"a": NaN}}'
    reply = client.put(
        "/indexes/live/documents/a",
        content=body,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert reply.status_code == 422 and _named(reply, "metadata"), reply.text
    assert servicer.calls == []


BAD_IDS = [
    ("a slash", "a/b"),
    ("an encoded slash", "a%2Fb"),
    ("too long", "x" * (MAX_DOCUMENT_ID_CHARS + 1)),
    ("a NUL", "a%00b"),
    ("blank", "%20"),
]


@pytest.mark.parametrize("case,doc_id", BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_a_bad_id_in_the_path_is_422_naming_doc_id(client, servicer, case, doc_id):
    for reply in (
        client.put(f"/indexes/live/documents/{doc_id}", json=HAMLET, headers=AUTH),
        client.get(f"/indexes/live/documents/{doc_id}"),
        client.delete(f"/indexes/live/documents/{doc_id}", headers=AUTH),
    ):
        assert reply.status_code == 422, reply.text
        assert _named(reply, "doc_id"), reply.text
    assert servicer.calls == []


@pytest.mark.parametrize(
    "documents,field",
    [
        ([], "documents"),
        ([{**HAMLET, "id": "a/b"}], "id"),
        ([{**HAMLET, "id": ""}], "id"),
        ([{**HAMLET, "id": "a"}, {**HAMLET, "id": "a"}], "documents"),
        ([{**HAMLET, "id": "a"}, {"id": "b", "title": "t", "text": ""}], "text"),
        ([{**HAMLET, "id": str(i)} for i in range(MAX_BATCH_DOCUMENTS + 1)], "documents"),
    ],
    ids=["empty", "slash", "blank id", "duplicate", "one bad", "too many"],
)
def test_a_bad_batch_is_422_naming_the_field(client, servicer, documents, field):
    reply = client.post(
        "/indexes/live/documents:batch", json={"documents": documents}, headers=AUTH
    )
    assert reply.status_code == 422, reply.text
    assert _named(reply, field), reply.text
    assert servicer.calls == []
    assert client.get("/indexes/live/documents").json()["ids"] == []  # nothing written


@pytest.mark.parametrize(
    "body,field",
    [
        ({"name": "bad name"}, "name"),
        ({"name": "-x"}, "name"),
        ({"name": "ok", "like": "a/b"}, "like"),
        ({"name": "ok", "type": "FLAT!"}, "type"),
        ({}, "name"),
    ],
)
def test_a_bad_create_is_422_naming_the_field(client, servicer, body, field):
    reply = client.post("/indexes", json=body, headers=AUTH)
    assert reply.status_code == 422, reply.text
    assert _named(reply, field), reply.text
    assert servicer.calls == []


@pytest.mark.parametrize(
    "params,field",
    [({"limit": 0}, "limit"), ({"limit": 100000}, "limit"), ({"cursor": "a/b"}, "cursor")],
)
def test_a_bad_listing_is_422_naming_the_parameter(client, servicer, params, field):
    reply = client.get("/indexes/live/documents", params=params)
    assert reply.status_code == 422 and _named(reply, field), reply.text
    assert servicer.calls == []


def test_a_bad_index_name_in_the_path_is_422(client, servicer):
    reply = put(client, "a", HAMLET, index="-bad")
    assert reply.status_code == 422 and _named(reply, "index"), reply.text
    assert servicer.calls == []


# --- versions in answers, and the answer cache ------------------------------------------------


def ask(client, question: str = "Who wrote Hamlet?") -> dict:
    reply = client.post("/answer", json={"question": question, "k": 1})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_answers_report_the_index_version(client):
    put(client, "hamlet", HAMLET)
    answer = ask(client)
    assert (answer["index"], answer["index_version"]) == ("live", 1)
    assert answer["passages"][0]["id"] == "hamlet#0"

    chat = client.post(
        "/v1/chat/completions",
        json={"model": "openbook", "messages": [{"role": "user", "content": "Who wrote Hamlet?"}]},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["openbook"]["index_version"] == 1

    streamed = client.post(
        "/answer", json={"question": "Who wrote Hamlet?", "k": 1, "stream": True}
    )
    assert streamed.status_code == 200
    final = [line for line in streamed.text.splitlines() if line.startswith("data:")][-1]
    assert '"index_version":1' in final.replace(" ", "")


def _index_state(redis_server, index: str):
    raw = redis_server.client().hget(INDEX_STATE_KEY, index)
    state = open_index_state(default_sealer(), index, raw)
    assert state is not None, raw
    return state


def test_a_write_invalidates_a_cached_answer(client, redis_server):
    put(client, "hamlet", HAMLET)
    first = ask(client)
    assert ask(client)["cached"] is True
    # The retriever published the version the cache keys by.
    assert _index_state(redis_server, "live")["versions"] == {"": 1}

    put(client, "macbeth", {"title": "Macbeth", "text": "Macbeth was written by Shakespeare."})
    after = ask(client)
    assert after["cached"] is False
    assert after["index_version"] == 2 and first["index_version"] == 1
    assert ask(client)["cached"] is True  # cached again, under the new version

    client.delete("/indexes/live/documents/hamlet", headers=AUTH)
    gone = ask(client)
    assert gone["cached"] is False
    assert all(not p["id"].startswith("hamlet#") for p in gone["passages"])


def test_another_gateways_write_invalidates_through_redis(
    retriever, generator, redis_url, servicer
):
    settings = settings_for(retriever, generator, redis_url)
    with TestClient(create_app(settings)) as reader, TestClient(create_app(settings)) as writer:
        put(writer, "hamlet", HAMLET)
        ask(reader)
        assert ask(reader)["cached"] is True
        put(writer, "hamlet", {**HAMLET, "text": "Hamlet: a play by Shakespeare."})
        assert ask(reader)["cached"] is False  # the reader learnt the version from Redis only


def test_without_a_published_version_nothing_is_cached(client, servicer):
    """A retriever that does not publish its index's version: the gateway cannot tell a
    version in Redis that lags from one an insider lowered, so it stores no answer (issue 42:
    never a stale one)."""
    servicer.redis = None  # a retriever that does not publish (before the lead wires it)
    put(client, "hamlet", HAMLET)
    ask(client)
    assert ask(client)["cached"] is False
    put(client, "hamlet", {**HAMLET, "text": "Hamlet: a play by Shakespeare."})
    assert ask(client)["cached"] is False


# --- generated requests (schemathesis): never a 5xx -------------------------------------------

FUZZ_BUDGET = {
    ("/indexes", "POST"): 30,
    ("/indexes/{name}", "DELETE"): 15,
    ("/indexes/{index}/documents/{doc_id}", "PUT"): 40,
    ("/indexes/{index}/documents:batch", "POST"): 30,
    ("/indexes/{index}/documents/{doc_id}", "DELETE"): 15,
    ("/indexes/{index}/documents/{doc_id}", "GET"): 15,
    ("/indexes/{index}/documents", "GET"): 20,
}


@pytest.fixture(scope="module")
def served_gateway(retriever, redis_server):

    settings = GatewaySettings(
        retriever_addr=retriever.addr,
        generator_addr="127.0.0.1:9",  # the documents API never asks it
        redis_url=redis_server.url,
        admin_token=TOKEN,
    )
    with serving_gateway(settings) as url:
        yield url


def test_generated_document_requests_never_get_a_5xx(served_gateway, servicer):

    schema = schemathesis.openapi.from_url(f"{served_gateway}/openapi.json")
    operations = {
        (op.path, op.method.upper()): op for op in (r.ok() for r in schema.get_all_operations())
    }
    assert set(FUZZ_BUDGET) <= set(operations), sorted(operations)
    outcomes: list[tuple[int, str]] = []
    for (path, method), examples in FUZZ_BUDGET.items():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @hypothesis_settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operations[(path, method)].as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                # Half the writes reach the retriever (the token), half are refused first.
                headers = AUTH if len(outcomes) % 2 == 0 else None
                response = case.call(base_url=served_gateway, headers=headers, timeout=60)
                outcomes.append(
                    (
                        response.status_code,
                        f"{case.as_curl_command(headers)}: {response.text[:300]}",
                    )
                )

            fuzz()
    server_errors = [f"{status} for {what}" for status, what in outcomes if status >= 500]
    assert server_errors == [], "\n".join(server_errors[:10])
    assert any(status == 200 for status, _ in outcomes)


# --- shards: a document lives in the shard its id picks ---------------------------------------


def test_sharded_documents_go_to_one_shard_and_versions_add_up(generator, redis_url):

    with fake_retriever(TOKEN) as shard0, fake_retriever(TOKEN) as shard1:
        settings = settings_for(shard0, generator, redis_url)
        settings = settings.model_copy(update={"retriever_addr": f"{shard0.addr},{shard1.addr}"})
        ids = [f"doc-{i:02}" for i in range(12)]
        with TestClient(create_app(settings)) as client:
            documents = [{"id": i, "title": "", "text": f"words of {i}"} for i in ids]
            batch = client.post(
                "/indexes/live/documents:batch", json={"documents": documents}, headers=AUTH
            )
            assert batch.status_code == 200, batch.text
            shards = [shard0.servicer, shard1.servicer]
            for doc_id in ids:
                held = [doc_id in s.indexes["live"].documents for s in shards]
                assert held[document_shard(doc_id, 2)] and sum(held) == 1
            assert all(s.indexes["live"].documents for s in shards)  # both got some
            assert batch.json()["version"] == 2  # one write on each shard

            single = put(client, "extra", HAMLET)
            assert single.json()["version"] == 3

            seen, cursor = [], ""
            while True:
                page = client.get(
                    "/indexes/live/documents", params={"cursor": cursor, "limit": 5}
                ).json()
                seen += page["ids"]
                assert page["version"] == 3
                if page["next_cursor"] is None:
                    break
                cursor = page["next_cursor"]
            assert seen == sorted([*ids, "extra"])

            got = client.get("/indexes/live/documents/doc-03")
            assert got.status_code == 200 and got.json()["id"] == "doc-03"
            assert client.delete("/indexes/live/documents/doc-03", headers=AUTH).json() == {
                "version": 4
            }
            listed = client.get("/indexes").json()["indexes"]
            assert [(i["name"], i["version"], i["count"]) for i in listed] == [("live", 4, 12)]
            answer = client.post("/answer", json={"question": "words of doc-05", "k": 2}).json()
            assert answer["index_version"] == 4


def test_a_new_index_of_a_deleted_ones_name_never_serves_its_answers(client, redis_server):
    client.post("/indexes", json={"name": "notes"}, headers=AUTH)
    put(client, "hamlet", HAMLET, index="notes")
    question = {"question": "Who wrote Hamlet?", "k": 1, "index": "notes"}
    first = client.post("/answer", json=question).json()
    # Cached: the write published the version the answer was computed at before it was
    # acknowledged, in the index's sealed state.
    assert client.post("/answer", json=question).json()["cached"] is True

    assert client.delete("/indexes/notes", headers=AUTH).status_code == 200
    assert _index_state(redis_server, "notes")["versions"] == {}  # a new epoch, no versions
    client.post("/indexes", json={"name": "notes"}, headers=AUTH)
    put(client, "other", {"title": "Other", "text": "Hamlet, retold by someone else."}, "notes")
    again = client.post("/answer", json=question).json()
    assert (first["index_version"], again["index_version"]) == (1, 1)  # same name and version
    assert again["cached"] is False
    assert again["passages"][0]["id"] == "other#0"


def test_document_bodies_have_their_own_size_limit(retriever, generator, redis_url, servicer):
    settings = settings_for(
        retriever, generator, redis_url, max_body_bytes=2000, max_document_body_bytes=8000
    )
    text = "word " * 1000  # 5000 bytes: over the general limit, under the documents'
    with TestClient(create_app(settings)) as client:
        assert put(client, "a", {"title": "", "text": text}).status_code == 200
        too_big = put(client, "b", {"title": "", "text": text * 2})
        assert too_big.status_code == 413
        assert "OPENBOOK_GATEWAY_MAX_DOCUMENT_BODY_BYTES" in too_big.json()["detail"]
        answer = client.post("/answer", json={"question": "x" * 1900, "k": 1, "index": "y" * 100})
        assert answer.status_code == 413  # every other body keeps the general limit
        assert "OPENBOOK_GATEWAY_MAX_BODY_BYTES" in answer.json()["detail"]
