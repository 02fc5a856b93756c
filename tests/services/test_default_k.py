"""A RAG checkpoint's config ``n_docs`` is the default number of passages: the generator
reports it (``ModelInfo.default_k``), and the gateway retrieves that many for a request that
names no ``k`` (resolved before the answer-cache key is built); an explicit ``k`` still wins,
and a generator without a preference (BART, causal LM) gets 5."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient

from openbook.rag.loading import rag_n_docs
from openbook.state.redis_protocol import ANSWER_KEY_PREFIX
from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from openbook_gateway.app import create_app
from openbook_gateway.cache import ANSWER_PARAMS
from openbook_gateway.default_k import DefaultK
from openbook_testkit.rag import make_tiny_rag_checkpoint
from openbook_testkit.stack import running_backends

TOKEN = "default-k-token"
QUESTION = "Who wrote Hamlet?"


@pytest.fixture(scope="module")
def rag_backends(tmp_path_factory, redis_server):
    workdir = tmp_path_factory.mktemp("rag-backends")
    model = make_tiny_rag_checkpoint(workdir / "models" / "tiny-rag", n_docs=3)
    with running_backends(workdir, redis_server.url, TOKEN, generator_model=model) as running:
        yield running


@pytest.fixture
def rag_client(rag_backends, redis_url):
    with TestClient(create_app(rag_backends.gateway_settings(redis_url))) as client:
        yield client


def info(port: int) -> common_pb2.ModelInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return generator_pb2_grpc.GeneratorStub(channel).Info(generator_pb2.InfoRequest())


def test_the_generator_reports_the_checkpoints_n_docs(rag_backends):
    assert info(rag_backends.generator_port).default_k == 3


def test_a_request_without_k_gets_the_models_n_docs(rag_client):
    reply = rag_client.post("/answer", json={"question": QUESTION, "use_cache": False})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["passages"]) == 3
    # null means "not given" too
    reply = rag_client.post("/answer", json={"question": QUESTION, "k": None, "use_cache": False})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["passages"]) == 3


@pytest.mark.parametrize("k", [1, 2, 5])
def test_an_explicit_k_still_wins(rag_client, k):
    reply = rag_client.post("/answer", json={"question": QUESTION, "k": k, "use_cache": False})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["passages"]) == k


def test_the_cache_key_holds_the_resolved_k(rag_client, redis_server):
    question = "Who discovered penicillin?"
    first = rag_client.post("/answer", json={"question": question}).json()
    assert (first["cached"], len(first["passages"])) == (False, 3)
    # Naming the default explicitly is the same request: served from the same entry.
    same = rag_client.post("/answer", json={"question": question, "k": 3}).json()
    assert same["cached"] is True
    assert same["passages"] == first["passages"]
    other = rag_client.post("/answer", json={"question": question, "k": 4}).json()
    assert (other["cached"], len(other["passages"])) == (False, 4)
    # The stored entry is filed under k=3, never under a missing k.
    params = {
        "question": question,
        "k": 3,
        "decoding": "rag-token",
        "num_beams": 1,
        "max_new_tokens": 32,
        "min_new_tokens": 0,
        "num_return_sequences": 1,
        "length_penalty": 1.0,
        "retrieval": None,  # the index's default
    }
    assert set(params) == set(ANSWER_PARAMS)
    # Two entries, k=3's and k=4's: the request naming no k took k=3's (the key also holds the
    # models and the index's sealed state, whose epoch is random: issue 42).
    stored = list(redis_server.client().scan_iter(f"{ANSWER_KEY_PREFIX}*"))
    assert len(stored) == 2, stored


def test_a_bart_generator_defaults_to_5(tmp_path_factory, redis_server, redis_url):
    workdir = tmp_path_factory.mktemp("bart-backends")
    with running_backends(workdir, redis_server.url, TOKEN) as backends:
        assert info(backends.generator_port).default_k == 0  # no preference
        with TestClient(create_app(backends.gateway_settings(redis_url))) as client:
            reply = client.post("/answer", json={"question": QUESTION, "use_cache": False})
            assert reply.status_code == 200, reply.text
            assert len(reply.json()["passages"]) == 5
            reply = client.post("/answer", json={"question": QUESTION, "k": 2})
            assert len(reply.json()["passages"]) == 2


def test_the_docs_name_the_default(rag_client):
    schema = rag_client.get("/openapi.json").json()
    k = schema["components"]["schemas"]["AnswerRequest"]["properties"]["k"]
    assert "default: the model's n_docs (5)" in k["description"]
    page = rag_client.get("/").text
    assert "default: the model's n_docs (5)" in page


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "rag", "n_docs": 3}, 3),
        ({"model_type": "rag", "n_docs": 500}, 100),
        ({"model_type": "rag", "n_docs": 0}, 0),
        ({"model_type": "rag", "n_docs": "3"}, 0),
        ({"model_type": "rag", "n_docs": True}, 0),
        ({"model_type": "rag"}, 0),
        ({"model_type": "bart", "n_docs": 3}, 0),
    ],
)
def test_n_docs_read_from_the_config(config, expected):
    assert rag_n_docs(config) == expected


class FakeGenerator:
    """A generator client whose Info reports ``infos`` in turn."""

    def __init__(self, *infos: tuple[str, int]) -> None:
        self.infos = list(infos)
        self.calls = 0

        class Stub:
            Info = object()

        self.stub = Stub()

    async def call(self, method, request, request_id="", timeout_s=None):
        assert method is self.stub.Info
        version, default_k = self.infos[min(self.calls, len(self.infos) - 1)]
        self.calls += 1
        return common_pb2.ModelInfo(model_version=version, default_k=default_k)


def test_default_k_is_asked_again_when_the_model_version_changes():
    import asyncio

    async def scenario() -> None:
        fake = FakeGenerator(("v1", 3), ("v2", 0))
        defaults = DefaultK(fake, timeout_s=1.0)
        assert await defaults.get() == 3
        defaults.seen("v1")
        assert await defaults.get() == 3
        assert fake.calls == 1  # remembered for v1
        defaults.seen("v2")  # an answer came from a reloaded generator
        assert await defaults.get() == 5  # v2 has no preference
        assert fake.calls == 2
        defaults.seen("v1")  # back to a version seen before: no call
        assert await defaults.get() == 3
        assert fake.calls == 2

    asyncio.run(scenario())
