"""The services bind their port before loading: health says NOT_SERVING and calls get
UNAVAILABLE while the model or index loads, then SERVING. A restart therefore holds its port
from the first second (no client socket can take it meanwhile) and probes see it starting."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openbook.serving.grpc_server import bearer_metadata
from openbook.v1 import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import build_fact_indexes, free_port

TOKEN = "bind-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bind")
    build_fact_indexes(root / "indexes")
    make_tiny_bart(root / "models" / "tiny-bart")
    return root


def _health(addr: str, service: str = "") -> int | None:
    """The health status, or None when nothing answers."""
    with grpc.insecure_channel(addr) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                .status
            )
        except grpc.RpcError:
            return None


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _slow(monkeypatch, module, name: str) -> tuple[threading.Event, threading.Event]:
    """Make ``module.name`` (a step of loading) wait for ``release``; ``entered`` says it is
    running."""
    entered, release = threading.Event(), threading.Event()
    original = getattr(module, name)

    def slow(*args, **kwargs):
        entered.set()
        assert release.wait(60), "never released"
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)
    return entered, release


@pytest.mark.parametrize("service", ["retriever", "generator"])
def test_port_is_bound_and_not_serving_while_loading(service, workdir, redis_url, monkeypatch):
    import openbook_generator.server as generator_server
    import openbook_retriever.server as retriever_server

    port = free_port()
    common = {
        "host": "127.0.0.1",
        "port": port,
        "metrics_port": 0,
        "checkpoint_dir": workdir / "checkpoints",
        "redis_url": redis_url,
        "admin_token": TOKEN,
    }
    if service == "retriever":
        module, slow_step = retriever_server, "warm_up"  # after the index is loaded
        name = "openbook.v1.Retriever"
        settings = RetrieverSettings(
            index_root=workdir / "indexes", default_index="facts-a", **common
        )
    else:
        module, slow_step = generator_server, "load_initial_generator"
        name = "openbook.v1.Generator"
        settings = GeneratorSettings(model=workdir / "models" / "tiny-bart", **common)
    entered, release = _slow(monkeypatch, module, slow_step)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            module.serve(settings, stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    addr = f"127.0.0.1:{port}"
    try:
        assert entered.wait(120), f"{service} never started loading: {errors}"
        # Loading: the port is taken, health answers NOT_SERVING, calls are UNAVAILABLE.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError), socket.socket() as other:
            other.bind(("127.0.0.1", port))
        assert _health(addr) == NOT_SERVING
        assert _health(addr, name) == NOT_SERVING
        with grpc.insecure_channel(addr) as channel:
            if service == "retriever":
                stub = retriever_pb2_grpc.RetrieverStub(channel)
                calls = [
                    lambda: stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["q"], k=1)),
                    lambda: stub.SwapIndex(
                        retriever_pb2.SwapIndexRequest(name="facts-b"),
                        metadata=bearer_metadata(TOKEN),
                    ),
                ]
            else:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                calls = [
                    lambda: stub.Info(generator_pb2.InfoRequest()),
                    lambda: stub.ReloadModel(
                        common_pb2.ReloadModelRequest(), metadata=bearer_metadata(TOKEN)
                    ),
                ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "starting" in err.value.details()
            # Loaded: SERVING, and the same calls are answered.
            release.set()
            _wait(lambda: _health(addr) == SERVING, 120, f"{service} to serve")
            assert _health(addr, name) == SERVING
            if service == "retriever":
                reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["Hamlet"], k=1))
                assert reply.index == "facts-a"
            else:
                assert stub.Info(generator_pb2.InfoRequest()).model_version
    finally:
        release.set()
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), f"{service} did not stop"
    assert errors == []
    assert _health(addr) is None  # stopped: the port is released


def test_a_failed_load_releases_the_port_and_raises(workdir, redis_url):
    from openbook_generator.server import serve

    port = free_port()
    settings = GeneratorSettings(
        host="127.0.0.1",
        port=port,
        metrics_port=0,
        model=workdir / "no-such-model",
        checkpoint_dir=workdir / "checkpoints",
        redis_url=redis_url,
    )
    with pytest.raises(Exception):  # noqa: B017 - whatever the loader raises, it propagates
        serve(settings, threading.Event())
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # free again: a restart can bind it


def test_a_second_service_on_a_taken_port_fails_to_bind():
    # grpc would share the port (SO_REUSEPORT) and split the connections between the two.
    from openbook.serving.grpc_server import GrpcService

    first = GrpcService("first", "127.0.0.1", 0, lambda server: None, access_log=False)
    first.start()
    try:
        with pytest.raises(OSError, match="cannot bind"):
            GrpcService("second", "127.0.0.1", first.port, lambda server: None, access_log=False)
    finally:
        first.stop(0)
