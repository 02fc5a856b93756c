"""Model reloads reach every replica: ``POST /admin/reload-model`` records the desired
checkpoint in Redis, and every retriever and generator replica (not only the one a gateway
channel reaches) loads it, or reports why not and keeps its model; a replica started later
converges at start; the answer cache never files an answer under a version that did not
compute it while replicas disagree."""

from __future__ import annotations

import time

import grpc
import pytest
from checkpoints_kit import tiny_checkpoint
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from openbook.security.sealing import default_sealer
from openbook.state.redis_protocol import (
    DESIRED_MODEL_KEY,
    INDEX_STATE_KEY,
    MODEL_VERSIONS_KEY,
    answer_key,
    open_index_state,
    open_model_version,
)
from openbook.v1 import generator_pb2, generator_pb2_grpc, retriever_pb2, retriever_pb2_grpc
from openbook_gateway.app import create_app
from openbook_gateway.cache import ANSWER_PARAMS
from openbook_gateway.schemas import AnswerRequest
from openbook_gateway.settings import GatewaySettings
from openbook_generator.server import build as build_generator
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.server import build as build_retriever
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import build_fact_indexes, free_port

TOKEN = "replica-reload-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Replicas:
    """Retriever and generator replicas in this process, sharing one Redis and checkpoint root."""

    def __init__(self, retriever: RetrieverSettings, generator: GeneratorSettings) -> None:
        self.retriever_settings = retriever
        self.generator_settings = generator
        self.retrievers: list = []  # (service, servicer, stop)
        self.generators: list = []  # (service, servicer)

    def add_retriever(self, **overrides):
        service, servicer, stop = build_retriever(
            self.retriever_settings.model_copy(update=overrides)
        )
        service.set_serving(True)
        service.start()
        self.retrievers.append((service, servicer, stop))
        return service, servicer

    def add_generator(self, **overrides):
        service, servicer = build_generator(self.generator_settings.model_copy(update=overrides))
        service.set_serving(True)
        service.start()
        self.generators.append((service, servicer))
        return service, servicer

    def close(self) -> None:
        for service, _, stop in self.retrievers:
            stop.set()
            service.stop(0)
        for service, servicer in self.generators:
            service.stop(0)
            servicer.close()


def generator_version(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        info = generator_pb2_grpc.GeneratorStub(channel).Info(generator_pb2.InfoRequest())
    return info.model_version


def retriever_version(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = retriever_pb2_grpc.RetrieverStub(channel).Retrieve(
            retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1)
        )
    return reply.model_version


def served_versions(replicas: Replicas) -> dict[str, list[str]]:
    """Each replica's version, asked of the replica itself (RPC), checked against its metrics."""
    versions: dict[str, list[str]] = {"retriever": [], "generator": []}
    for service, *_ in replicas.retrievers:
        versions["retriever"].append(retriever_version(service.port))
    for service, _ in replicas.generators:
        versions["generator"].append(generator_version(service.port))
    for kind, services in (("retriever", replicas.retrievers), ("generator", replicas.generators)):
        for (service, *_), version in zip(services, versions[kind], strict=True):
            scraped = generate_latest(service.metrics.registry).decode()
            assert f'kind="model",name="{version}"' in scraped, scraped
    return versions


@pytest.fixture(scope="module")
def system(tmp_path_factory, redis_server):
    redis_server.flush()
    tmp = tmp_path_factory.mktemp("replicas")
    build_fact_indexes(tmp / "indexes")
    bart = make_tiny_bart(tmp / "bart")
    common = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_server.url,
        "checkpoint_dir": tmp / "checkpoints",
        "admin_token": TOKEN,
    }
    replicas = Replicas(
        RetrieverSettings(index_root=tmp / "indexes", default_index="facts-a", **common),
        GeneratorSettings(model=bart, **common),
    )
    try:
        for _ in range(2):
            replicas.add_retriever()
            replicas.add_generator()
        # The gateway's channels reach the first replica of each service only.
        gateway = GatewaySettings(
            retriever_addr=f"127.0.0.1:{replicas.retrievers[0][0].port}",
            generator_addr=f"127.0.0.1:{replicas.generators[0][0].port}",
            redis_url=redis_server.url,
            admin_token=TOKEN,
            reload_wait_s=120,
        )
        with TestClient(create_app(gateway)) as client:
            yield client, tmp, bart, replicas, redis_server.client()
    finally:
        replicas.close()
        redis_server.client().delete(DESIRED_MODEL_KEY)


