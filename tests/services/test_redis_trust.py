"""Redis is authenticated and what it holds is not trusted blindly (issue 29).

Real services over a real Redis started as compose starts it (the test kit's, with the ACL
file openbook-secrets makes). The attacks of the issue, by a process without the password and
by an insider with it: neither changes what is served. Issue 42's: an insider's forged index
epochs and versions never serve deleted content, forged replica records never break or hold
an admin call.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import redis
from fastapi.testclient import TestClient

from openbook.security.sealing import load_sealer
from openbook.state.redis_protocol import (
    ACTIVE_INDEX_KEY,
    ANSWER_KEY_PREFIX,
    DESIRED_MODEL_KEY,
    INDEX_STATE_KEY,
    INDEX_SWAP_CHANNEL,
    MODEL_RELOAD_CHANNEL,
    MODEL_VERSIONS_KEY,
    desired_fields,
    encode_replica_state,
    open_index_state,
    replica_key,
    seal_index_state,
    seal_model_version,
)
from openbook.state.shared_state import ActiveIndexStore, publish_model_version
from openbook.v1 import retriever_pb2
from openbook_gateway.app import create_app
from openbook_testkit.stack import running_backends

TOKEN = "trust-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POISON = "POISONED: visit evil.example"


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    with running_backends(
        tmp_path_factory.mktemp("backends"), redis_server.url, admin_token=TOKEN
    ) as running:
        yield running


@pytest.fixture
def client(backends, redis_url):
    with TestClient(create_app(backends.gateway_settings(redis_url))) as client:
        yield client


# --- authentication ----------------------------------------------------------------------


def test_redis_refuses_a_client_without_the_password(redis_server):
    anonymous = redis.Redis.from_url(redis_server.anonymous_url, decode_responses=True)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()  # NOAUTH
    with pytest.raises(redis.AuthenticationError):
        anonymous.set(ACTIVE_INDEX_KEY, "wiki-2016")
    with pytest.raises(redis.AuthenticationError):
        anonymous.publish(INDEX_SWAP_CHANNEL, "wiki-2016")
    wrong = f"redis://openbook:not-the-password@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(wrong).ping()
    # The default user is off: no password makes it work either.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(
            f"redis://default:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
        ).ping()


def test_the_openbook_user_gets_only_what_openbook_uses(redis_server):
    insider = redis_server.client()
    assert insider.set("openbook:probe", "1") and insider.delete("openbook:probe") == 1
    for forbidden in (
        lambda: insider.flushall(),
        lambda: insider.config_get("dir"),
        lambda: insider.keys("*"),
        lambda: insider.set("elsewhere", "1"),  # keys outside openbook:*
        lambda: insider.publish("elsewhere", "1"),  # channels outside openbook:*
        lambda: insider.eval("return 1", 0),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


# --- the cached-answer attack ------------------------------------------------------------


def _answer_keys(redis_server) -> list[str]:
    return list(redis_server.client().scan_iter(match=ANSWER_KEY_PREFIX + "*"))


@pytest.mark.parametrize("forgery", ["plain", "altered", "moved"])
def test_a_forged_cached_answer_is_a_miss_and_logged(client, redis_server, caplog, forgery):
    question = {"question": "Who wrote Hamlet?", "k": 2}
    first = client.post("/answer", json=question).json()
    assert client.post("/answer", json=question).json()["cached"] is True
    insider = redis_server.client()
    (key,) = _answer_keys(redis_server)
    genuine = insider.get(key)
    poisoned = {**first, "answer": POISON}
    if forgery == "plain":  # the attack: an unsealed value, as the cache used to hold
        insider.set(key, json.dumps(poisoned))
    elif forgery == "altered":  # the payload changed under its genuine MAC
        sealed = json.loads(genuine)
        insider.set(key, json.dumps({**sealed, "v": json.dumps(poisoned)}))
    else:  # a genuine entry of another question moved under this key
        other = {"question": "Who discovered penicillin?", "k": 2}
        client.post("/answer", json=other)
        (other_key,) = set(_answer_keys(redis_server)) - {key}
        insider.set(key, insider.get(other_key))
    with caplog.at_level(logging.WARNING, logger="openbook.security.sealing"):
        again = client.post("/answer", json=question).json()
    assert again["cached"] is False
    assert again["answer"] == first["answer"] != POISON
    assert any(key in r.getMessage() and "ignoring" in r.getMessage() for r in caplog.records)
    # The fresh answer was stored sealed again: the next ask is a genuine hit.
    assert client.post("/answer", json=question).json()["cached"] is True


def test_a_flood_of_forged_reads_logs_a_line_not_one_per_request(client, redis_server, caplog):
    question = {"question": "Who discovered penicillin?", "k": 3}
    client.post("/answer", json=question)
    (key,) = _answer_keys(redis_server)
    insider = redis_server.client()
    with caplog.at_level(logging.WARNING, logger="openbook.security.sealing"):
        for _ in range(20):
            insider.set(key, json.dumps({"answer": POISON}))
            assert client.post("/answer", json=question).json()["answer"] != POISON
    rejected = [r for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(rejected) == 1  # rate-limited: one line a minute, however many forged reads


# --- the active-index attack -------------------------------------------------------------


def test_a_forged_active_index_and_announcement_do_not_switch_the_replica(
    backends, client, redis_server
):
    servicer = backends.retriever_servicer
    assert servicer.registry.active == "facts-a"
    insider = redis_server.client()
    # An insider's SET + PUBLISH (unsealed), then a genuine sealed value of facts-b moved from
    # another key: neither is the deployment's seal of the active index.
    for forged in (
        "facts-b",
        load_sealer(redis_server.secrets.server_key).seal("openbook:other", "facts-b"),
    ):
        insider.set(ACTIVE_INDEX_KEY, forged)
        insider.publish(INDEX_SWAP_CHANNEL, "facts-b")
        servicer.follow_shared_active()  # what the announcement and the 2 s check run
        assert servicer.registry.active == "facts-a"
        # The replica put back what it serves, sealed: gateways agree with it again.
        assert ActiveIndexStore(insider).get() == "facts-a"
        reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 1}).json()
        assert reply["index"] == "facts-a"
        assert reply["passages"][0]["id"] == "p21"


def test_an_index_the_registry_refuses_is_logged_once_and_not_served(
    backends, redis_server, caplog
):
    servicer = backends.retriever_servicer
    store = ActiveIndexStore(redis_server.client())  # sealed with the deployment's key
    try:
        with caplog.at_level(logging.ERROR, logger="openbook_retriever.servicer"):
            for bad in ("wiki-1999", "wiki-1999", "wiki-1999", "../facts-a", "../facts-a"):
                store.set(bad)
                for _ in range(3):  # announcements and periodic checks
                    servicer.follow_shared_active()
                assert servicer.registry.active == "facts-a"
        refused = [r.getMessage() for r in caplog.records if "not following" in r.getMessage()]
        assert len(refused) == 2, refused  # once per distinct bad value
        assert "wiki-1999" in refused[0] and "../facts-a" in refused[1]
    finally:
        store.set("facts-a")
        servicer.follow_shared_active()


# --- index states: epochs and versions (issue 42, item 4) --------------------------------

ZORBLAX = {"title": "Zorblax", "text": "The zorblax ledger is kept in the vault of Quentar."}
OTHER = {"title": "Other", "text": "A different zorblax ledger, kept in Ulmor."}
ZORBLAX_Q = {"question": "Where is the zorblax ledger kept?", "k": 1}


def _ask(client, index: str) -> dict:
    reply = client.post("/answer", json={**ZORBLAX_Q, "index": index})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _index_state(redis_server, index: str):
    raw = redis_server.client().hget(INDEX_STATE_KEY, index)
    return open_index_state(load_sealer(redis_server.secrets.server_key), index, raw)


def _forgeries(redis_server, index: str, genuine: dict) -> list[tuple[str, str]]:
    """What an insider with the password can write for ``index``'s state: the issue's plain
    values, a state sealed for another index (moved), a genuine one with its versions altered."""
    sealer = load_sealer(redis_server.secrets.server_key)
    sealed = json.loads(redis_server.client().hget(INDEX_STATE_KEY, index))
    lowered = {**genuine, "versions": {"": 0}}
    return [
        ("plain", "0"),
        ("plain json", json.dumps(lowered)),
        ("altered", json.dumps({**sealed, "v": json.dumps(lowered)})),
        ("moved", seal_index_state(sealer, "facts-a", lowered)),
    ]


@pytest.mark.parametrize("forgery", range(4))
def test_a_forged_epoch_never_serves_a_deleted_indexs_answer(
    backends, client, redis_server, caplog, forgery
):
    """Delete and recreate an index, then roll its epoch back (the issue's ``HSET
    openbook:index-epochs <index> 0``): the old index's cached answer stays gone."""
    assert client.post("/indexes", json={"name": "trust-x"}, headers=AUTH).status_code == 201
    client.put("/indexes/trust-x/documents/zorblax", json=ZORBLAX, headers=AUTH)
    old = _ask(client, "trust-x")
    assert _ask(client, "trust-x")["cached"] is True
    old_state = _index_state(redis_server, "trust-x")
    assert client.delete("/indexes/trust-x", headers=AUTH).status_code == 200
    assert client.post("/indexes", json={"name": "trust-x"}, headers=AUTH).status_code == 201
    client.put("/indexes/trust-x/documents/other", json=OTHER, headers=AUTH)
    insider = redis_server.client()
    insider.hset("openbook:index-epochs", "trust-x", 0)  # the old key: read by no one now
    name, forged = _forgeries(redis_server, "trust-x", old_state)[forgery]
    insider.hset(INDEX_STATE_KEY, "trust-x", forged)
    try:
        with caplog.at_level(logging.WARNING, logger="openbook.security.sealing"):
            again = _ask(client, "trust-x")
            assert again["cached"] is False, name
            assert again["passages"][0]["id"] == "other#0" != old["passages"][0]["id"]
        assert any("openbook:index-state[trust-x]" in r.getMessage() for r in caplog.records)
        # The retriever makes the state afresh (its first search of the new index, or its
        # watch): a new epoch, caching the new index's answers again, never the old one's.
        backends.retriever_servicer.follow_shared_state()
        state = _index_state(redis_server, "trust-x")
        assert state is not None and state["epoch"] != old_state["epoch"]
        assert _ask(client, "trust-x")["passages"][0]["id"] == "other#0"
        again = _ask(client, "trust-x")
        assert again["cached"] is True and again["passages"][0]["id"] == "other#0"
    finally:
        client.delete("/indexes/trust-x", headers=AUTH)


