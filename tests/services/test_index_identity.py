"""An index is known by its directory name under the index root, whatever its manifest says.

A copy of an index keeps the manifest of the index it was built as (``name: facts-a``); served
as ``c-good`` it must answer, be listed, be labelled, be cached and be counted as ``c-good``,
and never share cached answers with the original.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from openbook.index.shard import split_index
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_gateway.app import create_app
from openbook_gateway.retrieval import Retrieval
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.server import build as build_retriever
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import backends_serving, build_fact_indexes

TOKEN = "identity-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = (("authorization", f"Bearer {TOKEN}"),)
COPY = "c-good"  # a plain copy of facts-a: manifest name "facts-a"
RENAMED = "c-renamed"  # facts-b's passages under a manifest that claims to be "facts-a"
QUESTION = {"question": "Who wrote Hamlet?", "k": 2}


@dataclass
class System:
    client: TestClient
    stub: retriever_pb2_grpc.RetrieverStub
    retriever_metrics: object
    indexes: Path


def _retriever_settings(
    tmp: Path, index_root: Path, redis_url: str, default: str
) -> RetrieverSettings:
    return RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=index_root,
        default_index=default,
        redis_url=redis_url,
        admin_token=TOKEN,
        checkpoint_dir=tmp / "checkpoints",  # empty: no trained checkpoint of the repo
    )


@pytest.fixture(scope="module")
def system(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("identity")
    indexes = tmp / "indexes"
    build_fact_indexes(indexes)
    shutil.copytree(indexes / "facts-a", indexes / COPY)
    shutil.copytree(indexes / "facts-b", indexes / RENAMED)
    manifest = indexes / RENAMED / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "name": "facts-a"}))

    retriever = _retriever_settings(tmp, indexes, redis_server.url, "facts-a")
    generator = GeneratorSettings(
        host="127.0.0.1",
        port=0,
        model=make_tiny_bart(tmp / "bart"),
        redis_url=redis_server.url,
        admin_token=TOKEN,
        checkpoint_dir=tmp / "checkpoints",
    )
    with (
        backends_serving(retriever, generator) as backends,
        TestClient(create_app(backends.gateway_settings(redis_server.url))) as client,
        grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel,
    ):
        yield System(
            client, retriever_pb2_grpc.RetrieverStub(channel), backends.retriever_metrics, indexes
        )


@pytest.fixture
def client(system, redis_url):  # redis_url: every test starts with an empty answer cache
    yield system.client
    system.client.post("/admin/swap-index", json={"index": "facts-a"}, headers=AUTH)


def test_a_copy_is_answered_labelled_and_cached_under_its_directory_name(system, client):
    swapped = client.post("/admin/swap-index", json={"index": COPY}, headers=AUTH)
    assert swapped.status_code == 200, swapped.text
    assert swapped.json() == {"previous": "facts-a", "active": COPY}

    first = client.post("/answer", json=QUESTION).json()
    assert (first["index"], first["cached"]) == (COPY, False)
    metrics = client.get("/metrics").text
    assert f'openbook_active_index_info{{index="{COPY}"}} 1.0' in metrics
    again = client.post("/answer", json=QUESTION).json()
    assert (again["index"], again["cached"]) == (COPY, True)

    # The original, asked for by name while the copy is active: computed on the original,
    # never the copy's cached answer; then cached under its own name.
    original = client.post("/answer", json={**QUESTION, "index": "facts-a"}).json()
    assert (original["index"], original["cached"]) == ("facts-a", False)
    original = client.post("/answer", json={**QUESTION, "index": "facts-a"}).json()
    assert (original["index"], original["cached"]) == ("facts-a", True)
    assert client.get("/indexes").json()["active"] == COPY


def test_cached_answers_never_cross_between_indexes_sharing_a_manifest_name(client):
    # c-renamed holds facts-b's passages but its manifest says "facts-a": answers computed on
    # it must not be served to a request for facts-a, nor the other way round.
    renamed = client.post("/answer", json={**QUESTION, "index": RENAMED}).json()
    original = client.post("/answer", json={**QUESTION, "index": "facts-a"}).json()
    assert (original["cached"], original["passages"][0]["id"]) == (False, "p21")
    assert original["index"] == "facts-a"
    assert (renamed["index"], renamed["passages"][0]["id"]) == (RENAMED, "b-p21")
    renamed = client.post("/answer", json={**QUESTION, "index": RENAMED}).json()
    assert (renamed["cached"], renamed["passages"][0]["id"]) == (True, "b-p21")


def test_retriever_replies_name_the_directory(system, client):
    stub = system.stub
    names = {i.name for i in stub.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes}
    assert {"facts-a", COPY, RENAMED} <= names
    swapped = stub.SwapIndex(retriever_pb2.SwapIndexRequest(name=COPY), metadata=GRPC_AUTH)
    assert (swapped.previous, swapped.active, swapped.info.name) == ("facts-a", COPY, COPY)
    listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
    assert listed.active == COPY
    assert [i.name for i in listed.indexes if i.active] == [COPY]
    request = retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=1)
    assert stub.Retrieve(request).index == COPY
    request.index = RENAMED
    assert stub.Retrieve(request).index == RENAMED
    text = generate_latest(system.retriever_metrics.registry).decode()
    assert f'openbook_serving_info{{kind="index",name="{COPY}",service="retriever"}} 1.0' in text


def test_errors_name_the_directory_not_the_manifest(system, client):
    broken = system.indexes / "c-broken"
    shutil.copytree(system.indexes / "facts-b", broken)
    try:
        store = next(p for p in broken.iterdir() if p.suffix == ".sqlite")
        with open(store, "r+b") as f:
            f.seek(200)
            f.write(b"corrupted!")
        reply = client.post("/admin/swap-index", json={"index": "c-broken"}, headers=AUTH)
        assert reply.status_code == 422
        assert "'c-broken'" in reply.json()["detail"]
        assert "facts-b" not in reply.json()["detail"]
    finally:
        shutil.rmtree(broken)


def test_shards_of_a_copy_merge_under_its_directory_name(system, tmp_path, redis_server):
    """Shards are written under the source's directory name, and the gateway re-asks a lagging
    shard for shard 0's label: that label must be the directory name each shard serves."""
    shards = tmp_path / "shards"
    split_index(system.indexes / COPY, 2, shards, progress=False)
    split_index(system.indexes / "facts-b", 2, tmp_path / "shards-b", progress=False)
    for i in range(2):
        (tmp_path / "shards-b" / f"shard-{i}" / "facts-b").rename(shards / f"shard-{i}" / "facts-b")
    assert json.loads((shards / "shard-0" / COPY / "manifest.json").read_text())["name"] == (
        "facts-a"
    )
    unsharded = system.stub.Retrieve(
        retriever_pb2.RetrieveRequest(queries=["Who wrote Hamlet?"], k=3, index=COPY)
    )
    expected = [p.id for p in unsharded.results[0].passages]

    services, stops = [], []
    try:
        for i in range(2):
            # Each shard follows its own Redis database, so one can lag behind the other.
            url = redis_server.url_for(i + 1)
            redis_server.flush(i + 1)
            settings = _retriever_settings(tmp_path, shards / f"shard-{i}", url, COPY)
            service, _, stop = build_retriever(settings)
            service.set_serving(True)
            service.start()
            services.append(service)
            stops.append(stop)
        addrs = ",".join(f"127.0.0.1:{s.port}" for s in services)

        async def ask() -> retriever_pb2.RetrieveResponse:
            retrieval = Retrieval(addrs, 10.0, 2.0)
            try:
                return await retrieval.retrieve("Who wrote Hamlet?", 3, None, "identity-test")
            finally:
                await retrieval.close()

        merged = asyncio.run(ask())
        assert merged.index == COPY
        assert [p.id for p in merged.results[0].passages] == expected

        # Shard 1 swapped ahead: the gateway asks it for shard 0's index by that label.
        with grpc.insecure_channel(f"127.0.0.1:{services[1].port}") as channel:
            retriever_pb2_grpc.RetrieverStub(channel).SwapIndex(
                retriever_pb2.SwapIndexRequest(name="facts-b"), metadata=GRPC_AUTH
            )
        merged = asyncio.run(ask())
        assert merged.index == COPY
        assert [p.id for p in merged.results[0].passages] == expected
    finally:
        for stop in stops:
            stop.set()
        for service in services:
            service.stop(0)
