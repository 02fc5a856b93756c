"""Admin RPCs of the retriever and generator need the admin token; nothing else does."""

from __future__ import annotations

import logging

import grpc
import pytest
from fastapi.testclient import TestClient

from openbook.serving.grpc_server import (
    ADMIN_RPCS,
    GENERATOR_SERVICE,
    RETRIEVER_SERVICE,
    bearer_metadata,
)
from openbook.v1 import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from openbook_gateway.app import create_app
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.stack import running_backends

TOKEN = "grpc-admin-token"
# RPCs that only read: callable without a token. An RPC added to the protos must go here or
# into ADMIN_RPCS (openbook/serving/grpc_server.py): test_every_rpc_is_classified says so.
READ_ONLY_RPCS = {
    RETRIEVER_SERVICE: {"Retrieve", "ListIndexes", "GetDocument", "ListDocuments", "EmbedQueries"},
    GENERATOR_SERVICE: {"Generate", "GenerateStream", "Info"},
}
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    redis_server.flush()  # no active index left behind by another module
    with running_backends(
        tmp_path_factory.mktemp("auth"), redis_server.url, admin_token=TOKEN
    ) as running:
        yield running


@pytest.fixture(scope="module")
def retriever(backends):
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        yield retriever_pb2_grpc.RetrieverStub(channel)


@pytest.fixture(scope="module")
def generator(backends):
    with grpc.insecure_channel(f"127.0.0.1:{backends.generator_port}") as channel:
        yield generator_pb2_grpc.GeneratorStub(channel)


def _admin_calls(retriever, generator):
    """(name, thunk taking metadata) for every admin RPC, with requests that succeed or fail
    for reasons of their own once past the token."""
    return {
        "Retriever/SwapIndex": lambda md: retriever.SwapIndex(
            retriever_pb2.SwapIndexRequest(name="facts-a"), metadata=md, timeout=60
        ),
        "Retriever/ReloadModel": lambda md: retriever.ReloadModel(
            common_pb2.ReloadModelRequest(path="no-such-checkpoint"), metadata=md, timeout=60
        ),
        "Generator/ReloadModel": lambda md: generator.ReloadModel(
            common_pb2.ReloadModelRequest(path="no-such-checkpoint"), metadata=md, timeout=60
        ),
    }


def _code(call, metadata) -> grpc.StatusCode:
    try:
        call(metadata)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_every_rpc_is_classified():
    for module, service in (
        (retriever_pb2, RETRIEVER_SERVICE),
        (generator_pb2, GENERATOR_SERVICE),
    ):
        short = service.rsplit(".", 1)[1]
        rpcs = {m.name for m in module.DESCRIPTOR.services_by_name[short].methods}
        assert ADMIN_RPCS[service] | READ_ONLY_RPCS[service] == rpcs, service
        assert not ADMIN_RPCS[service] & READ_ONLY_RPCS[service]
    assert {"SwapIndex", "ReloadModel"} <= ADMIN_RPCS[RETRIEVER_SERVICE]
    assert "ReloadModel" in ADMIN_RPCS[GENERATOR_SERVICE]


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        bearer_metadata("wrong-token"),
        bearer_metadata(TOKEN[:-1]),
        (("authorization", f"Basic {TOKEN}"),),
        (("authorization", TOKEN),),
        (("x-admin-token", TOKEN),),
        # Exact, as the gateway checks it (openbook.security.auth): no whitespace trimmed or
        # tolerated.
        (("authorization", f"Bearer {TOKEN} "),),
        (("authorization", f"Bearer  {TOKEN}"),),
        (("authorization", f" Bearer {TOKEN}"),),
        (("authorization", "Bearer "),),
        (("authorization", "Bearer"),),
        (("authorization", f"Bearer {TOKEN}x"),),
        (("authorization", f"Bearer {TOKEN.upper()}"),),
    ],
    ids=[
        "none",
        "wrong",
        "prefix",
        "basic",
        "no-scheme",
        "other-header",
        "trailing-space",
        "two-spaces",
        "leading-space",
        "empty-token",
        "scheme-only",
        "suffix",
        "token-case",
    ],
)
def test_admin_rpcs_without_the_right_token_are_unauthenticated(retriever, generator, metadata):
    for name, call in _admin_calls(retriever, generator).items():
        with pytest.raises(grpc.RpcError) as err:
            call(metadata)
        assert err.value.code() == UNAUTHENTICATED, name
        assert TOKEN not in err.value.details()
    # Nothing was done: facts-b was never loaded.
    listed = retriever.ListIndexes(retriever_pb2.ListIndexesRequest())
    assert {i.name: i.loaded for i in listed.indexes}["facts-b"] is False


