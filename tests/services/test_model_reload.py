"""Reloading a trained checkpoint into running services: new versions answer, in-flight
requests never fail, corrupt checkpoints are refused while the old model keeps serving."""

from __future__ import annotations

import threading

import pytest
from checkpoints_kit import tiny_checkpoint
from fastapi.testclient import TestClient

from openbook_gateway.app import create_app
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import backends_serving, build_fact_indexes

TOKEN = "reload-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def system(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("reload")
    build_fact_indexes(tmp / "indexes")
    bart = make_tiny_bart(tmp / "bart")
    common = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_server.url,
        "checkpoint_dir": tmp / "checkpoints",
        "admin_token": TOKEN,  # the gateway forwards its token on ReloadModel
    }
    retriever = RetrieverSettings(index_root=tmp / "indexes", default_index="facts-a", **common)
    generator = GeneratorSettings(model=bart, **common)
    with (
        backends_serving(retriever, generator) as backends,
        TestClient(create_app(backends.gateway_settings(redis_server.url))) as client,
    ):
        yield client, tmp, bart


def test_reload_under_load_switches_versions_without_failing_requests(system):
    client, tmp, bart = system
    before = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 2})
    assert before.status_code == 200
    assert before.json()["model_version"].startswith("bart")
    tiny_checkpoint(tmp / "checkpoints", 1, bart)

    failures, stop = [], threading.Event()

    def load() -> None:
        while not stop.is_set():
            reply = client.post(
                "/answer",
                json={"question": "Who discovered penicillin?", "k": 2, "use_cache": False},
            )
            if reply.status_code != 200:
                failures.append(reply.text)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        reloaded = client.post("/admin/reload-model", json={}, headers=AUTH)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert reloaded.status_code == 200, reloaded.text
    versions = {k: reloaded.json()[k] for k in ("generator", "retriever")}
    assert versions == {"generator": "step-000001", "retriever": "step-000001"}
    assert {r["state"] for r in reloaded.json()["replicas"]} == {"converged"}
    assert failures == []
    after = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 2}).json()
    assert after["model_version"] == "step-000001"
    assert after["retriever_version"] == "step-000001"
    assert after["cached"] is False  # the old model's cached answer is not served


def test_corrupt_checkpoint_is_refused_and_old_model_keeps_serving(system):
    client, tmp, bart = system
    ckpt = tiny_checkpoint(tmp / "checkpoints", 2, bart)
    weights = next((ckpt / "generator").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    version = client.post("/answer", json={"question": "Who wrote Hamlet?"}).json()["model_version"]
    reply = client.post("/admin/reload-model", json={"checkpoint": str(ckpt)}, headers=AUTH)
    assert reply.status_code == 422
    assert "corrupt" in reply.json()["detail"]
    still = client.post("/answer", json={"question": "Who wrote Hamlet?", "use_cache": False})
    assert still.status_code == 200
    assert still.json()["model_version"] == version


def test_reload_needs_the_admin_token(system):
    client, _, _ = system
    assert client.post("/admin/reload-model", json={}).status_code == 401
    missing = client.post("/admin/reload-model", json={"checkpoint": "/nope"}, headers=AUTH)
    assert missing.status_code == 422


def test_an_adapter_checkpoint_reloads_onto_the_configured_base(system):
    from checkpoints_kit import tiny_adapter_checkpoint

    from openbook_trainer.checkpoints import load_checkpoint

    client, tmp, bart = system
    ckpt = tiny_adapter_checkpoint(tmp / "checkpoints", 3, bart)
    assert not (ckpt / "generator").exists()
    reply = client.post("/admin/reload-model", json={"checkpoint": ckpt.name}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["generator"] == "step-000003"
    question = {"question": "Who wrote Hamlet?", "k": 2, "use_cache": False}
    served = client.post("/answer", json=question).json()
    assert served["model_version"] == "step-000003"
    expected = load_checkpoint(ckpt).generator  # base + adapter, merged
    assert served["hypotheses"][0]["log_prob"] == pytest.approx(
        _log_prob(client, expected, question), abs=1e-3
    )

    # an adapter trained on another base model is refused; the served model stays
    other = make_tiny_bart(tmp / "other-bart", seed=7)
    wrong = tiny_adapter_checkpoint(tmp / "checkpoints", 4, bart, trained_on=other)
    refused = client.post("/admin/reload-model", json={"checkpoint": wrong.name}, headers=AUTH)
    assert refused.status_code == 422, refused.text
    assert "trained on base model" in refused.text
    still = client.post("/answer", json=question).json()
    assert still["model_version"] == "step-000003"


def _log_prob(client, generator, question: dict) -> float:
    """log p(y|x) of ``generator``'s answer to ``question`` over the passages the stack used."""
    from openbook.rag import DecodingOptions
    from openbook.types import Passage

    served = client.post("/answer", json=question).json()
    passages = [
        Passage(id=p["id"], title=p["title"], text=p["text"], score=p["score"])
        for p in served["passages"]
    ]
    options = DecodingOptions(max_new_tokens=32)
    return generator.generate(question["question"], passages, options).hypotheses[0].log_prob