@pytest.mark.parametrize("forgery", range(4))
def test_a_lowered_version_never_serves_a_deleted_document_after_a_restart(
    backends, client, redis_server, redis_url, forgery
):
    """Delete a document, lower the index's version (the issue's ``ZADD
    openbook:index-versions <index> 2``) or delete its state, restart the gateway: the
    deleted document's passage is not served."""
    assert client.post("/indexes", json={"name": "trust-y"}, headers=AUTH).status_code == 201
    try:
        client.put("/indexes/trust-y/documents/zorblax", json=ZORBLAX, headers=AUTH)
        client.put("/indexes/trust-y/documents/other", json=OTHER, headers=AUTH)
        before = _ask(client, "trust-y")
        assert before["passages"][0]["id"] == "zorblax#0"
        assert _ask(client, "trust-y")["cached"] is True
        state = _index_state(redis_server, "trust-y")
        assert state is not None and state["versions"] == {"": 2}
        assert client.delete("/indexes/trust-y/documents/zorblax", headers=AUTH).status_code == 200
        insider = redis_server.client()
        insider.zadd("openbook:index-versions", {"trust-y": 2})  # the old key: read by no one
        name, forged = _forgeries(redis_server, "trust-y", state)[forgery]
        insider.hset(INDEX_STATE_KEY, "trust-y", forged)
        with TestClient(create_app(backends.gateway_settings(redis_server.url))) as restarted:
            first = _ask(restarted, "trust-y")
            assert first["cached"] is False, name
            # The next may be a hit: the answer just computed, stored once the retriever made
            # the state afresh (its first search of the index does), never the old one.
            for again in (first, _ask(restarted, "trust-y")):
                assert again["passages"][0]["id"] == "other#0", name
            insider.hdel(INDEX_STATE_KEY, "trust-y")  # deleted: made afresh, a new epoch
        with TestClient(create_app(backends.gateway_settings(redis_server.url))) as restarted:
            for _ in range(2):
                assert _ask(restarted, "trust-y")["passages"][0]["id"] == "other#0"
    finally:
        client.delete("/indexes/trust-y", headers=AUTH)


