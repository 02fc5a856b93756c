"""Metadata filters through the services (issue 33): ``/answer``'s and ``/v1/chat/completions``'
``filter`` reaches the real retriever (``RetrieveRequest.filter_json``), which retrieves only
matching passages (the k best of them); bad filters are a 422 / 400 / INVALID_ARGUMENT naming
``filter``; a filter nothing matches is an empty result (the answer abstains), not an error;
the answer cache keys by the filter.

The real retriever and generator in this process (``running_backends``: ``facts-a``, the thirty
facts, MiniLM, dense + BM25), the gateway in a TestClient, documents written through it.
"""

from __future__ import annotations

import json

import grpc
import pytest
from fastapi.testclient import TestClient

from openbook.serving.grpc_server import bearer_metadata
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_gateway.app import create_app
from openbook_testkit.index import PLAYS
from openbook_testkit.stack import running_backends

TOKEN = "filter-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHORT = {"max_new_tokens": 2}
QUESTION = "Who wrote Hamlet?"


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    work = tmp_path_factory.mktemp("filters")
    redis_server.flush()  # no active index left behind by another module
    with running_backends(work, redis_server.url, admin_token=TOKEN) as running:
        yield running
    # This module's writes raise facts-a's version in Redis and its answers are cached there:
    # leave neither to a later module, whose facts-a is another, unwritten index.
    redis_server.flush()


@pytest.fixture(scope="module")
def client(backends, redis_server):
    settings = backends.gateway_settings(redis_server.url, admin_token=TOKEN)
    with TestClient(create_app(settings)) as client:
        # Three plays with metadata; facts-a's thirty facts (adopted by this first write) have
        # none: only their built-in _id and _title match.
        macbeth, phedre, cid = PLAYS
        docs = [macbeth, phedre, {**cid, "metadata": {**cid["metadata"], "tags": "drama"}}]
        reply = client.post(
            "/indexes/facts-a/documents:batch", json={"documents": docs}, headers=AUTH
        )
        assert reply.status_code == 200, reply.text
        yield client


def _answer(client: TestClient, where: object, **extra) -> dict:
    body = {"question": QUESTION, "k": 3, "filter": where, **SHORT, **extra}
    reply = client.post("/answer", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _docs(answer: dict) -> list[str]:
    return [p["id"].split("#")[0] for p in answer["passages"]]


@pytest.mark.parametrize("retrieval", ["dense", "bm25", "hybrid"])
def test_answer_retrieves_only_matching_passages(client, retrieval):
    unfiltered = _answer(client, None, retrieval=retrieval)
    assert "p21" in _docs(unfiltered)  # Hamlet itself, without a filter
    french = _answer(client, {"lang": "fr"}, retrieval=retrieval)
    assert sorted(_docs(french)) == ["cid", "phedre"]  # the two matching, though k is 3
    mixed = _answer(
        client,
        {"$or": [{"year": {"$in": [1606, 1637]}}, {"_title": "Tea"}]},
        retrieval=retrieval,
    )
    # BM25 finds no passage sharing no term with the question (the Tea fact).
    want = ["cid", "macbeth"] if retrieval == "bm25" else ["cid", "macbeth", "p28"]
    assert sorted(_docs(mixed)) == want


def test_a_filter_nothing_matches_is_an_empty_result(client):
    for where in ({"publisher": "nobody"}, {"lang": "de"}):
        answer = _answer(client, where)
        assert answer["passages"] == [] and answer["answer"] == ""
        assert answer["abstained"] is True


def test_the_cache_keys_by_the_filter(client):
    first = _answer(client, {"lang": "en"})
    assert _docs(first) == ["macbeth"]
    assert _answer(client, {"lang": {"$eq": "en"}})["cached"] is True  # the same meaning
    other = _answer(client, {"lang": "fr"})
    assert other["cached"] is False and "macbeth" not in _docs(other)


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ({"lang": ["en", "fr"]}, "filter.lang must be a string, number, boolean or null"),
        ({"year": {"$gt": 1600}}, "unknown operator '$gt'"),
        ("lang=en", "dictionary"),
        ({"$or": []}, "filter.$or must be a non-empty list"),
    ],
)
def test_a_bad_filter_is_a_422_naming_filter(client, where, says):
    reply = client.post("/answer", json={"question": QUESTION, "filter": where})
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"][0]
    assert detail["loc"][-1] == "filter"
    assert says in detail["msg"]


BIG = 10**400  # no float holds it: a float() of it raised OverflowError, a 500


@pytest.mark.parametrize(
    ("where", "field"),
    [
        ({"year": BIG}, "filter.year"),
        ({"year": {"$in": [1606, -BIG]}}, "filter.year.$in[1]"),
        ({"$or": [{"lang": "en"}, {"year": {"$eq": 2**53}}]}, "filter.$or[1].year.$eq"),
    ],
)
def test_a_big_integer_in_a_filter_is_refused_on_every_route(client, where, field):
    says = f"{field} must be an integer from -9007199254740991 to 9007199254740991"
    reply = client.post("/answer", json={"question": QUESTION, "filter": where})
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"][0]
    assert detail["loc"][-1] == "filter" and says in detail["msg"], detail
    chat = {"model": "openbook/facts-a", "messages": [{"role": "user", "content": QUESTION}]}
    reply = client.post("/v1/chat/completions", json={**chat, "filter": where})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "filter" and says in reply.text
    ask = {"model": "openbook/facts-a", "input": QUESTION}
    reply = client.post("/v1/responses", json={**ask, "filter": where})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "filter" and says in reply.text


