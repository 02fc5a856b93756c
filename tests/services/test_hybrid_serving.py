"""Hybrid retrieval through the services: a request's ``retrieval`` (dense, bm25, hybrid or the
index's default) over gRPC and through the gateway (``/answer``, ``/v1/chat/completions``,
``GET /indexes``), refused where the index lacks the view, keyed apart in the answer cache,
batched per mode, and followed across a hot swap to an index with other views.

Indexes (the thirty facts of ``openbook_testkit.index``, MiniLM, flat): ``facts-a`` and
``facts-b`` hold both views (dense + BM25, what ``build_index`` builds by default),
``facts-dense`` only the dense view and ``facts-bm25`` only the BM25 one.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from openbook.index.request import SearchRequest
from openbook.state.redis_protocol import answer_key
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook.validation.limits import RETRIEVAL_MODES
from openbook_gateway.app import create_app
from openbook_gateway.cache import answer_params
from openbook_gateway.schemas import AnswerRequest
from openbook_retriever.servicer import _Search, search_batch
from openbook_testkit.index import QUESTIONS, fact_rows, write_jsonl
from openbook_testkit.stack import Backends, running_backends

TOKEN = "hybrid-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUESTION = "Who wrote Hamlet?"
# Short answers: retrieval is what is tested, the tiny random BART only has to run.
SHORT = {"max_new_tokens": 2, "use_cache": False}


def build_single_view_indexes(root: Path) -> None:
    """``facts-dense`` (no BM25 view) and ``facts-bm25`` (BM25 only) of the same facts."""
    from openbook.index import build_index
    from openbook.index.spec import BuildOptions, IndexSpec

    source = write_jsonl(root / "facts-single.jsonl", fact_rows())
    build_index(
        [source],
        root / "facts-dense",
        IndexSpec(name="facts-dense", bm25=False),
        BuildOptions(progress=False),
    )
    build_index(
        [source],
        root / "facts-bm25",
        IndexSpec(name="facts-bm25", index_type="bm25"),
        BuildOptions(progress=False),
    )


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    work = tmp_path_factory.mktemp("hybrid")
    build_single_view_indexes(work / "indexes")
    # facts-a (active) and facts-b are built by running_backends, with both views.
    with running_backends(work, redis_server.url, admin_token=TOKEN) as running:
        yield running


@pytest.fixture
def stub(backends):
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        yield retriever_pb2_grpc.RetrieverStub(channel)


@pytest.fixture
def client(backends, redis_url):
    settings = backends.gateway_settings(redis_url, admin_token=TOKEN)
    with TestClient(create_app(settings)) as client:
        yield client
        # Leave facts-a active for the next test.
        client.post("/admin/swap-index", json={"index": "facts-a"}, headers=AUTH)


def direct(backends: Backends, index: str, queries: list[str], k: int, retrieval: str | None):
    """What the index itself answers (no service in between)."""
    with backends.retriever_servicer.registry.lease(index) as loaded:
        return loaded.search(SearchRequest(queries, k=k, retrieval=retrieval))


def ids_and_scores(results) -> list[list[tuple[str, float]]]:
    return [[(p.id, round(float(p.score), 4)) for p in hits] for hits in results]


def proto_ids_and_scores(reply) -> list[list[tuple[str, float]]]:
    return [[(p.id, round(p.score, 4)) for p in r.passages] for r in reply.results]


# --- gRPC -------------------------------------------------------------------------------


def test_limits_name_the_index_layers_modes():
    from openbook.index.fusion import RETRIEVAL_MODES as INDEX_MODES

    assert RETRIEVAL_MODES == INDEX_MODES == ("dense", "bm25", "hybrid")


def test_the_shared_rule_for_modes_views_and_defaults():
    from openbook.errors import InvalidArgument
    from openbook.index.manifest import Manifest
    from openbook.validation.limits import check_retrieval, check_retrieval_views

    assert [check_retrieval("retrieval", m) for m in RETRIEVAL_MODES] == list(RETRIEVAL_MODES)
    with pytest.raises(InvalidArgument, match="^retrieval: must be one of dense, bm25, hybrid"):
        check_retrieval("retrieval", "rrf")

    def default(views: list[str]) -> str:
        index_type = "bm25" if views == ["bm25"] else "flat"
        return Manifest("x", None, None, 0, 0, index_type, views=views).default_retrieval

    assert default(["dense", "bm25"]) == "hybrid"
    assert (default(["dense"]), default(["bm25"])) == ("dense", "bm25")
    for mode in RETRIEVAL_MODES:
        assert check_retrieval_views("retrieval", mode, "x", ("dense", "bm25")) == mode
    with pytest.raises(InvalidArgument) as err:
        check_retrieval_views("retrieval", "hybrid", "wiki", ("dense",))
    assert str(err.value) == (
        "retrieval: 'hybrid' needs the bm25 view; index 'wiki' has only the dense view"
    )


@pytest.mark.parametrize("mode", RETRIEVAL_MODES)
def test_each_mode_over_grpc_is_the_index_search(backends, stub, mode):
    queries = [QUESTION, QUESTIONS["p18"]]
    reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=queries, k=4, retrieval=mode))
    assert (reply.index, reply.retrieval) == ("facts-a", mode)
    want = direct(backends, "facts-a", queries, 4, mode)
    assert proto_ids_and_scores(reply) == ids_and_scores(want)
    assert [r.passages[0].id for r in reply.results] == ["p21", "p18"]


def test_default_is_hybrid_where_both_views_exist_else_the_one_view(backends, stub):
    for index, default in (
        ("facts-a", "hybrid"),
        ("facts-dense", "dense"),
        ("facts-bm25", "bm25"),
    ):
        reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=[QUESTION], k=3, index=index))
        assert (reply.index, reply.retrieval) == (index, default)
        explicit = stub.Retrieve(
            retriever_pb2.RetrieveRequest(queries=[QUESTION], k=3, index=index, retrieval=default)
        )
        assert proto_ids_and_scores(reply) == proto_ids_and_scores(explicit)


def test_single_modes_of_a_two_view_index_equal_the_single_view_indexes(stub):
    """dense and bm25 on an index holding both views answer as the index of that view alone."""
    queries = list(QUESTIONS.values())[:8]
    for mode, single in (("dense", "facts-dense"), ("bm25", "facts-bm25")):
        both = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=queries, k=5, retrieval=mode))
        alone = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=queries, k=5, index=single))
        assert alone.retrieval == mode
        assert proto_ids_and_scores(both) == proto_ids_and_scores(alone)


def test_unknown_mode_is_invalid_argument_naming_retrieval(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["q"], k=1, retrieval="sparse"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("retrieval: must be one of dense, bm25, hybrid")


@pytest.mark.parametrize(
    ("index", "mode", "views"),
    [
        ("facts-dense", "hybrid", "dense"),
        ("facts-dense", "bm25", "dense"),
        ("facts-bm25", "hybrid", "bm25"),
        ("facts-bm25", "dense", "bm25"),
    ],
)
def test_a_view_the_index_lacks_is_invalid_argument_naming_index_and_views(
    stub, index, mode, views
):
    request = retriever_pb2.RetrieveRequest(queries=[QUESTION], k=2, index=index, retrieval=mode)
    with pytest.raises(grpc.RpcError) as err:
        stub.Retrieve(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith("retrieval: ")
    assert f"index {index!r} has only the {views} view" in details


def test_vectors_come_with_dense_and_hybrid_never_bm25(stub):
    for mode in ("dense", "hybrid"):
        reply = stub.Retrieve(
            retriever_pb2.RetrieveRequest(
                queries=[QUESTION], k=2, retrieval=mode, return_vectors=True
            )
        )
        assert all(len(p.vector) == 384 for p in reply.results[0].passages)
    for index in ("facts-a", "facts-bm25"):
        request = retriever_pb2.RetrieveRequest(
            queries=[QUESTION], k=2, index=index, retrieval="bm25", return_vectors=True
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Retrieve(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("return_vectors: ")


def test_list_indexes_shows_views_and_default(stub):
    listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
    got = {i.name: (list(i.views), i.default_retrieval) for i in listed.indexes}
    assert got == {
        "facts-a": (["dense", "bm25"], "hybrid"),
        "facts-b": (["dense", "bm25"], "hybrid"),
        "facts-dense": (["dense"], "dense"),
        "facts-bm25": (["bm25"], "bm25"),
    }


def test_concurrent_calls_of_different_modes_each_get_their_own_results(backends):
    """Calls batched together but asking for different modes are searched per mode."""
    servicer = backends.retriever_servicer
    queries = list(QUESTIONS.values())
    requests = [
        retriever_pb2.RetrieveRequest(
            queries=[queries[i % len(queries)]], k=3, retrieval=RETRIEVAL_MODES[i % 3]
        )
        for i in range(12)
    ]
    replies: dict[int, object] = {}

    def call(i: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
            replies[i] = retriever_pb2_grpc.RetrieverStub(channel).Retrieve(requests[i], timeout=60)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert servicer is not None
    for i, request in enumerate(requests):
        reply = replies[i]
        assert reply.retrieval == request.retrieval
        want = direct(backends, "facts-a", list(request.queries), 3, request.retrieval)
        assert proto_ids_and_scores(reply) == ids_and_scores(want)


class CountingEncoder:
    """A query encoder that counts the queries it encodes (an override stand-in)."""

    def __init__(self, encoder) -> None:
        self.inner = encoder
        self.name = encoder.name
        self.dim = encoder.dim
        self.encoded = 0
        self.calls = 0

    def encode(self, texts, *args, **kwargs):
        self.calls += 1
        self.encoded += len(texts)
        return self.inner.encode(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_batch_groups_by_mode_and_hybrid_uses_the_callers_encoder(backends):
    with backends.retriever_servicer.registry.lease("facts-a") as index:
        encoder = CountingEncoder(index.query_encoder)
        items = [
            _Search(index, encoder, SearchRequest([QUESTION], k=2, retrieval="hybrid")),
            _Search(index, None, SearchRequest([QUESTION], k=2, retrieval="bm25")),
            _Search(index, None, SearchRequest([QUESTION], k=2, retrieval="dense")),
            _Search(index, encoder, SearchRequest([QUESTIONS["p18"]], k=3, retrieval="hybrid")),
        ]
        results = search_batch(items)
        for item, result in zip(items, results, strict=True):
            assert not isinstance(result, Exception), result
            want = index.search(item.request)
            assert ids_and_scores(result) == ids_and_scores(want)
    # the override encoded hybrid's two queries (k 2 and 3) in one forward pass; bm25 and
    # dense (with the index's own encoder) did not use it
    assert (encoder.calls, encoder.encoded) == (1, 2)


# --- gateway ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", RETRIEVAL_MODES)
def test_answer_in_each_mode_says_which_it_used(backends, client, mode):
    reply = client.post("/answer", json={"question": QUESTION, "k": 3, "retrieval": mode, **SHORT})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["index"], body["retrieval"]) == ("facts-a", mode)
    want = direct(backends, "facts-a", [QUESTION], 3, mode)[0]
    assert [p["id"] for p in body["passages"]] == [p.id for p in want]
    assert [p["score"] for p in body["passages"]] == pytest.approx([p.score for p in want])


def test_answer_default_mode_follows_the_index(client):
    for index, default in (("facts-a", "hybrid"), ("facts-bm25", "bm25"), ("facts-dense", "dense")):
        body = {"question": QUESTION, "k": 2, "index": index, **SHORT}
        reply = client.post("/answer", json=body)
        assert reply.status_code == 200, reply.text
        assert (reply.json()["index"], reply.json()["retrieval"]) == (index, default)


@pytest.mark.parametrize("value", ["sparse", "", "HYBRID", 1, True])
def test_answer_refuses_a_bad_mode_with_422_naming_retrieval(client, value):
    reply = client.post("/answer", json={"question": QUESTION, "retrieval": value})
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"][0]["loc"] == ["body", "retrieval"]


@pytest.mark.parametrize(("index", "mode"), [("facts-dense", "hybrid"), ("facts-bm25", "dense")])
def test_answer_on_an_index_lacking_the_view_is_422_naming_retrieval(client, index, mode):
    body = {"question": QUESTION, "index": index, "retrieval": mode, **SHORT}
    reply = client.post("/answer", json=body)
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"]
    assert detail.startswith("retrieval: ")
    assert repr(index) in detail


def test_a_streamed_answer_says_its_mode_and_a_missing_view_fails_before_the_stream(client):
    from openbook_testkit.sse import read_events

    body = {"question": QUESTION, "k": 2, "retrieval": "bm25", "stream": True, **SHORT}
    with client.stream("POST", "/answer", json=body) as reply:
        assert reply.status_code == 200
        events = list(read_events(reply.iter_lines()))
    answer = [e.json() for e in events if e.event == "answer"]
    assert [a["retrieval"] for a in answer] == ["bm25"]
    refused = client.post("/answer", json={**body, "index": "facts-bm25", "retrieval": "hybrid"})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"].startswith("retrieval: ")


def test_cache_keys_differ_by_mode(client):
    params = {
        mode: answer_params(AnswerRequest(question=QUESTION, retrieval=mode), 3)
        for mode in (None, *RETRIEVAL_MODES)
    }
    assert len({answer_key("facts-a", p) for p in params.values()}) == 4

    question = {"question": QUESTIONS["p18"], "k": 2, "max_new_tokens": 2}
    first = client.post("/answer", json={**question, "retrieval": "dense"}).json()
    again = client.post("/answer", json={**question, "retrieval": "dense"}).json()
    other = client.post("/answer", json={**question, "retrieval": "bm25"}).json()
    default = client.post("/answer", json=question).json()
    assert (first["cached"], again["cached"]) == (False, True)
    assert again["retrieval"] == "dense"
    assert (other["cached"], other["retrieval"]) == (False, "bm25")
    assert (default["cached"], default["retrieval"]) == (False, "hybrid")


def test_indexes_lists_views_and_default_retrieval(client):
    reply = client.get("/indexes")
    assert reply.status_code == 200, reply.text
    got = {i["name"]: (i["views"], i["default_retrieval"]) for i in reply.json()["indexes"]}
    assert got == {
        "facts-a": (["dense", "bm25"], "hybrid"),
        "facts-b": (["dense", "bm25"], "hybrid"),
        "facts-dense": (["dense"], "dense"),
        "facts-bm25": (["bm25"], "bm25"),
    }
    assert {i["engine"] for i in reply.json()["indexes"]} == {"files"}  # directories


def test_chat_completions_pass_retrieval_through(client):
    chat = {"model": "openbook", "messages": [{"role": "user", "content": QUESTION}]}
    chat.update(max_tokens=2, use_cache=False)
    reply = client.post("/v1/chat/completions", json={**chat, "retrieval": "bm25"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["openbook"]["retrieval"] == "bm25"
    reply = client.post("/v1/chat/completions", json=chat)
    assert reply.json()["openbook"]["retrieval"] == "hybrid"

    bad = client.post("/v1/chat/completions", json={**chat, "retrieval": "sparse"})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "retrieval"
    missing = client.post(
        "/v1/chat/completions",
        json={**chat, "model": "openbook/facts-bm25", "retrieval": "hybrid"},
    )
    assert missing.status_code == 400, missing.text
    assert missing.json()["error"]["message"].startswith("retrieval: ")
    assert missing.json()["error"]["param"] == "retrieval"


def test_hot_swap_to_a_bm25_index_keeps_serving_and_the_default_follows(client):
    before = client.post("/answer", json={"question": QUESTION, "k": 2, **SHORT}).json()
    assert (before["index"], before["retrieval"]) == ("facts-a", "hybrid")
    swapped = client.post("/admin/swap-index", json={"index": "facts-bm25"}, headers=AUTH)
    assert swapped.status_code == 200, swapped.text
    after = client.post("/answer", json={"question": QUESTION, "k": 2, **SHORT})
    assert after.status_code == 200, after.text
    assert (after.json()["index"], after.json()["retrieval"]) == ("facts-bm25", "bm25")
    assert after.json()["passages"][0]["id"] == "p21"
    # a mode the new index lacks is now the client's mistake, said as such
    refused = client.post("/answer", json={"question": QUESTION, "retrieval": "hybrid", **SHORT})
    assert refused.status_code == 422, refused.text
    assert "facts-bm25" in refused.json()["detail"]
    # and the two-view index is still served where a request names it
    named = {"question": QUESTION, "index": "facts-a", "retrieval": "hybrid", **SHORT}
    assert client.post("/answer", json=named).json()["retrieval"] == "hybrid"


def test_openbook_ask_chooses_the_mode(backends, redis_url):
    import json

    from typer.testing import CliRunner

    from openbook_cli.app import app
    from openbook_testkit.stack import serving_gateway

    settings = backends.gateway_settings(redis_url, admin_token=TOKEN)
    with serving_gateway(settings) as url:
        runner = CliRunner()
        asked = ["ask", QUESTION, "--url", url, "--k", "2", "--json"]
        reply = runner.invoke(app, [*asked, "--retrieval", "bm25"])
        assert reply.exit_code == 0, reply.output
        assert json.loads(reply.stdout)["retrieval"] == "bm25"
        shown = runner.invoke(app, asked[:-1], env={"COLUMNS": "160"})
        assert shown.exit_code == 0, shown.output
        assert "index facts-a (hybrid)" in shown.stdout
        refused = runner.invoke(app, [*asked, "--retrieval", "sparse"])
        assert refused.exit_code == 1
        assert "HTTP 422" in refused.output and "retrieval" in refused.output


def test_embeddings_need_a_dense_view(client):
    """/v1/embeddings on a bm25 index (no query encoder) is a 400 naming the model; a dense
    index of the same encoder embeds as facts-a does."""
    bm25 = client.post("/v1/embeddings", json={"model": "openbook/facts-bm25", "input": "q"})
    assert bm25.status_code == 400, bm25.text
    assert bm25.json()["error"]["param"] == "model"
    dense = client.post("/v1/embeddings", json={"model": "openbook/facts-dense", "input": "q"})
    active = client.post("/v1/embeddings", json={"model": "openbook", "input": "q"})
    assert dense.status_code == active.status_code == 200, dense.text
    assert dense.json()["data"][0]["embedding"] == active.json()["data"][0]["embedding"]
