"""Names with control characters are INVALID_ARGUMENT over gRPC, never NOT_FOUND (issue 29).

An index name with a trailing newline passed ``re.match(r"^...$")`` (``$`` matches before a
final newline) and went looking for a directory ``facts-a\\n``: NOT_FOUND, where every other
malformed name is INVALID_ARGUMENT. Through the real retriever and generator servers: index
names in Retrieve and SwapIndex, checkpoint names in both services' ReloadModel. A valid name
of nothing is still NOT_FOUND, and nothing served changes after a refusal.
"""

from __future__ import annotations

import grpc
import pytest

from openbook.serving.grpc_server import bearer_metadata
from openbook.v1 import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from openbook_testkit.stack import running_backends

TOKEN = "names-admin-token"
ADMIN = bearer_metadata(TOKEN)
BAD_NAMES = ["facts-b\n", "facts-b\r\n", "facts-b\r", "\nfacts-b", "facts\x00-b", "facts\x1b-b"]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory, redis_server):
    redis_server.flush()  # no active index left behind by another module
    with (
        running_backends(
            tmp_path_factory.mktemp("names"), redis_server.url, admin_token=TOKEN
        ) as backends,
        grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as r,
        grpc.insecure_channel(f"127.0.0.1:{backends.generator_port}") as g,
    ):
        yield retriever_pb2_grpc.RetrieverStub(r), generator_pb2_grpc.GeneratorStub(g)


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@pytest.mark.parametrize("name", BAD_NAMES)
def test_index_names_with_control_characters_are_invalid_argument(stubs, name):
    retriever, _ = stubs
    err = _error(
        lambda: retriever.Retrieve(retriever_pb2.RetrieveRequest(queries=["q"], k=1, index=name))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith("index must not contain")
    err = _error(
        lambda: retriever.SwapIndex(retriever_pb2.SwapIndexRequest(name=name), metadata=ADMIN)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith("name must not contain")
    assert retriever.ListIndexes(retriever_pb2.ListIndexesRequest()).active == "facts-a"


def test_a_valid_name_of_no_index_is_still_not_found(stubs):
    retriever, _ = stubs
    err = _error(
        lambda: retriever.Retrieve(retriever_pb2.RetrieveRequest(queries=["q"], k=1, index="nope"))
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("path", ["step-000001\n", "latest\x00", "\x1b[2J", "a\tb"])
def test_checkpoint_names_with_control_characters_are_invalid_argument(stubs, path):
    retriever, generator = stubs
    for service, stub in (("retriever", retriever), ("generator", generator)):
        err = _error(
            lambda stub=stub: stub.ReloadModel(
                common_pb2.ReloadModelRequest(path=path), metadata=ADMIN, timeout=60
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (service, err.details())
        assert err.details().startswith("checkpoint must not contain"), err.details()
    assert generator.Info(generator_pb2.InfoRequest()).model_version
