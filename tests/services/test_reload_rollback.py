"""``POST /admin/reload-model`` switches the retriever and the generator both or neither: when
one refuses the checkpoint, the one that switched is put back on the model it served (as a
refused index swap puts back the shards that had swapped), through Redis for every replica
and over RPC without it; when it cannot be put back, the answer says the services disagree."""

from __future__ import annotations

import grpc
import pytest
from checkpoints_kit import tiny_checkpoint
from fastapi.testclient import TestClient

from openbook.security.sealing import default_sealer
from openbook.state.redis_protocol import DESIRED_MODEL_KEY, desired_fields
from openbook.storage.checkpoint import CheckpointError
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings
from openbook_generator.server import build as build_generator
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.server import build as build_retriever
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import build_fact_indexes, free_port

TOKEN = "rollback-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REFUSED = "step-000002"


@pytest.fixture(scope="module")
def system(tmp_path_factory, redis_server):
    redis_server.flush()
    tmp = tmp_path_factory.mktemp("rollback")
    build_fact_indexes(tmp / "indexes")
    bart = make_tiny_bart(tmp / "bart")
    for step in (1, 2):
        tiny_checkpoint(tmp / "checkpoints", step, bart)
    common = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_server.url,
        "checkpoint_dir": tmp / "checkpoints",
        "load_latest_checkpoint": False,
        "admin_token": TOKEN,
    }
    retriever, retriever_servicer, stop = build_retriever(
        RetrieverSettings(index_root=tmp / "indexes", default_index="facts-a", **common)
    )
    generator, generator_servicer = build_generator(GeneratorSettings(model=bart, **common))
    for service in (retriever, generator):
        service.set_serving(True)
        service.start()
    try:
        yield retriever, retriever_servicer, generator, generator_servicer
    finally:
        stop.set()
        retriever.stop(0)
        generator.stop(0)
        generator_servicer.close()
        redis_server.client().delete(DESIRED_MODEL_KEY)


def gateway(system, redis_url: str) -> TestClient:
    retriever, _, generator, _ = system
    return TestClient(
        create_app(
            GatewaySettings(
                retriever_addr=f"127.0.0.1:{retriever.port}",
                generator_addr=f"127.0.0.1:{generator.port}",
                redis_url=redis_url,
                admin_token=TOKEN,
                reload_wait_s=120,
            )
        )
    )


def refusing(load):
    """``load`` (a generator's checkpoint loader), except that it refuses ``REFUSED``."""

    def refuse(requested, *args, **kwargs):
        if REFUSED in str(requested):
            raise CheckpointError(f"checkpoint {REFUSED!r}: refused by this generator")
        return load(requested, *args, **kwargs)

    return refuse


def served(system) -> dict[str, str]:
    retriever, retriever_servicer, _, generator_servicer = system
    with grpc.insecure_channel(f"127.0.0.1:{retriever.port}") as channel:
        reply = retriever_pb2_grpc.RetrieverStub(channel).Retrieve(
            retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1)
        )
    assert reply.model_version == retriever_servicer.model_version
    return {
        "retriever": reply.model_version,
        "generator": generator_servicer.generator.model_version,
    }


def test_a_switch_that_cannot_be_undone_is_a_409_saying_so(system, redis_server, monkeypatch):
    """Fresh services serve no checkpoint (the index's encoder, the base generator): there is
    no one checkpoint to put the retriever back on."""
    before = served(system)
    assert before["retriever"] == "index-default"
    follower = system[3].follower
    monkeypatch.setattr(follower, "_load", refusing(follower._load))
    with gateway(system, redis_server.url) as client:
        reply = client.post("/admin/reload-model", json={"checkpoint": REFUSED}, headers=AUTH)
    assert reply.status_code == 409, reply.text
    body = reply.json()
    assert "refused by this generator" in body["detail"]
    assert "cannot be put back" in body["detail"]
    assert body["rolled_back"] is None
    assert served(system) == {"retriever": REFUSED, "generator": before["generator"]}


def test_through_redis_the_replica_that_switched_is_put_back(system, redis_server, monkeypatch):
    with gateway(system, redis_server.url) as client:
        reply = client.post("/admin/reload-model", json={"checkpoint": "step-000001"}, headers=AUTH)
        assert reply.status_code == 200, reply.text
        assert served(system) == {"retriever": "step-000001", "generator": "step-000001"}

        follower = system[3].follower
        monkeypatch.setattr(follower, "_load", refusing(follower._load))
        reply = client.post("/admin/reload-model", json={"checkpoint": REFUSED}, headers=AUTH)
    assert reply.status_code == 422, reply.text
    body = reply.json()
    assert "refused by this generator" in body["detail"]
    assert "put back on step-000001" in body["detail"]
    assert body["rolled_back"] == "step-000001"
    assert (body["retriever"], body["generator"]) == ("step-000001", "step-000001")
    states = {(r["service"], r["state"], r["version"]) for r in body["replicas"]}
    assert states == {("retriever", "converged", REFUSED), ("generator", "failed", "step-000001")}
    assert served(system) == {"retriever": "step-000001", "generator": "step-000001"}
    # A replica started now follows the desired model: the one put back.
    desired = desired_fields(default_sealer(), redis_server.client().hgetall(DESIRED_MODEL_KEY))
    assert desired["resolved"] == "step-000001"


def test_over_rpc_the_retriever_is_put_back(system, redis_server, monkeypatch):
    assert served(system) == {"retriever": "step-000001", "generator": "step-000001"}
    generator_servicer = system[3]
    monkeypatch.setattr(
        generator_servicer, "load_checkpoint", refusing(generator_servicer.load_checkpoint)
    )
    with gateway(system, f"redis://127.0.0.1:{free_port()}/0") as client:  # no Redis
        reply = client.post("/admin/reload-model", json={"checkpoint": REFUSED}, headers=AUTH)
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"]
    assert "refused by this generator" in detail
    assert "the retriever was put back on step-000001" in detail
    assert served(system) == {"retriever": "step-000001", "generator": "step-000001"}
