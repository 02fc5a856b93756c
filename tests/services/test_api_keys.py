"""Keys with scopes (issue 43, first slice) through the real gateway (uvicorn), retriever,
generator and Redis: made, listed and revoked over ``/admin/keys`` and ``openbook keys``; a key
with ``ask`` works on ``/answer``, ``/v1`` and ``/mcp``, is refused writes and the admin API; a
revoked key stops at every gateway; a record written into Redis without the server key is no
key; ``OPENBOOK_GATEWAY_REQUIRE_KEYS`` closes everything but health, readiness, metrics and the
page; a key held to indexes gets 404 for any other."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from openbook_cli.app import app as cli_app
from openbook_gateway import api_keys
from openbook_gateway.access import RULES, rule_of
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings
from openbook_testkit.gateway_calls import answer_with_key, bearer, create_key, mcp_rpc
from openbook_testkit.stack import running_backends, serving_gateway

STATIC_KEY = "static-ask-key"


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    redis_server.flush()
    with running_backends(tmp_path_factory.mktemp("keys"), redis_server.url) as running:
        yield running


@pytest.fixture(scope="module")
def open_url(backends, redis_server):
    """A gateway as deployed by default (open), with a static key list (so /v1 and /mcp ask)."""
    settings = backends.gateway_settings(redis_server.url, api_keys=STATIC_KEY)
    with serving_gateway(settings) as url:
        yield url


@pytest.fixture(scope="module")
def closed_url(backends, redis_server):
    settings = backends.gateway_settings(redis_server.url, require_keys=True)
    with serving_gateway(settings) as url:
        yield url


@pytest.fixture(scope="module")
def admin(backends) -> dict[str, str]:
    return {"Authorization": f"Bearer {backends.admin_token}"}


def _all_api_routes(routes) -> list[APIRoute]:
    out: list[APIRoute] = []
    for route in routes:
        if isinstance(route, APIRoute):
            out.append(route)
        router = getattr(route, "original_router", None)
        if router is not None:
            out.extend(_all_api_routes(router.routes))
    return out


def _answer(url: str, key: str | None, **body) -> httpx.Response:
    return answer_with_key(url, key, "Who wrote Hamlet?", **body)


def test_every_route_is_classified():
    """A route the table does not name would need admin (fail closed): name them all."""
    app = create_app(GatewaySettings())
    served = {
        (method, route.path)
        for route in _all_api_routes(app.routes)
        for method in route.methods
        if method != "HEAD"
    }
    assert served - set(RULES) == set()
    assert rule_of("POST", "/not/a/route").scope == "admin"
    public = {path for (method, path), rule in RULES.items() if rule.scope is None}
    assert public == {"/", "/static/{name}", "/healthz", "/readyz", "/metrics"}


def test_keys_are_made_listed_and_never_shown_again(open_url, admin):
    key = create_key(open_url, admin, "lister", ["write", "ask", "ask"], indexes=["facts-b"])
    listed = httpx.get(f"{open_url}/admin/keys", headers=admin)
    assert listed.status_code == 200
    assert key not in listed.text and key.split(".", 1)[1] not in listed.text
    (entry,) = [k for k in listed.json()["keys"] if k["name"] == "lister"]
    assert entry["scopes"] == ["ask", "write"] and entry["indexes"] == ["facts-b"]
    assert entry["created"] > 0 and entry["last_used"] is None
    assert _answer(open_url, key, index="facts-b").status_code == 200
    used = httpx.get(f"{open_url}/admin/keys", headers=admin).json()["keys"]
    assert [k["last_used"] for k in used if k["name"] == "lister"][0] is not None
    # the name is taken; bad requests name the field
    again = httpx.post(
        f"{open_url}/admin/keys", json={"name": "lister", "scopes": ["ask"]}, headers=admin
    )
    assert again.status_code == 409
    for body, field in (
        ({"name": "Bad Name", "scopes": ["ask"]}, "name"),
        ({"name": "x", "scopes": []}, "scopes"),
        ({"name": "x", "scopes": ["root"]}, "scopes"),
        ({"name": "x", "scopes": ["admin"], "indexes": ["facts-a"]}, "indexes"),
    ):
        reply = httpx.post(f"{open_url}/admin/keys", json=body, headers=admin)
        assert reply.status_code == 422, body
        assert field in reply.text
    assert httpx.delete(f"{open_url}/admin/keys/lister", headers=admin).json() == {"name": "lister"}
    assert httpx.delete(f"{open_url}/admin/keys/lister", headers=admin).status_code == 404


def test_an_ask_key_asks_everywhere_and_nothing_more(closed_url, open_url, admin):
    key = create_key(closed_url, admin, "asker", ["ask"])
    reply = _answer(closed_url, key)
    assert reply.status_code == 200, reply.text
    chat = httpx.post(
        f"{open_url}/v1/chat/completions",
        json={
            "model": "openbook",
            "messages": [{"role": "user", "content": "Who wrote Hamlet?"}],
            "max_tokens": 2,
        },
        headers=bearer(key),
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    for url in (closed_url, open_url):
        called = mcp_rpc(
            url, key, "tools/call", name="search", arguments={"query": "Hamlet", "k": 2}
        )
        assert called.status_code == 200, called.text
        assert called.json()["result"].get("isError") is not True
        write = mcp_rpc(
            url,
            key,
            "tools/call",
            name="put_document",
            arguments={"index": "facts-b", "doc_id": "x", "text": "Some text."},
        )
        assert write.json()["result"]["isError"] is True
        assert "'write' scope" in write.json()["result"]["content"][0]["text"]
    # writes and the admin API: 403 with the key, 401 with none
    document = {"title": "T", "text": "Some words here."}
    put = f"{closed_url}/indexes/facts-b/documents/new-doc"
    assert httpx.put(put, json=document, headers=bearer(key)).status_code == 403
    assert httpx.put(put, json=document).status_code == 401
    for path in ("/admin/replicas", "/admin/keys"):
        assert httpx.get(f"{closed_url}{path}", headers=bearer(key)).status_code == 403
        assert httpx.get(f"{closed_url}{path}").status_code == 401
    # the static list's keys are ask keys
    assert _answer(closed_url, STATIC_KEY).status_code == 401  # not this gateway's list
    assert httpx.get(f"{open_url}/admin/keys", headers=bearer(STATIC_KEY)).status_code == 403
    writer = create_key(closed_url, admin, "writer", ["write"], indexes=["facts-b"])
    written = httpx.put(put, json=document, headers=bearer(writer), timeout=60)
    assert written.status_code == 200, written.text
    other = f"{closed_url}/indexes/facts-a/documents/new-doc"
    assert httpx.put(other, json=document, headers=bearer(writer)).status_code == 404


def test_a_revoked_key_stops_at_every_gateway(closed_url, open_url, admin):
    key = create_key(open_url, admin, "short-lived", ["ask"])
    chat = {
        "model": "openbook",
        "messages": [{"role": "user", "content": "Hamlet?"}],
        "max_tokens": 2,
    }
    assert _answer(closed_url, key).status_code == 200
    assert httpx.delete(f"{closed_url}/admin/keys/short-lived", headers=admin).status_code == 200
    assert _answer(closed_url, key).status_code == 401
    refused = httpx.post(f"{open_url}/v1/chat/completions", json=chat, headers=bearer(key))
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert mcp_rpc(open_url, key, "ping").status_code == 401


def test_a_forged_record_is_no_key(closed_url, admin, redis_server):
    secret = "obk_forged.chosen-by-the-forger"
    salt = "00" * 16
    record = {
        "name": "forged",
        "scopes": ["admin"],
        "indexes": None,
        "created": 1.0,
        "salt": salt,
        "digest": hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest(),
    }
    client = redis_server.client()
    for raw in (json.dumps(record), json.dumps({"v": json.dumps(record), "mac": "0" * 64})):
        client.set("openbook:api-key:forged", raw)
        assert _answer(closed_url, secret).status_code == 401
        assert httpx.get(f"{closed_url}/admin/keys", headers=bearer(secret)).status_code == 401
        listed = httpx.get(f"{closed_url}/admin/keys", headers=admin).json()["keys"]
        assert "forged" not in [k["name"] for k in listed]
    # a genuine record moved under another name is no key either
    genuine = create_key(closed_url, admin, "genuine", ["ask"])
    client.set("openbook:api-key:forged", client.get("openbook:api-key:genuine"))
    assert _answer(closed_url, "obk_forged." + genuine.split(".", 1)[1]).status_code == 401
    client.delete("openbook:api-key:forged")


def test_require_keys_closes_all_but_health_metrics_and_the_page(closed_url, open_url):
    assert _answer(closed_url, None).status_code == 401
    assert _answer(closed_url, "obk_nobody.x").status_code == 401
    assert httpx.get(f"{closed_url}/indexes").status_code == 401
    assert mcp_rpc(closed_url, None, "ping").status_code == 401
    for path in ("/healthz", "/readyz", "/metrics", "/", "/static/app.js"):
        assert httpx.get(f"{closed_url}{path}").status_code == 200, path
    assert httpx.get(f"{closed_url}/openapi.json").status_code == 404
    # the default stays open
    assert _answer(open_url, None).status_code == 200
    assert httpx.get(f"{open_url}/indexes").status_code == 200


def test_a_timing_probe_learns_nothing(closed_url, admin):
    # a name with no record and a real name with a wrong secret: the same refusal, word for
    # word, after the same work (access.identify hashes against a dummy salt when the name has
    # no record, so the time taken does not tell the names that exist either)
    create_key(closed_url, admin, "probed", ["ask"])
    replies = [_answer(closed_url, f"obk_{name}.wrong-secret") for name in ("probed", "nobody")]
    assert [r.status_code for r in replies] == [401, 401]
    assert replies[0].text == replies[1].text
    assert replies[0].headers.get("www-authenticate") == replies[1].headers.get("www-authenticate")
    presented = api_keys.parse("obk_nobody.wrong-secret")
    assert presented is not None and api_keys.matches(None, presented) is False


def test_a_key_held_to_indexes_sees_no_other(closed_url, admin):
    key = create_key(closed_url, admin, "tenant-b", ["ask"], indexes=["facts-b"])
    other = _answer(closed_url, key, index="facts-a")
    assert other.status_code == 404 and "facts-a" in other.text
    own = _answer(closed_url, key)
    assert own.status_code == 200 and own.json()["index"] == "facts-b"
    listed = httpx.get(f"{closed_url}/indexes", headers=bearer(key)).json()
    assert [i["name"] for i in listed["indexes"]] == ["facts-b"] and listed["active"] == "facts-b"
    models = httpx.get(f"{closed_url}/v1/models", headers=bearer(key)).json()
    assert [m["id"] for m in models["data"]] == ["openbook", "openbook/facts-b"]
    model = httpx.get(f"{closed_url}/v1/models/openbook/facts-a", headers=bearer(key))
    assert model.status_code == 404
    docs = httpx.get(f"{closed_url}/indexes/facts-a/documents", headers=bearer(key))
    assert docs.status_code == 404
    search = mcp_rpc(
        closed_url,
        key,
        "tools/call",
        name="search",
        arguments={"query": "Hamlet", "index": "facts-a"},
    )
    assert search.json()["result"]["isError"] is True
    assert "unknown index 'facts-a'" in search.json()["result"]["content"][0]["text"]


def test_keys_cannot_be_checked_without_redis():
    # backends and Redis nowhere: a managed key is refused (503), never let in
    settings = GatewaySettings(
        require_keys=True,
        admin_token="t",
        retriever_addr="127.0.0.1:9",
        generator_addr="127.0.0.1:9",
        redis_url="redis://127.0.0.1:9/0",
    )
    with TestClient(create_app(settings)) as client:
        reply = client.post("/answer", json={"question": "q"}, headers=bearer("obk_someone.secret"))
        assert reply.status_code == 503
        assert client.post("/answer", json={"question": "q"}).status_code == 401


def test_the_cli_makes_lists_and_revokes_keys(open_url, backends):
    runner = CliRunner()
    env = {"OPENBOOK_URL": open_url, "OPENBOOK_ADMIN_TOKEN": backends.admin_token}
    made = runner.invoke(
        cli_app, ["keys", "create", "from-cli", "--scope", "ask", "--index", "facts-a"], env=env
    )
    assert made.exit_code == 0, made.output
    key = json.loads(made.output)["key"]
    assert _answer(open_url, key, index="facts-b").status_code == 404
    listed = runner.invoke(cli_app, ["keys", "ls"], env=env)
    assert listed.exit_code == 0 and key not in listed.output
    entry = [k for k in json.loads(listed.output)["keys"] if k["name"] == "from-cli"]
    assert entry[0]["indexes"] == ["facts-a"]
    removed = runner.invoke(cli_app, ["keys", "rm", "from-cli"], env=env)
    assert removed.exit_code == 0, removed.output
    again = runner.invoke(cli_app, ["keys", "rm", "from-cli"], env=env)
    assert again.exit_code == 1 and "404" in again.output
    refused = runner.invoke(cli_app, ["keys", "ls"], env={"OPENBOOK_URL": open_url})
    assert refused.exit_code == 1 and "401" in refused.output