def test_reload_reaches_every_replica(system):
    client, tmp, bart, replicas, _ = system
    before = served_versions(replicas)
    assert all(v.startswith("bart") for v in before["generator"]), before
    tiny_checkpoint(tmp / "checkpoints", 1, bart)

    reply = client.post("/admin/reload-model", json={}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["generator"] == body["retriever"] == "step-000001"
    assert body["checkpoint"] == "step-000001"  # "latest", pinned for every replica
    assert len(body["replicas"]) == 4
    assert {(r["service"], r["state"], r["version"]) for r in body["replicas"]} == {
        ("retriever", "converged", "step-000001"),
        ("generator", "converged", "step-000001"),
    }
    assert served_versions(replicas) == {
        "retriever": ["step-000001"] * 2,
        "generator": ["step-000001"] * 2,
    }

    listed = client.get("/admin/replicas", headers=AUTH)
    assert listed.status_code == 200, listed.text
    assert listed.json()["desired"]["resolved"] == "step-000001"
    assert (
        sorted(r["service"] for r in listed.json()["replicas"])
        == ["generator"] * 2 + ["retriever"] * 2
    )
    assert {r["version"] for r in listed.json()["replicas"]} == {"step-000001"}
    assert client.get("/admin/replicas").status_code == 401


def test_corrupt_checkpoint_fails_on_every_replica_and_old_model_stays(system):
    client, tmp, bart, replicas, _ = system
    ckpt = tiny_checkpoint(tmp / "checkpoints", 2, bart)
    weights = next((ckpt / "generator").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))

    reply = client.post("/admin/reload-model", json={"checkpoint": "step-000002"}, headers=AUTH)
    assert reply.status_code == 422, reply.text
    body = reply.json()
    assert "corrupt" in body["detail"]
    assert len(body["replicas"]) == 4
    for replica in body["replicas"]:
        assert replica["state"] == "failed", replica
        assert "corrupt" in replica["error"]
        assert replica["version"] == "step-000001"
    assert served_versions(replicas) == {
        "retriever": ["step-000001"] * 2,
        "generator": ["step-000001"] * 2,
    }
    # outside the checkpoint root: refused by every replica, with the one fixed message
    outside = client.post("/admin/reload-model", json={"checkpoint": "/etc"}, headers=AUTH)
    assert outside.status_code == 422
    assert {r["state"] for r in outside.json()["replicas"]} == {"failed"}
    assert "not inside the checkpoint root" in outside.json()["detail"]


def test_late_joiner_converges_to_the_desired_version_at_start(system):
    client, tmp, bart, replicas, _ = system
    tiny_checkpoint(tmp / "checkpoints", 3, bart)  # "latest" is now step-000003
    reply = client.post("/admin/reload-model", json={"checkpoint": "step-000001"}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    # A replica started now loads the desired checkpoint, not the latest one.
    _, late_retriever = replicas.add_retriever()
    _, late_generator = replicas.add_generator()
    assert late_retriever.model_version == "step-000001"
    assert late_generator.generator.model_version == "step-000001"
    assert served_versions(replicas) == {
        "retriever": ["step-000001"] * 3,
        "generator": ["step-000001"] * 3,
    }
    listed = client.get("/admin/replicas", headers=AUTH).json()["replicas"]
    assert len(listed) == 6
    assert {(r["state"], r["version"]) for r in listed} == {("converged", "step-000001")}


def _published(redis, service: str) -> str | None:
    """The model version ``service`` published, as a gateway reads it (sealed)."""
    record = open_model_version(default_sealer(), service, redis.hget(MODEL_VERSIONS_KEY, service))
    return record["version"] if record is not None else None


def test_cache_never_files_an_answer_under_a_version_that_did_not_compute_it(system):
    """Mid-convergence: the second generator replica already serves step-000003 (and has
    announced it) while the one the gateway reaches still serves step-000001."""
    client, _, _, replicas, redis = system
    replicas.generators[1][1].load_checkpoint("step-000003")
    deadline = time.monotonic() + 10
    while _published(redis, "generator") != "step-000003":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    question = {"question": "Who painted the Mona Lisa?", "k": 2}
    first = client.post("/answer", json=question).json()
    assert first["model_version"] == "step-000001"  # computed by the replica behind the channel
    assert first["cached"] is False
    params = AnswerRequest(**question).model_dump(include=set(ANSWER_PARAMS))
    raw = redis.hget(INDEX_STATE_KEY, first["index"])
    state = open_index_state(default_sealer(), first["index"], raw)
    assert state is not None
    params |= {"index_version": 0, "index_epoch": state["epoch"]}  # never written to
    models = {"retriever": first["retriever_version"]}
    stored = answer_key(
        first["index"], {**params, "models": {**models, "generator": "step-000001"}}
    )
    wrong = answer_key(first["index"], {**params, "models": {**models, "generator": "step-000003"}})
    assert redis.exists(stored) and not redis.exists(wrong)
    # Looked up under the announced (newer) version: never the old model's answer.
    again = client.post("/answer", json=question).json()
    assert again["cached"] is False
    assert again["model_version"] == "step-000001"


def test_without_redis_the_reload_reaches_the_channels_replica_only(system):
    """Today's behaviour, with a warning: ReloadModel over the gateway's channels."""
    _, _, _, replicas, _ = system
    dead = f"redis://127.0.0.1:{free_port()}/0"
    gateway = GatewaySettings(
        retriever_addr=f"127.0.0.1:{replicas.retrievers[0][0].port}",
        generator_addr=f"127.0.0.1:{replicas.generators[0][0].port}",
        redis_url=dead,
        admin_token=TOKEN,
    )
    with TestClient(create_app(gateway)) as client:
        reply = client.post("/admin/reload-model", json={"checkpoint": "step-000003"}, headers=AUTH)
        assert reply.status_code == 200, reply.text
        assert reply.json()["replicas"] is None
        assert reply.json()["retriever"] == "step-000003"
        assert client.get("/admin/replicas", headers=AUTH).status_code == 503
    versions = served_versions(replicas)
    assert versions["retriever"][0] == "step-000003"
    assert versions["retriever"][1:] == ["step-000001"] * 2  # nothing told the others