def test_an_index_deleted_behind_the_gateways_back_never_serves_its_answers(
    backends, client, redis_server
):
    """The retriever deletes and creates an index itself (a gateway that lost Redis, or a
    call to the retriever's own API): a new index of the old one's name, at the old one's
    version, must not meet its cached answers. The retriever is the authority on an index's
    life, so it makes the index's state afresh on both."""
    servicer = backends.retriever_servicer
    assert client.post("/indexes", json={"name": "trust-z"}, headers=AUTH).status_code == 201
    try:
        client.put("/indexes/trust-z/documents/zorblax", json=ZORBLAX, headers=AUTH)
        old = _ask(client, "trust-z")
        assert _ask(client, "trust-z")["cached"] is True
        old_state = _index_state(redis_server, "trust-z")
        servicer.DeleteIndex(retriever_pb2.DeleteIndexRequest(name="trust-z"), None)
        created = servicer.CreateIndex(retriever_pb2.CreateIndexRequest(name="trust-z"), None)
        assert created.version == 0
        state = _index_state(redis_server, "trust-z")
        assert state is not None and state["epoch"] != old_state["epoch"]
        client.put("/indexes/trust-z/documents/other", json=OTHER, headers=AUTH)
        with TestClient(create_app(backends.gateway_settings(redis_server.url))) as restarted:
            for asking in (client, restarted):
                again = _ask(asking, "trust-z")
                assert again["index_version"] == old["index_version"] == 1
                assert again["passages"][0]["id"] == "other#0" != old["passages"][0]["id"]
    finally:
        client.delete("/indexes/trust-z", headers=AUTH)