def test_admin_rpcs_with_the_token_work(retriever, generator):
    admin = bearer_metadata(TOKEN)
    swapped = retriever.SwapIndex(retriever_pb2.SwapIndexRequest(name="facts-b"), metadata=admin)
    assert (swapped.previous, swapped.active) == ("facts-a", "facts-b")
    back = retriever.SwapIndex(retriever_pb2.SwapIndexRequest(name="facts-a"), metadata=admin)
    assert back.active == "facts-a"
    # Past the token, a bad checkpoint is refused for what it is, not for the token.
    for name, call in _admin_calls(retriever, generator).items():
        if name.endswith("ReloadModel"):
            assert _code(call, admin) not in (grpc.StatusCode.OK, UNAUTHENTICATED), name


def test_the_scheme_is_case_insensitive_on_both_sides(retriever, backends, redis_url):
    # RFC 9110: authentication schemes are case-insensitive; the token is not.
    for scheme in ("bearer", "BEARER", "BeArEr"):
        metadata = (("authorization", f"{scheme} {TOKEN}"),)
        reply = retriever.SwapIndex(
            retriever_pb2.SwapIndexRequest(name="facts-a"), metadata=metadata
        )
        assert reply.active == "facts-a"
    with TestClient(create_app(backends.gateway_settings(redis_url))) as client:
        for scheme in ("bearer", "BEARER"):
            reply = client.post(
                "/admin/swap-index",
                json={"index": "facts-a"},
                headers={"Authorization": f"{scheme} {TOKEN}"},
            )
            assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    "authorization",
    [f"Bearer  {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer", f"Basic {TOKEN}"],
    ids=["two-spaces", "suffix", "prefix", "scheme-only", "basic"],
)
def test_the_gateway_refuses_what_the_services_refuse(backends, redis_url, authorization):
    with TestClient(create_app(backends.gateway_settings(redis_url))) as client:
        reply = client.post(
            "/admin/swap-index", json={"index": "facts-a"}, headers={"Authorization": authorization}
        )
        assert reply.status_code == 401, reply.text
        assert TOKEN not in reply.text


def test_read_only_rpcs_need_no_token(retriever, generator):
    for metadata in (None, bearer_metadata("wrong-token")):
        reply = retriever.Retrieve(
            retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=2), metadata=metadata
        )
        assert reply.index == "facts-a"
        assert retriever.ListIndexes(retriever_pb2.ListIndexesRequest(), metadata=metadata).active
        assert generator.Info(generator_pb2.InfoRequest(), metadata=metadata).model_version
        answer = generator.Generate(
            generator_pb2.GenerateRequest(
                question="Who wrote Hamlet?",
                passages=reply.results[0].passages,
                options=generator_pb2.DecodingOptions(max_new_tokens=2),
            ),
            metadata=metadata,
            timeout=60,
        )
        assert answer.hypotheses


def test_refusals_are_counted_and_logged_without_the_token(retriever, backends, caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(grpc.RpcError):
        retriever.SwapIndex(
            retriever_pb2.SwapIndexRequest(name="facts-b"), metadata=bearer_metadata("guess")
        )
    assert "SwapIndex: UNAUTHENTICATED: admin RPC: wrong admin token" in caplog.text
    assert "guess" not in caplog.text


@pytest.mark.parametrize("service", ["retriever", "generator"])
def test_admin_rpcs_are_off_without_a_configured_token(tmp_path, service):
    # Bound, not loaded: the token is checked before anything else, so this is the real
    # service's interceptor chain without the cost of loading a model.
    from openbook_generator.server import bind as bind_generator
    from openbook_retriever.server import bind as bind_retriever

    if service == "retriever":
        bind, settings_class = bind_retriever, RetrieverSettings
    else:
        bind, settings_class = bind_generator, GeneratorSettings
    running, _ = bind(settings_class(host="127.0.0.1", port=0, admin_token=None))
    running.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = (
                retriever_pb2_grpc.RetrieverStub(channel)
                if service == "retriever"
                else generator_pb2_grpc.GeneratorStub(channel)
            )
            for metadata in (None, bearer_metadata(""), bearer_metadata("anything")):
                with pytest.raises(grpc.RpcError) as err:
                    stub.ReloadModel(common_pb2.ReloadModelRequest(), metadata=metadata)
                assert err.value.code() == UNAUTHENTICATED
                assert "OPENBOOK_ADMIN_TOKEN is not set" in err.value.details()
    finally:
        running.stop(0)


def test_the_gateway_forwards_its_token_and_names_a_mismatch(backends, redis_url):
    auth = {"Authorization": "Bearer other-token"}
    settings = backends.gateway_settings(redis_url, admin_token="other-token")
    with TestClient(create_app(settings)) as client:
        reply = client.post("/admin/swap-index", json={"index": "facts-b"}, headers=auth)
        # The caller's token was right for this gateway: the mismatch is the deployment's.
        assert reply.status_code == 502, reply.text
        assert "OPENBOOK_ADMIN_TOKEN" in reply.json()["detail"]
        assert "other-token" not in reply.text
        reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 2})
        assert reply.status_code == 200, reply.text
    same = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(backends.gateway_settings(redis_url))) as client:
        reply = client.post("/admin/swap-index", json={"index": "facts-a"}, headers=same)
        assert reply.status_code == 200, reply.text
