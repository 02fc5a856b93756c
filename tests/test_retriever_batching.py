"""The retriever batches concurrent Retrieve calls: same results as one by one, errors per call."""

from __future__ import annotations

import threading

import grpc
import pytest

from openbook.index.request import SearchRequest
from openbook.serving.grpc_server import GrpcService
from openbook.serving.metrics import ServiceMetrics
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_retriever.registry import IndexRegistry
from openbook_retriever.servicer import RetrieverServicer, _Search, search_batch
from openbook_testkit.index import QUESTIONS
from openbook_testkit.stack import build_fact_indexes

CALLS = 12


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexes")
    build_fact_indexes(root)
    registry = IndexRegistry(root)
    registry.swap("facts-a")
    yield registry
    registry.close()


def test_concurrent_calls_share_batches_and_get_their_own_results(registry):
    metrics = ServiceMetrics("retriever")
    # A long wait makes batching certain on a busy machine; results must not depend on it.
    servicer = RetrieverServicer(
        registry, metrics=metrics, max_batch_size=32, max_batch_wait_ms=200, max_queue=64
    )
    service = GrpcService(
        "openbook.v1.Retriever",
        "127.0.0.1",
        0,
        lambda server: retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, server),
        metrics=metrics,
    )
    service.start()
    questions = list(QUESTIONS.values())
    requests = [
        retriever_pb2.RetrieveRequest(
            queries=[questions[i % len(questions)], questions[(i + 1) % len(questions)]],
            k=2 + i % 3,
            index="facts-b" if i % 4 == 0 else "",
            return_vectors=i % 3 == 0,
        )
        for i in range(CALLS)
    ]
    requests.append(retriever_pb2.RetrieveRequest(queries=["q"], k=2, index="wiki-1999"))
    replies: dict[int, object] = {}

    def call(i: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = retriever_pb2_grpc.RetrieverStub(channel)
            try:
                replies[i] = stub.Retrieve(requests[i], timeout=60)
            except grpc.RpcError as err:
                replies[i] = err

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    service.stop(0)
    servicer.close()

    error = replies[CALLS]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND
    for i, request in enumerate(requests[:CALLS]):
        reply = replies[i]
        assert not isinstance(reply, grpc.RpcError), reply
        name = request.index or "facts-a"
        assert reply.index == name
        with registry.lease(name) as index:
            expected = index.search(SearchRequest(list(request.queries), k=request.k))
        got = [[p.id for p in result.passages] for result in reply.results]
        assert got == [[p.id for p in hits] for hits in expected]
        for result in reply.results:
            for p in result.passages:
                assert (len(p.vector) == 384) == request.return_vectors
    sizes = metrics.batch_size.collect()[0].samples
    count = next(s.value for s in sizes if s.name == "openbook_batch_size_count")
    assert count < CALLS  # fewer batches than calls: they were shared


def test_an_error_in_one_group_fails_only_its_calls(registry):
    class Broken:
        dense = True
        name = "broken"

        def check_encoder(self, encoder) -> None:
            pass

        def search(self, *args, **kwargs):
            raise ValueError("broken index")

    with registry.lease("facts-a") as index:
        encoder = index.query_encoder
        items = [
            _Search(index, None, SearchRequest(["Who wrote Hamlet?"], k=2, retrieval="dense")),
            _Search(
                Broken(), encoder, SearchRequest(["Who wrote Hamlet?"], k=2, retrieval="dense")
            ),
            _Search(
                index, None, SearchRequest(["Who discovered penicillin?"], k=3, retrieval="dense")
            ),
        ]
        results = search_batch(items)
    assert results[0][0][0].id == "p21" and len(results[0][0]) == 2
    assert isinstance(results[1], ValueError)
    assert results[2][0][0].id == "p18" and len(results[2][0]) == 3
