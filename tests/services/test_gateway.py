"""The gateway over real retriever and generator gRPC servers on loopback and a real Redis."""

from __future__ import annotations

import time

import grpc
import pytest
from fastapi.testclient import TestClient

import openbook_gateway.routes.health as health_routes
from openbook_gateway.app import create_app
from openbook_testkit.stack import Backends, free_port, running_backends

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    with running_backends(
        tmp_path_factory.mktemp("backends"), redis_server.url, admin_token=TOKEN
    ) as running:
        yield running


def gateway(backends: Backends, redis_url: str, **overrides) -> TestClient:
    settings = backends.gateway_settings(redis_url, **{"admin_token": TOKEN, **overrides})
    return TestClient(create_app(settings))


@pytest.fixture
def client(backends, redis_url):
    with gateway(backends, redis_url) as client:
        yield client
        # Leave facts-a active for the next test.
        client.post("/admin/swap-index", json={"index": "facts-a"}, headers=AUTH)


def test_answer_flows_through_retriever_and_generator(client):
    reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 3})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["index"] == "facts-a"
    assert isinstance(body["answer"], str)
    assert len(body["passages"]) == 3
    assert body["passages"][0]["id"] == "p21"
    assert sum(p["prior"] for p in body["passages"]) == pytest.approx(1.0, abs=1e-4)
    assert body["cached"] is False
    assert {"retrieve_ms", "generate_ms", "total_ms"} <= set(body["timings_ms"])
    assert body["hypotheses"][0]["tokens"] is not None  # rag-token provenance
    assert reply.headers["x-request-id"] == body["request_id"]


def test_repeated_question_is_served_from_cache(client):
    question = {"question": "Who discovered penicillin?", "k": 2}
    first = client.post("/answer", json=question).json()
    second = client.post("/answer", json=question).json()
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["answer"] == first["answer"]
    assert second["passages"] == first["passages"]
    metrics = client.get("/metrics").text
    assert 'openbook_gateway_cache_total{outcome="hit"} 1.0' in metrics


def test_swap_changes_index_and_never_serves_the_other_index_cache(client):
    question = {"question": "Who wrote Hamlet?", "k": 2}
    before = client.post("/answer", json=question).json()
    client.post("/answer", json=question)  # now cached for facts-a
    swapped = client.post("/admin/swap-index", json={"index": "facts-b"}, headers=AUTH)
    assert swapped.status_code == 200, swapped.text
    assert swapped.json() == {"previous": "facts-a", "active": "facts-b"}
    after = client.post("/answer", json=question).json()
    assert after["index"] == "facts-b"
    assert after["cached"] is False
    assert after["passages"][0]["id"] == "b-p21"
    assert before["passages"][0]["id"] == "p21"
    assert client.get("/indexes").json()["active"] == "facts-b"


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}]
)
def test_admin_needs_the_bearer_token(client, headers):
    reply = client.post("/admin/swap-index", json={"index": "facts-b"}, headers=headers)
    assert reply.status_code == 401
    answer = client.post("/answer", json={"question": "Who wrote Hamlet?"}).json()
    assert answer["index"] == "facts-a"


def test_admin_is_disabled_without_a_configured_token(backends, redis_url):
    with gateway(backends, redis_url, admin_token=None) as client:
        reply = client.post("/admin/swap-index", json={"index": "facts-b"}, headers=AUTH)
    assert reply.status_code == 401
    assert "OPENBOOK_ADMIN_TOKEN" in reply.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"question": ""}, "question"),
        ({"question": "   "}, "question"),
        ({"question": "x" * 2001}, "question"),
        ({"question": "q", "k": 0}, "k"),
        ({"question": "q", "k": 101}, "k"),
        ({"question": "q", "decoding": "nucleus"}, "decoding"),
        ({"question": "q", "num_beams": 0}, "num_beams"),
        ({"k": 3}, "question"),
    ],
)
def test_bad_answer_requests_are_422_naming_the_field(client, body, field):
    reply = client.post("/answer", json=body)
    assert reply.status_code == 422
    assert field in {str(part) for err in reply.json()["detail"] for part in err["loc"]}


def test_unknown_index_is_422_naming_it(client):
    reply = client.post("/admin/swap-index", json={"index": "wiki-1999"}, headers=AUTH)
    assert reply.status_code == 422
    assert "wiki-1999" in reply.json()["detail"]
    reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "index": "wiki-1999"})
    assert reply.status_code == 422
    assert "index" in reply.json()["detail"]


def test_readiness_reports_both_services(client, monkeypatch):
    # No replica state in Redis (these backends' replicas publish theirs every 0.5 s): the
    # body is exactly what it always was.
    async def no_replicas(redis_client, sealer) -> list[dict]:
        return []

    monkeypatch.setattr(health_routes, "list_replicas", no_replicas)
    reply = client.get("/readyz")
    assert reply.status_code == 200
    assert reply.json() == {
        "ready": True,
        "services": {"retriever": True, "generator": True},
        "redis": True,
    }
    assert client.get("/healthz").status_code == 200


def test_readiness_lists_each_replica_and_the_version_it_serves(client, backends):
    # The backends' replicas publish their state in Redis (every 0.5 s, after a flush too).
    deadline = time.monotonic() + 10
    while True:
        body = client.get("/readyz").json()
        if {r["service"] for r in body.get("replicas", [])} == {"retriever", "generator"}:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    assert {key: body[key] for key in ("ready", "services", "redis")} == {
        "ready": True,
        "services": {"retriever": True, "generator": True},
        "redis": True,
    }
    assert set(body) == {"ready", "services", "redis", "replicas"}
    assert len(body["replicas"]) == 2
    generator = backends.generator_servicer.generator.model_version
    for replica in body["replicas"]:
        assert set(replica) == {"service", "replica", "version", "state"}
        assert replica["replica"] and replica["version"]
        assert replica["state"] == "converged"
    assert [r["version"] for r in body["replicas"] if r["service"] == "generator"] == [generator]


def test_service_down_is_503_naming_it_within_the_deadline(backends, redis_url):
    settings = backends.gateway_settings(
        redis_url,
        retriever_addr=f"127.0.0.1:{free_port()}",  # nothing listens there
        retrieve_timeout_s=2.0,
        health_timeout_s=0.5,
    )
    with TestClient(create_app(settings)) as client:
        started = time.monotonic()
        reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "use_cache": False})
        elapsed = time.monotonic() - started
        assert reply.status_code in (503, 504)
        assert "retriever" in reply.json()["detail"]
        assert elapsed < 10
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["services"] == {"retriever": False, "generator": True}


def test_answers_keep_coming_without_redis(backends):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    with gateway(backends, dead_redis) as client:
        for _ in range(2):
            reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 2})
            assert reply.status_code == 200, reply.text
            assert reply.json()["cached"] is False
        assert client.get("/readyz").json()["redis"] is False


def test_generator_rejects_bad_passages_with_invalid_argument(backends):
    from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{backends.generator_port}") as channel:
        stub = generator_pb2_grpc.GeneratorStub(channel)
        for request, field in [
            (generator_pb2.GenerateRequest(question="q"), "passages"),
            (
                generator_pb2.GenerateRequest(
                    question="q",
                    passages=[common_pb2.Passage(title="t", text="x")],
                    options=generator_pb2.DecodingOptions(num_beams=99),
                ),
                "num_beams",
            ),
            (
                generator_pb2.GenerateRequest(
                    question="q",
                    passages=[common_pb2.Passage(title="t", text="x")],
                    options=generator_pb2.DecodingOptions(mode="beam-me-up"),
                ),
                "mode",
            ),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