def test_a_replayed_state_of_a_deleted_index_never_serves_its_answers(
    backends, client, redis_server, caplog
):
    """An insider saves the genuine state of an index, which is then deleted and created
    again, and writes the saved state back: sealed with the server key, but older than the
    state it replaces. Neither a running gateway nor a restarted one serves the old index's
    cached answer; the retriever's watch makes the state afresh."""
    assert client.post("/indexes", json={"name": "trust-r"}, headers=AUTH).status_code == 201
    try:
        client.put("/indexes/trust-r/documents/zorblax", json=ZORBLAX, headers=AUTH)
        old = _ask(client, "trust-r")
        assert _ask(client, "trust-r")["cached"] is True
        insider = redis_server.client()
        saved = insider.hget(INDEX_STATE_KEY, "trust-r")
        assert client.delete("/indexes/trust-r", headers=AUTH).status_code == 200
        assert client.post("/indexes", json={"name": "trust-r"}, headers=AUTH).status_code == 201
        client.put("/indexes/trust-r/documents/other", json=OTHER, headers=AUTH)
        assert _ask(client, "trust-r")["passages"][0]["id"] == "other#0"
        insider.hset(INDEX_STATE_KEY, "trust-r", saved)  # genuine, of the deleted index
        with caplog.at_level(logging.WARNING):
            again = _ask(client, "trust-r")
            assert again["passages"][0]["id"] == "other#0" != old["passages"][0]["id"]
            assert again["cached"] is False
            assert any("replayed" in r.getMessage() for r in caplog.records)
            backends.retriever_servicer.follow_shared_state()  # its watch, every 2 s
        state = _index_state(redis_server, "trust-r")
        assert state is not None and insider.hget(INDEX_STATE_KEY, "trust-r") != saved
        with TestClient(create_app(backends.gateway_settings(redis_server.url))) as restarted:
            for _ in range(2):
                assert _ask(restarted, "trust-r")["passages"][0]["id"] == "other#0"
    finally:
        client.delete("/indexes/trust-r", headers=AUTH)