def test_a_big_integer_in_metadata_is_refused_naming_metadata(client, backends):
    doc = {"title": "Big", "text": "A document with a very large number."}
    reply = client.put(
        "/indexes/facts-a/documents/big", json={**doc, "metadata": {"n": BIG}}, headers=AUTH
    )
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"][0]
    assert "metadata" in detail["loc"] and "metadata.n must be an integer" in detail["msg"]
    batch = {"documents": [{**doc, "id": "big", "metadata": {"n": -(2**53)}}]}
    reply = client.post("/indexes/facts-a/documents:batch", json=batch, headers=AUTH)
    assert reply.status_code == 422 and "metadata.n must be an integer" in reply.text
    assert client.get("/indexes/facts-a/documents/big").status_code == 404
    edge = {**doc, "metadata": {"n": 2**53 - 1}}  # the largest: kept, and filtered on
    assert client.put("/indexes/facts-a/documents/edge", json=edge, headers=AUTH).is_success
    assert _docs(_answer(client, {"n": 2**53 - 1})) == ["edge"]
    assert client.delete("/indexes/facts-a/documents/edge", headers=AUTH).is_success

    # The retriever refuses it too, to a caller that is not the gateway.
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        document = retriever_pb2.Document(
            id="big", title="Big", text=doc["text"], metadata_json=json.dumps({"n": BIG})
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.PutDocuments(
                retriever_pb2.PutDocumentsRequest(index="facts-a", documents=[document]),
                metadata=bearer_metadata(TOKEN),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("documents[0].metadata.n must be an integer")
        request = retriever_pb2.RetrieveRequest(
            queries=["q"], k=2, filter_json=json.dumps({"n": BIG})
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Retrieve(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("filter.n must be an integer")


def test_chat_completions_take_filter_as_an_extra_body_field(client):
    chat = {"model": "openbook/facts-a", "messages": [{"role": "user", "content": QUESTION}]}
    chat.update(max_tokens=2, k=3, use_cache=False)
    reply = client.post("/v1/chat/completions", json={**chat, "filter": {"lang": "fr"}})
    assert reply.status_code == 200, reply.text
    cited = sorted(c["id"].split("#")[0] for c in reply.json()["citations"])
    assert cited == ["cid", "phedre"]
    bad = client.post("/v1/chat/completions", json={**chat, "filter": {"lang": {"a": 1}}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "filter"


def test_responses_and_the_mcp_tools_take_filter(backends, redis_server):
    settings = backends.gateway_settings(redis_server.url, admin_token=TOKEN)
    # /mcp refuses other hosts (DNS rebinding): a loopback base URL, as a local agent has.
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8000") as client:
        ask = {"model": "openbook/facts-a", "input": QUESTION, "max_output_tokens": 2, "k": 3}
        reply = client.post("/v1/responses", json={**ask, "filter": {"lang": "fr"}})
        assert reply.status_code == 200, reply.text
        cited = sorted(c["id"].split("#")[0] for c in reply.json()["citations"])
        assert cited == ["cid", "phedre"]
        bad = client.post("/v1/responses", json={**ask, "filter": {"lang": [1]}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "filter", bad.text

        def tool(name: str, **arguments) -> dict:
            rpc = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
            rpc["params"] = {"name": name, "arguments": arguments}
            headers = {"Accept": "application/json, text/event-stream"}
            reply = client.post("/mcp", json=rpc, headers=headers)
            assert reply.status_code == 200, reply.text
            return reply.json()["result"]

        found = tool("search", query=QUESTION, k=3, index="facts-a", filter={"year": 1606})
        passages = found["structuredContent"]["passages"]
        assert [p["id"] for p in passages] == ["macbeth#0"]
        answered = tool("answer", question=QUESTION, k=3, index="facts-a", filter={"lang": "fr"})
        cited = sorted(c["id"].split("#")[0] for c in answered["structuredContent"]["citations"])
        assert cited == ["cid", "phedre"]
        refused = tool("search", query=QUESTION, filter={"year": {"$gt": 1}})
        assert refused["isError"] is True and "filter" in refused["content"][0]["text"]


def test_the_retriever_refuses_a_bad_filter_json_naming_filter(backends):
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        for bad in ('{"lang": [1]}', "{not json", '{"$nor": []}'):
            request = retriever_pb2.RetrieveRequest(queries=["q"], k=2, filter_json=bad)
            with pytest.raises(grpc.RpcError) as info:
                stub.Retrieve(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("filter")
        ok = stub.Retrieve(
            retriever_pb2.RetrieveRequest(
                queries=[QUESTION], k=5, index="facts-a", filter_json='{"_id": "p21"}'
            ),
            timeout=30,
        )
        assert [p.id for p in ok.results[0].passages] == ["p21"]
