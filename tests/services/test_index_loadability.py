"""``/indexes`` says which indexes can be loaded and why not, without loading any (issue 29).

The index root holds the two fact indexes and copies of ``facts-b`` broken in the ways a disk,
a copy or a person breaks them: a file missing, a manifest that is not JSON, one with a wrong
type, a file cut short, a file corrupted at its recorded size (found only by the checksums of
a load), and a directory whose name is no index name. Through the real retriever and the
gateway: every one is listed, loadable or not with the reason; listing loads nothing; a load
that fails is remembered until the files change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_gateway.app import create_app
from openbook_gateway.mapping import indexes_response
from openbook_gateway.retrieval import merge_listings
from openbook_testkit.stack import build_fact_indexes, running_backends

TOKEN = "loadability-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = (("authorization", f"Bearer {TOKEN}"),)
CORRUPT_BYTE = "c-corrupt-byte"  # a file changed at its recorded size: passes the cheap check


def _broken(root: Path) -> dict[str, str]:
    """Broken copies of facts-b under ``root``; returns name -> what /indexes must say."""
    good = root / "facts-b"

    def copy(name: str) -> Path:
        shutil.copytree(good, root / name)
        return root / name

    (copy("c-no-vectors") / "vectors.npy").unlink()
    (copy("c-bad-json") / "manifest.json").write_text('{"name": "facts-b", "count": ')
    manifest = copy("c-bad-count") / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "count": "many"}))
    cut = copy("c-cut-short") / "passages.sqlite"
    cut.write_bytes(cut.read_bytes()[:1000])
    flipped = copy(CORRUPT_BYTE) / "vectors.npy"
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    copy("bad name")
    # Not indexes, so not listed: a hidden (partial) build, a directory without a manifest.
    copy(".facts-c.partial")
    (root / "lost+found").mkdir()
    return {
        "c-no-vectors": "vectors.npy missing",
        "c-bad-json": "not valid JSON",
        "c-bad-count": "count must be a whole number >= 0, got 'many'",
        "c-cut-short": "passages.sqlite size 1000 != ",
        "bad name": "index must be an index name",
    }


@pytest.fixture(scope="module")
def system(tmp_path_factory, redis_server):
    redis_server.flush()  # no active index left behind by another module
    work = tmp_path_factory.mktemp("loadability")
    build_fact_indexes(work / "indexes")
    problems = _broken(work / "indexes")
    with (
        running_backends(work, redis_server.url, admin_token=TOKEN) as backends,
        TestClient(create_app(backends.gateway_settings(redis_server.url))) as client,
        grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel,
    ):
        yield client, retriever_pb2_grpc.RetrieverStub(channel), work / "indexes", problems


def _listed(client) -> dict[str, dict]:
    reply = client.get("/indexes")
    assert reply.status_code == 200, reply.text
    return {index["name"]: index for index in reply.json()["indexes"]}


def test_every_index_is_listed_loadable_or_with_the_reason(system):
    client, _, _, problems = system
    listed = _listed(client)
    assert set(listed) == {"facts-a", "facts-b", CORRUPT_BYTE, *problems}
    for name, says in problems.items():
        assert listed[name]["loadable"] is False, name
        assert says in listed[name]["problem"], (name, listed[name]["problem"])
        assert listed[name]["loaded"] is False
        assert listed[name]["verified"] is False
    active = listed["facts-a"]
    assert (active["active"], active["loaded"], active["loadable"]) == (True, True, True)
    assert (active["verified"], active["problem"]) == (True, None)
    # Loadable by the cheap check, and nothing loaded to say so.
    for name in ("facts-b", CORRUPT_BYTE):
        assert (listed[name]["loadable"], listed[name]["problem"]) == (True, None), name
        assert (listed[name]["loaded"], listed[name]["verified"]) == (False, False), name
    assert listed["c-bad-count"]["count"] == 0  # an unreadable manifest's fields are unset
    assert listed["c-no-vectors"]["count"] == listed["facts-b"]["count"]


def test_a_refused_swap_names_the_same_problem(system):
    client, _, _, problems = system
    reply = client.post("/admin/swap-index", json={"index": "c-no-vectors"}, headers=AUTH)
    assert reply.status_code == 422, reply.text
    assert problems["c-no-vectors"] in reply.json()["detail"]
    assert _listed(client)["facts-a"]["active"] is True


def test_a_failed_load_is_remembered_until_the_files_change(system):
    client, stub, indexes, _ = system
    with pytest.raises(grpc.RpcError) as err:
        stub.SwapIndex(retriever_pb2.SwapIndexRequest(name=CORRUPT_BYTE), metadata=GRPC_AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vectors.npy checksum mismatch" in err.value.details()
    listed = _listed(client)[CORRUPT_BYTE]
    assert listed["loadable"] is False
    assert "vectors.npy checksum mismatch" in listed["problem"]
    # Repaired (the file replaced by a good copy): loadable again, and then it loads.
    shutil.copy(indexes / "facts-b" / "vectors.npy", indexes / CORRUPT_BYTE / "vectors.npy")
    listed = _listed(client)[CORRUPT_BYTE]
    assert (listed["loadable"], listed["problem"], listed["verified"]) == (True, None, False)
    try:
        reply = client.post("/admin/swap-index", json={"index": CORRUPT_BYTE}, headers=AUTH)
        assert reply.status_code == 200, reply.text
        listed = _listed(client)[CORRUPT_BYTE]
        assert (listed["loaded"], listed["loadable"], listed["verified"]) == (True, True, True)
    finally:
        client.post("/admin/swap-index", json={"index": "facts-a"}, headers=AUTH)


def test_listing_loads_nothing(system):
    _, stub, _, _ = system
    for _ in range(3):
        listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
    loaded = {i.name for i in listed.indexes if i.loaded}
    assert "facts-b" not in loaded
    assert not loaded & {"c-no-vectors", "c-bad-json", "c-cut-short"}


# ------------------------------------------------------------------ the gateway's side


def test_a_retriever_that_reports_no_problems_lists_indexes_as_loadable():
    # A retriever from before IndexInfo.problem: its indexes stay listed as they were.
    old = retriever_pb2.ListIndexesResponse(
        indexes=[retriever_pb2.IndexInfo(name="wiki", index_type="flat", loaded=True)],
        active="wiki",
    )
    [wiki] = indexes_response(old)["indexes"]
    assert (wiki.loadable, wiki.problem, wiki.verified) == (True, None, False)


def test_shards_merge_into_one_listing_with_every_shards_problem():
    def info(name: str, count: int, problem: str = "", verified: bool = True):
        return retriever_pb2.IndexInfo(
            name=name, count=count, loaded=verified, problem=problem, verified=verified
        )

    replies = [
        retriever_pb2.ListIndexesResponse(
            indexes=[info("wiki", 10), info("news", 3), info("solo", 1)], active="wiki"
        ),
        retriever_pb2.ListIndexesResponse(
            indexes=[info("wiki", 12), info("news", 4, "vectors.npy missing", False)],
            active="wiki",
        ),
    ]
    merged = merge_listings(replies, ["shard 0", "shard 1"])
    listed = {i.name: i for i in merged.indexes}
    assert (listed["wiki"].count, listed["wiki"].problem, listed["wiki"].verified) == (22, "", True)
    assert listed["news"].problem == "shard 1: vectors.npy missing"
    assert (listed["news"].count, listed["news"].verified) == (7, False)
    assert listed["solo"].problem == "shard 1: no such index"
    assert listed["solo"].loaded is False
    assert merged.active == "wiki"


def test_the_openai_model_list_offers_only_loadable_indexes(system):
    client, _, _, problems = system
    reply = client.get("/v1/models")
    assert reply.status_code == 200, reply.text
    offered = {model["id"] for model in reply.json()["data"]}
    assert {"openbook", "openbook/facts-a", "openbook/facts-b"} <= offered
    for name in problems:
        assert f"openbook/{name}" not in offered, name
        asked = client.get(f"/v1/models/openbook/{name}")
        assert asked.status_code == 404, asked.text