# --- model versions and the desired model (issue 42: sealed all the way) -----------------


def _model_forgeries(redis_server, service: str, version: str, older: str) -> list[str]:
    sealer = load_sealer(redis_server.secrets.server_key)
    genuine = json.loads(redis_server.client().hget(MODEL_VERSIONS_KEY, service))
    payload = json.loads(genuine["v"])
    return [
        version,  # the plain HSET
        json.dumps({**genuine, "v": json.dumps({**payload, "seq": payload["seq"] + 1})}),
        seal_model_version(sealer, "retriever" if service != "retriever" else "x", payload),
        older,  # a genuine record saved before the current one: a replay
    ]


FORGERIES = ("plain", "altered", "moved", "replayed")


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_or_replayed_model_version_is_a_miss(backends, client, redis_server, forgery):
    """An insider's model version, or an older genuine record written back, never keys a
    lookup: the answer is computed afresh (never one another model computed)."""
    insider = redis_server.client()
    sealer = load_sealer(redis_server.secrets.server_key)
    version = backends.generator_servicer.generator.model_version
    publish_model_version(insider, "generator", version, sealer)
    older = insider.hget(MODEL_VERSIONS_KEY, "generator")
    publish_model_version(insider, "generator", version, sealer)  # a later publication
    current = insider.hget(MODEL_VERSIONS_KEY, "generator")
    question = {"question": "Who wrote Hamlet?", "k": 2}
    first = client.post("/answer", json=question).json()
    assert client.post("/answer", json=question).json()["cached"] is True
    forgeries = _model_forgeries(redis_server, "generator", version, older)
    forged = dict(zip(FORGERIES, forgeries, strict=True))
    insider.hset(MODEL_VERSIONS_KEY, "generator", forged[forgery])
    for _ in range(2):
        again = client.post("/answer", json=question).json()
        assert again["cached"] is False, forgery
        assert again["answer"] == first["answer"]
    insider.hset(MODEL_VERSIONS_KEY, "generator", current)  # the genuine record back
    assert client.post("/answer", json=question).json()["cached"] is True


