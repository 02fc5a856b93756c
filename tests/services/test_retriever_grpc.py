"""The retriever gRPC service on loopback: retrieval, index admin, swaps, bad input."""

import shutil

import grpc
import pytest

from openbook.serving.grpc_server import bearer_metadata, check_health
from openbook.state.shared_state import ActiveIndexStore
from openbook.v1 import retriever_pb2
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.stack import build_fact_indexes, retriever_service

TOKEN = "retriever-admin-token"
ADMIN = bearer_metadata(TOKEN)  # index admin RPCs need it (tests/services/test_admin_auth.py)


@pytest.fixture(scope="module")
def index_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexes")
    build_fact_indexes(root)
    return root


@pytest.fixture
def retriever(index_root, redis_url):
    settings = RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=index_root,
        default_index="facts-a",
        redis_url=redis_url,
        admin_token=TOKEN,
    )
    with retriever_service(settings) as running:
        yield running


def test_retrieve_returns_scored_passages_for_each_query(retriever):
    stub, service, _ = retriever
    assert check_health(f"127.0.0.1:{service.port}")
    reply = stub.Retrieve(
        retriever_pb2.RetrieveRequest(
            queries=["Who wrote Hamlet?", "Who discovered penicillin?"], k=3, return_vectors=True
        )
    )
    assert reply.index == "facts-a"
    assert [r.passages[0].id for r in reply.results] == ["p21", "p18"]
    scores = [p.score for p in reply.results[0].passages]
    assert scores == sorted(scores, reverse=True)
    assert len(reply.results[0].passages[0].vector) == 384


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"queries": [], "k": 3}, "queries"),
        ({"queries": ["  "], "k": 3}, "queries[0]"),
        ({"queries": ["q"], "k": 0}, "k"),
        ({"queries": ["q"], "k": 101}, "k"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(retriever, request_kwargs, field):
    stub, _, _ = retriever
    with pytest.raises(grpc.RpcError) as err:
        stub.Retrieve(retriever_pb2.RetrieveRequest(**request_kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


def test_swap_changes_active_index_and_is_shared_through_redis(retriever, redis_server):
    stub, _, _ = retriever
    listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
    assert listed.active == "facts-a"
    assert {i.name for i in listed.indexes} == {"facts-a", "facts-b"}
    swapped = stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="facts-b"), metadata=ADMIN)
    assert (swapped.previous, swapped.active) == ("facts-a", "facts-b")
    reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1))
    assert reply.index == "facts-b"
    assert reply.results[0].passages[0].id == "b-p21"
    assert ActiveIndexStore(redis_server.client()).get() == "facts-b"
    # An explicit index is served even when it is not the active one.
    reply = stub.Retrieve(
        retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1, index="facts-a")
    )
    assert reply.index == "facts-a"


def test_unknown_index_is_not_found(retriever):
    stub, _, _ = retriever
    with pytest.raises(grpc.RpcError) as err:
        stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="nope"), metadata=ADMIN)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown index 'nope'" in err.value.details()


def test_corrupt_index_is_refused_and_current_keeps_serving(retriever, index_root):
    stub, _, _ = retriever
    broken = index_root / "broken"
    shutil.copytree(index_root / "facts-b", broken)
    try:
        store = next(p for p in broken.iterdir() if p.suffix == ".sqlite")
        with open(store, "r+b") as f:
            f.seek(200)
            f.write(b"corrupted!")
        with pytest.raises(grpc.RpcError) as err:
            stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="broken"), metadata=ADMIN)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checksum" in err.value.details()
        reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1))
        assert reply.index == "facts-a"
    finally:
        shutil.rmtree(broken)


def test_swap_announced_by_another_replica_is_followed(retriever, redis_server):
    import time

    from openbook.state.shared_state import ActiveIndexStore

    stub, _, servicer = retriever
    ActiveIndexStore(redis_server.client()).set("facts-b")
    for _ in range(100):
        if servicer.registry.active == "facts-b":
            break
        time.sleep(0.05)
    assert servicer.registry.active == "facts-b"


def test_metrics_count_rpcs_and_name_the_active_index(retriever):
    from prometheus_client import generate_latest

    stub, service, _ = retriever
    stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1))
    with pytest.raises(grpc.RpcError):
        stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["q"], k=0))
    text = generate_latest(service.metrics.registry).decode()
    assert 'openbook_rpc_total{code="OK",method="Retrieve",service="retriever"} 1.0' in text
    assert 'code="INVALID_ARGUMENT",method="Retrieve"' in text
    assert 'openbook_serving_info{kind="index",name="facts-a",service="retriever"} 1.0' in text
