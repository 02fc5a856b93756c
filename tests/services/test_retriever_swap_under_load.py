"""Swapping indexes back and forth under concurrent load never fails or mixes a request."""

import threading
import time

import grpc
import pytest

from openbook.serving.grpc_server import bearer_metadata
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_retriever.server import build
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.stack import build_fact_indexes

LOAD_SECONDS = 20
CLIENTS = 4


@pytest.fixture(scope="module")
def index_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexes")
    build_fact_indexes(root)
    return root


def test_swap_back_and_forth_under_load_fails_no_request(index_root, redis_url):
    settings = RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=index_root,
        default_index="facts-a",
        redis_url=redis_url,
        max_loaded_indexes=1,
        admin_token="swap-token",
    )
    # max_loaded_indexes=1: every swap also releases the previous index while requests on it
    # may still be running — the hardest case for leases.
    service, _, stop = build(settings)
    service.set_serving(True)
    service.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = retriever_pb2_grpc.RetrieverStub(channel)
    failures: list[str] = []
    answered = {"facts-a": 0, "facts-b": 0}
    done = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        while not done.is_set():
            try:
                reply = stub.Retrieve(
                    retriever_pb2.RetrieveRequest(
                        queries=["Who wrote Hamlet?", "Who discovered penicillin?"], k=3
                    ),
                    timeout=10,
                )
            except grpc.RpcError as err:
                failures.append(f"{err.code()}: {err.details()}")
                continue
            ids = [p.id for r in reply.results for p in r.passages]
            from_b = {i.startswith("b-") for i in ids}
            if from_b != {reply.index == "facts-b"}:
                failures.append(f"labelled {reply.index} but passages {ids}")
            with lock:
                answered[reply.index] += 1

    swaps = 0

    def swapper() -> None:
        nonlocal swaps
        target = "facts-b"
        while not done.is_set():
            stub.SwapIndex(
                retriever_pb2.SwapIndexRequest(name=target),
                timeout=30,
                metadata=bearer_metadata("swap-token"),
            )
            swaps += 1
            target = "facts-a" if target == "facts-b" else "facts-b"
            time.sleep(0.2)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    threads.append(threading.Thread(target=swapper))
    for t in threads:
        t.start()
    time.sleep(LOAD_SECONDS)
    done.set()
    for t in threads:
        t.join(30)
    channel.close()
    stop.set()
    service.stop(0)

    assert failures == []
    assert swaps >= 10
    assert answered["facts-a"] > 0 and answered["facts-b"] > 0