def test_a_forged_desired_model_is_not_followed_and_not_listed(backends, client, redis_server):
    follower = backends.generator_servicer.follower
    follower.sync()
    before = (follower.handled, follower.state)
    insider = redis_server.client()
    insider.delete(DESIRED_MODEL_KEY)
    insider.hset(
        DESIRED_MODEL_KEY,
        mapping={"id": "evil", "checkpoint": "step-000001", "at": "0", "record": "{}"},
    )
    insider.publish(MODEL_RELOAD_CHANNEL, "evil")
    follower.sync()
    assert (follower.handled, follower.state) == before
    reply = client.get("/admin/replicas", headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["desired"] == {}
    insider.delete(DESIRED_MODEL_KEY)


def _await_replicas(client) -> None:
    deadline = time.monotonic() + 30
    while not client.get("/admin/replicas", headers=AUTH).json()["replicas"]:
        assert time.monotonic() < deadline, "no replica came back"
        time.sleep(0.2)


def test_a_replayed_desired_model_is_not_followed_again(backends, client, redis_server):
    """A genuine reload request saved and written back after a newer one: no replica goes
    back to it (a rollback to an older checkpoint by an insider)."""
    follower = backends.generator_servicer.follower
    insider = redis_server.client()
    sealer = load_sealer(redis_server.secrets.server_key)
    _await_replicas(client)  # the client fixture flushed Redis: back at their heartbeat
    # No checkpoint in the root: each request is refused at once, which is all this needs.
    client.post("/admin/reload-model", json={}, headers=AUTH)
    saved = insider.hgetall(DESIRED_MODEL_KEY)
    first = desired_fields(sealer, saved)["id"]
    client.post("/admin/reload-model", json={}, headers=AUTH)
    follower.sync()
    second = desired_fields(sealer, insider.hgetall(DESIRED_MODEL_KEY))["id"]
    assert second != first and follower.handled == second
    insider.delete(DESIRED_MODEL_KEY)
    insider.hset(DESIRED_MODEL_KEY, mapping=saved)
    follower.sync()
    assert follower.handled == second
    insider.delete(DESIRED_MODEL_KEY)


# --- replica records (issue 42, item 5) --------------------------------------------------


def _fake_replicas(redis_server) -> dict[str, str]:
    """An insider's replica records: wrong types, a fake one stuck loading (plain, and with a
    genuine seal moved from another key)."""
    sealer = load_sealer(redis_server.secrets.server_key)
    loading = {
        "service": "generator",
        "replica": "fake-loading",
        "version": "v9",
        "state": "loading",
        "request": "",
        "checkpoint": "",
        "error": "",
        "updated": time.time(),
    }
    moved_key = replica_key("generator", "fake-moved")
    return {
        replica_key("retriever", "fake-types"): json.dumps(
            {"service": 1, "replica": ["x"], "version": None, "state": {}, "updated": "now"}
        ),
        replica_key("generator", "fake-loading"): json.dumps(loading),
        moved_key: encode_replica_state(
            sealer, replica_key("generator", "elsewhere"), {**loading, "replica": "fake-moved"}
        ),
        replica_key("generator", "fake-garbage"): "not json at all",
    }


def test_forged_replica_records_are_not_listed_and_do_not_break_the_listing(
    client, redis_server, caplog
):
    insider = redis_server.client()
    for key, value in _fake_replicas(redis_server).items():
        insider.set(key, value, ex=600)
    with caplog.at_level(logging.WARNING, logger="openbook.security.sealing"):
        # the client fixture flushed Redis: the genuine replicas are back at their next
        # heartbeat, the forged records stay out of every listing meanwhile
        deadline = time.monotonic() + 30
        while True:
            reply = client.get("/admin/replicas", headers=AUTH)
            assert reply.status_code == 200, reply.text
            listed = {r["replica"] for r in reply.json()["replicas"]}
            assert not any(name.startswith("fake") for name in listed), listed
            if listed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert listed  # the genuine replicas are listed beside the forgeries
        ready = client.get("/readyz").json()
        assert not any(r["replica"].startswith("fake") for r in ready.get("replicas", []))
    assert any("openbook:replica:" in r.getMessage() for r in caplog.records)


def test_a_fake_loading_replica_does_not_hold_a_reload(client, redis_server):
    insider = redis_server.client()
    for key, value in _fake_replicas(redis_server).items():
        insider.set(key, value, ex=600)
    # No checkpoint in the root: every genuine replica refuses at once. A fake replica counted
    # as loading would hold the call until reload_wait_s, then report it as loading.
    reply = client.post("/admin/reload-model", json={}, headers=AUTH)
    assert reply.status_code in (200, 409, 422), reply.text
    body = reply.json()
    assert not any(r["replica"].startswith("fake") for r in body.get("replicas", [])), body
    assert all(r["state"] != "loading" for r in body.get("replicas", [])), body
