"""Redis is authenticated and what it holds is not trusted blindly (issue 29).

Real services over a real Redis started as compose starts it (the test kit's, with the ACL
file openbook-secrets makes). The attacks of the issue, by a process without the password and
by an insider with it: neither changes what is served.
"""

from __future__ import annotations

import json
import logging

import pytest
import redis
from fastapi.testclient import TestClient

from openbook.redis_protocol import ACTIVE_INDEX_KEY, ANSWER_KEY_PREFIX, INDEX_SWAP_CHANNEL
from openbook.sealing import load_sealer
from openbook.shared_state import ActiveIndexStore
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
    with caplog.at_level(logging.WARNING, logger="openbook.sealing"):
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
    with caplog.at_level(logging.WARNING, logger="openbook.sealing"):
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
