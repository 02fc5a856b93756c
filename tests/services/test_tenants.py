"""Tenants, limits per key and the audit log (issue 43) through the real gateway (uvicorn),
retriever, generator and Redis: two tenants' keys on one live index never see each other's
documents, whatever a request sends (a filter, an ``$or`` with the tenant's field, another
index), on every route that retrieves or reads documents, nor through the answer cache;
documents they write carry their tenant; a key's rate is counted in Redis and answered with a
429 and a truthful ``Retry-After``; every write is audited under the key's name, and requests
are counted under it."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from typer.testing import CliRunner

from openbook.validation.metadata_filter import parse_filter
from openbook_cli.app import app as cli_app
from openbook_gateway.principal import namespace
from openbook_testkit.gateway_calls import answer_with_key, bearer, create_key, mcp_tool
from openbook_testkit.stack import running_backends, serving_gateway
from openbook_testkit.throttle import Throttle, throttled

INDEX = "tenants"
A_DOC = {"title": "Alpha plan", "text": "The alpha launch code is ORCHID. It opens the vault."}
B_DOC = {"title": "Beta plan", "text": "The beta launch code is TULIP. It opens the vault."}
QUESTION = "What is the launch code that opens the vault?"


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    redis_server.flush()
    with running_backends(tmp_path_factory.mktemp("tenants"), redis_server.url) as running:
        yield running


@pytest.fixture(scope="module")
def url(backends, redis_server):
    settings = backends.gateway_settings(redis_server.url, require_keys=True)
    with serving_gateway(settings) as served:
        yield served


@pytest.fixture(scope="module")
def admin(backends) -> dict[str, str]:
    return {"Authorization": f"Bearer {backends.admin_token}"}


@pytest.fixture(scope="module")
def tenants(url, admin) -> dict[str, str]:
    """An index two tenants write to, each with its document, and their keys."""
    made = httpx.post(
        f"{url}/indexes", json={"name": INDEX, "like": "facts-b"}, headers=admin, timeout=60
    )
    assert made.status_code == 201, made.text
    keys = {
        tenant: create_key(
            url,
            admin,
            f"tenant-{tenant}",
            ["ask", "write"],
            indexes=[INDEX],
            filter={"tenant": tenant},
        )
        for tenant in ("a", "b")
    }
    for tenant, doc_id, document in (("a", "a-doc", A_DOC), ("b", "b-doc", B_DOC)):
        written = httpx.put(
            f"{url}/indexes/{INDEX}/documents/{doc_id}",
            json={**document, "metadata": {"lang": "en"}},
            headers=bearer(keys[tenant]),
            timeout=60,
        )
        assert written.status_code == 200, written.text
    return keys


def _answer(url: str, key: str, **body) -> httpx.Response:
    return answer_with_key(url, key, body.pop("question", QUESTION), **body)


def _stored(tenant: str, doc_id: str) -> str:
    """The id the index holds for ``doc_id`` written by tenant ``tenant``'s keys (their
    namespace: what the admin sees)."""
    tenant_filter = parse_filter({"tenant": tenant})
    assert tenant_filter is not None
    return namespace(tenant_filter) + doc_id


def _never_b(text: str) -> None:
    for trace in ("TULIP", "b-doc", "Beta plan", "beta launch"):
        assert trace not in text


def test_written_documents_carry_their_tenant(url, admin, tenants):
    stored = httpx.get(f"{url}/indexes/{INDEX}/documents/{_stored('a', 'a-doc')}", headers=admin)
    assert stored.json()["metadata"] == {"lang": "en", "tenant": "a"}
    a = bearer(tenants["a"])
    base = f"{url}/indexes/{INDEX}/documents"
    # metadata naming another tenant: 403 naming the field, nothing written
    other = httpx.put(
        f"{base}/a-2", json={**A_DOC, "metadata": {"tenant": "b"}}, headers=a, timeout=60
    )
    assert other.status_code == 403 and "metadata.tenant" in other.text
    batch = httpx.post(
        f"{base}:batch",
        json={
            "documents": [
                {"id": "a-3", **A_DOC},
                {"id": "a-4", **A_DOC, "metadata": {"tenant": "b"}},
            ]
        },
        headers=a,
        timeout=60,
    )
    assert batch.status_code == 403 and "documents[1].metadata.tenant" in batch.text
    assert httpx.get(f"{base}/{_stored('a', 'a-3')}", headers=admin).status_code == 404
    # another tenant's id: neither read nor deleted (404, as an id nobody holds)
    for method in ("GET", "DELETE"):
        refused = httpx.request(method, f"{base}/b-doc", headers=a, timeout=60)
        assert refused.status_code == 404, method
        _never_b(refused.text.replace("'b-doc'", ""))
    assert httpx.get(f"{base}/b-doc", headers=bearer(tenants["b"])).json()["text"] == B_DOC["text"]
    # an upload is stamped too, and refused with another tenant's metadata
    upload = f"{url}/indexes/{INDEX}/documents"
    files = {"file": ("alpha.txt", b"Alpha notes: the code is ORCHID.", "text/plain")}
    refused = httpx.post(
        upload, files=files, data={"metadata": '{"tenant": "b"}'}, headers=a, timeout=60
    )
    assert refused.status_code == 403 and "metadata.tenant" in refused.text
    uploaded = httpx.post(upload, files=files, data={"id": "a-upload"}, headers=a, timeout=60)
    assert uploaded.status_code == 200, uploaded.text
    stored = httpx.get(f"{base}/a-upload", headers=a).json()
    assert stored["metadata"]["tenant"] == "a"
    # a listing shows only the tenant's ids
    listed = httpx.get(base, headers=a, params={"limit": 1}).json()
    ids = list(listed["ids"])
    while listed["next_cursor"]:
        listed = httpx.get(
            base, headers=a, params={"limit": 1, "cursor": listed["next_cursor"]}
        ).json()
        ids += listed["ids"]
    assert ids == ["a-doc", "a-upload"]
    everyone = httpx.get(base, headers=admin, params={"limit": 1000}).json()["ids"]
    assert {_stored("a", "a-doc"), _stored("a", "a-upload"), _stored("b", "b-doc")} <= set(everyone)


def test_tenants_ids_never_cross(url, admin, tenants):
    # A and B both write "report": two documents, each tenant's own; nothing A does with the
    # id tells it B holds it, and nothing reaches B's
    a, b = bearer(tenants["a"]), bearer(tenants["b"])
    base = f"{url}/indexes/{INDEX}/documents"
    a_report = {"title": "Alpha report", "text": "The alpha report says the harbour is PINE."}
    b_report = {"title": "Beta report", "text": "The beta report says the harbour is TULIP."}
    first = httpx.put(f"{base}/report", json=b_report, headers=b, timeout=60)
    assert first.status_code == 200, first.text
    # B's id is as free to A as any: the same reply as for an id nobody holds
    taken = httpx.put(f"{base}/report", json=a_report, headers=a, timeout=60)
    free = httpx.put(f"{base}/report-free", json=a_report, headers=a, timeout=60)
    assert taken.status_code == free.status_code == 200, taken.text
    assert taken.json()["id"] == "report" and taken.json()["passages"] == free.json()["passages"]
    for key, doc, other in ((a, a_report, "TULIP"), (b, b_report, "PINE")):
        got = httpx.get(f"{base}/report", headers=key)
        assert got.status_code == 200 and got.json()["text"] == doc["text"]
        assert got.json()["id"] == "report"  # as the tenant wrote it, never qualified
        assert all(p.startswith("report#") for p in got.json()["passage_ids"])
        assert other not in got.text
    a_ids = httpx.get(base, headers=a, params={"limit": 100}).json()["ids"]
    b_ids = httpx.get(base, headers=b, params={"limit": 100}).json()["ids"]
    assert "report" in a_ids and "report" in b_ids and "b-doc" not in a_ids
    assert not [i for i in a_ids + b_ids if i.startswith("~")]
    # answers and MCP search cite each tenant's own report, by the id it wrote
    question = "What does the report say the harbour is?"
    for key, mine, other in ((tenants["a"], "PINE", "TULIP"), (tenants["b"], "TULIP", "PINE")):
        answered = _answer(url, key, question=question, k=5)
        assert answered.status_code == 200, answered.text
        cited = {p["document"] for p in answered.json()["passages"]}
        assert "report" in cited and not [c for c in cited if c.startswith("~")]
        assert other not in answered.text
        found = mcp_tool(url, key, "search", query=question, k=5)
        assert mine in str(found) and other not in str(found) and "~" not in str(found)
    # the admin sees two documents, in the two namespaces
    assert (
        httpx.get(f"{base}/{_stored('a', 'report')}", headers=admin).json()["text"]
        == (a_report["text"])
    )
    assert (
        httpx.get(f"{base}/{_stored('b', 'report')}", headers=admin).json()["text"]
        == (b_report["text"])
    )
    # a filter on the id names it as the tenant wrote it: its own report, never the other's
    for key, mine, other in ((tenants["a"], "PINE", "TULIP"), (tenants["b"], "TULIP", "PINE")):
        for where in ({"_id": "report"}, {"_id": {"$in": ["report", "nothing-here"]}}):
            answered = _answer(url, key, question=question, k=1, filter=where)
            assert answered.status_code == 200, answered.text
            assert [p["document"] for p in answered.json()["passages"]] == ["report"]
            assert mine in answered.text and other not in answered.text
    # A deletes its report: B's stays
    assert httpx.delete(f"{base}/report", headers=a, timeout=60).status_code == 200
    assert httpx.delete(f"{base}/report-free", headers=a, timeout=60).status_code == 200
    assert httpx.get(f"{base}/report", headers=a).status_code == 404
    assert httpx.get(f"{base}/report", headers=b).json()["text"] == b_report["text"]
    # an id in the namespaces' form is nobody's to write; a tenant's ids leave room for its
    # namespace in the index's limit
    for key in (a, admin):
        reserved = httpx.put(f"{base}/~0123456789abcdef~report", json=a_report, headers=key)
        assert reserved.status_code == 422 and "doc_id" in reserved.text
    long_id = "x" * 250
    too_long = httpx.put(f"{base}/{long_id}", json=a_report, headers=a)
    assert too_long.status_code == 422 and "doc_id" in too_long.text and "~" not in too_long.text


def test_a_tenant_lists_only_its_indexes_and_no_totals(url, admin, tenants):
    # the passage count of a shared index is every tenant's: none of it shows to a tenant
    everyone = httpx.get(f"{url}/indexes", headers=admin).json()["indexes"]
    (shared,) = [i for i in everyone if i["name"] == INDEX]
    assert shared["count"] > 0 and {"facts-a", "facts-b"} <= {i["name"] for i in everyone}
    listed = httpx.get(f"{url}/indexes", headers=bearer(tenants["a"]))
    assert listed.status_code == 200
    assert listed.json()["active"] == INDEX
    (only,) = listed.json()["indexes"]
    assert only["name"] == INDEX and only["count"] is None
    mcp = mcp_tool(url, tenants["a"], "list_indexes")
    assert "facts-a" not in str(mcp) and str(shared["count"]) + " " not in str(mcp)
    assert mcp["structuredContent"]["indexes"][0]["count"] is None
    # a key held to indexes without a tenant filter owns what it sees: its counts show
    held = create_key(url, admin, "held-to-one", ["ask"], indexes=[INDEX])
    (counted,) = httpx.get(f"{url}/indexes", headers=bearer(held)).json()["indexes"]
    assert counted["count"] == shared["count"]


def test_no_request_field_widens_a_tenant(url, tenants):
    key = tenants["a"]
    for widened in (
        None,
        {"tenant": "b"},
        {"$or": [{"tenant": "b"}, {"tenant": "a"}]},
        {"$or": [{"tenant": "b"}, {"lang": "en"}]},
        {"_id": "b-doc"},
    ):
        reply = _answer(url, key, filter=widened, k=5)
        assert reply.status_code == 200, reply.text
        _never_b(reply.text)
        assert {p["document"] for p in reply.json()["passages"]} <= {"a-doc", "a-upload"}
    assert _answer(url, key, index="facts-a").status_code == 404
    # a key is read from the Authorization header only: in the query string it is no key
    for param in ("key", "api_key", "access_token"):
        in_query = httpx.post(
            f"{url}/answer", params={param: key}, json={"question": QUESTION}, timeout=60
        )
        assert in_query.status_code == 401, param
    # the OpenAI API, with the filter as an extra body field
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": f"openbook/{INDEX}",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 2,
            "filter": {"$or": [{"tenant": "b"}, {"tenant": "a"}]},
        },
        headers=bearer(key),
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    _never_b(chat.text)
    responses = httpx.post(
        f"{url}/v1/responses",
        json={"model": f"openbook/{INDEX}", "input": QUESTION, "max_output_tokens": 2},
        headers=bearer(key),
        timeout=60,
    )
    assert responses.status_code == 200, responses.text
    _never_b(responses.text)
    # MCP: search and answer, and another index
    found = mcp_tool(url, key, "search", query=QUESTION, k=5, filter={"tenant": "b"})
    assert found.get("isError") is not True
    _never_b(str(found))
    found = mcp_tool(url, key, "search", query=QUESTION, k=5)
    assert "ORCHID" in str(found)
    _never_b(str(found))
    answered = mcp_tool(url, key, "answer", question=QUESTION, filter={"$or": [{"tenant": "b"}]})
    _never_b(str(answered))
    elsewhere = mcp_tool(url, key, "search", query=QUESTION, index="facts-b")
    assert elsewhere["isError"] is True


def test_the_cache_never_crosses_tenants(url, tenants):
    # B asks first, and its answer is cached; A asking the same gets its own
    asked = {"question": "Which launch code opens the vault?", "use_cache": True, "k": 5}
    b = _answer(url, tenants["b"], **asked)
    assert b.status_code == 200 and "b-doc" in {p["document"] for p in b.json()["passages"]}
    again = _answer(url, tenants["b"], **asked)
    assert again.json()["cached"] is True
    a = _answer(url, tenants["a"], **asked)
    assert a.status_code == 200
    assert a.json()["cached"] is False
    _never_b(a.text)
    assert _answer(url, tenants["a"], **asked).json()["cached"] is True  # its own, now
    # ... even naming B's filter itself
    a = _answer(url, tenants["a"], **asked, filter={"tenant": "b"})
    assert a.json()["cached"] is False and a.json()["passages"] == []


def test_a_key_is_held_to_its_rate(url, admin, redis_server, tenants):
    key = create_key(url, admin, "limited", ["ask"], rate={"requests_per_minute": 2})
    assert _answer(url, key).status_code == 200
    assert httpx.get(f"{url}/indexes", headers=bearer(key)).status_code == 200
    refused = _answer(url, key)
    assert refused.status_code == 429 and "2 requests a minute" in refused.text
    retry_after = int(refused.headers["Retry-After"])
    # truthful: the window ends then (the counter expires), not before
    left_ms = redis_server.client().pttl("openbook:api-key-requests:limited")
    assert 0 < left_ms <= retry_after * 1000 <= 60_000
    models = httpx.get(f"{url}/v1/models", headers=bearer(key))
    assert models.status_code == 429 and models.headers["Retry-After"]
    assert models.json()["error"]["code"] == "rate_limit_exceeded"
    # counted in Redis, for every gateway: a new window lets it in again
    redis_server.client().delete("openbook:api-key-requests:limited")
    assert _answer(url, key).status_code == 200
    # other keys are not held to it
    assert _answer(url, tenants["a"]).status_code == 200


def test_concurrent_generations_are_counted_across_replicas(url, admin, redis_server):
    key = create_key(url, admin, "one-at-a-time", ["ask"], rate={"concurrent_generations": 1})
    leases = "openbook:api-key-generations:one-at-a-time"
    client = redis_server.client()
    # a generation of this key running on another gateway replica
    client.zadd(leases, {"other-replica": 2**50})
    busy = _answer(url, key)
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
    assert "1 answers being generated" in busy.text
    # a replica that died with its lease: expired, it holds nothing
    client.zadd(leases, {"other-replica": 1})
    assert _answer(url, key).status_code == 200
    assert client.zcard(leases) == 0  # given back once answered


def test_writes_and_key_changes_are_audited(url, admin, tenants, caplog):
    caplog.set_level(logging.INFO, logger="openbook.audit")
    a = bearer(tenants["a"])
    base = f"{url}/indexes/{INDEX}/documents"
    assert httpx.put(f"{base}/a-5", json=A_DOC, headers=a, timeout=60).status_code == 200
    assert httpx.delete(f"{base}/b-doc", headers=a, timeout=60).status_code == 404
    batch = {"documents": [{"id": "a-6", **A_DOC}, {"id": "a-7", **A_DOC}]}
    assert httpx.post(f"{base}:batch", json=batch, headers=a, timeout=60).status_code == 200
    made = create_key(url, admin, "audited", ["ask"])
    assert httpx.delete(f"{url}/admin/keys/audited", headers=admin).status_code == 200
    index = {"name": "audit-idx", "like": "no-such-index"}
    assert httpx.post(f"{url}/indexes", json=index, headers=admin).status_code == 404
    put = mcp_tool(url, tenants["a"], "put_document", index=INDEX, doc_id="a-8", text=A_DOC["text"])
    assert put.get("isError") is not True, put
    assert httpx.post(f"{url}/wp-login.php", headers=a).status_code == 404  # not audited
    lines = [r.fields for r in caplog.records if r.name == "openbook.audit"]
    assert not [f for f in lines if "wp-login" in str(f) or f["action"].endswith("unmatched")]
    assert {
        "key": "tenant-a",
        "index": INDEX,
        "ids": ["a-5"],
        "outcome": "ok",
        "status": 200,
    }.items() <= next(f for f in lines if f.get("ids") == ["a-5"]).items()
    deleted = next(f for f in lines if f.get("ids") == ["b-doc"])
    assert deleted["outcome"] == "refused" and deleted["status"] == 404
    assert deleted["action"].startswith("DELETE ")
    assert next(f for f in lines if f.get("ids") == ["a-6", "a-7"])["key"] == "tenant-a"
    created = next(f for f in lines if f["action"] == "POST /admin/keys")
    assert created["name"] == "audited" and created["key"] == "admin-token"
    assert next(f for f in lines if f["action"] == "DELETE /admin/keys/{name}")["name"] == "audited"
    made_index = next(f for f in lines if f["action"] == "POST /indexes")
    assert made_index["name"] == "audit-idx" and made_index["outcome"] == "refused"
    mcp = next(f for f in lines if f["action"] == "mcp:put_document")
    assert mcp["ids"] == ["a-8"] and mcp["outcome"] == "ok" and mcp["key"] == "tenant-a"
    # never a secret
    text = caplog.text + str(lines)
    for secret in (made, tenants["a"], tenants["a"].split(".", 1)[1]):
        assert secret not in text
    metrics = httpx.get(f"{url}/metrics").text
    assert 'key="tenant-a"' in metrics and 'key="admin-token"' in metrics


def test_indexes_create_scope(url, admin):
    made = httpx.post(
        f"{url}/indexes", json={"name": "team-one", "like": "facts-b"}, headers=admin, timeout=60
    )
    assert made.status_code == 201, made.text
    creator = create_key(
        url, admin, "creator", ["write", "indexes:create"], indexes=["team-one", "team-two"]
    )
    writer = create_key(url, admin, "writer-only", ["write"], indexes=["team-one", "team-two"])
    body = {"name": "team-two", "like": "team-one"}
    assert httpx.post(f"{url}/indexes", json=body, headers=bearer(writer)).status_code == 403
    # an index it may not name is as unknown to it as ever, even as a template
    like = httpx.post(
        f"{url}/indexes", json={"name": "team-two", "like": "facts-b"}, headers=bearer(creator)
    )
    assert like.status_code == 404 and "facts-b" in like.text
    made = httpx.post(f"{url}/indexes", json=body, headers=bearer(creator), timeout=60)
    assert made.status_code == 201, made.text
    other = httpx.post(
        f"{url}/indexes", json={"name": "not-mine", "like": "team-one"}, headers=bearer(creator)
    )
    assert other.status_code == 403 and "name" in other.text
    gone = httpx.delete(f"{url}/indexes/team-two", headers=bearer(creator))
    assert gone.status_code == 403  # deleting an index stays admin's


def test_bad_tenant_and_rate_requests_name_the_field(url, admin, tenants):
    for body, field in (
        ({"name": "x", "scopes": ["ask"], "filter": {"tenant": ["a"]}}, "filter"),
        ({"name": "x", "scopes": ["admin"], "filter": {"tenant": "a"}}, "filter"),
        ({"name": "x", "scopes": ["ask"], "rate": {"requests_per_minute": 0}}, "rate"),
        ({"name": "x", "scopes": ["ask"], "rate": {"per_second": 1}}, "rate"),
        ({"name": "x", "scopes": ["ask"], "rate": {"concurrent_generations": "2"}}, "rate"),
    ):
        reply = httpx.post(f"{url}/admin/keys", json=body, headers=admin)
        assert reply.status_code == 422, body
        assert field in reply.text
    listed = httpx.get(f"{url}/admin/keys", headers=admin).json()["keys"]
    (a,) = [k for k in listed if k["name"] == "tenant-a"]
    assert a["filter"] == {"tenant": "a"} and a["rate"] is None


def test_the_cli_makes_a_tenant_key_and_writes_with_it(url, backends, tenants):
    runner = CliRunner()
    admin_env = {"OPENBOOK_URL": url, "OPENBOOK_ADMIN_TOKEN": backends.admin_token}
    made = runner.invoke(
        cli_app,
        [
            "keys",
            "create",
            "tenant-c",
            "--scope",
            "ask",
            "--scope",
            "write",
            "--index",
            INDEX,
            "--filter",
            '{"tenant": "c"}',
            "--requests-per-minute",
            "100",
        ],
        env=admin_env,
    )
    assert made.exit_code == 0, made.output
    key = json.loads(made.output)["key"]
    listed = json.loads(runner.invoke(cli_app, ["keys", "ls"], env=admin_env).output)
    (entry,) = [k for k in listed["keys"] if k["name"] == "tenant-c"]
    assert entry["filter"] == {"tenant": "c"}
    assert entry["rate"] == {"requests_per_minute": 100, "concurrent_generations": None}
    # openbook docs with the key (OPENBOOK_API_KEY), not the admin token
    env = {"OPENBOOK_URL": url, "OPENBOOK_API_KEY": key}
    put = runner.invoke(
        cli_app, ["docs", "put", INDEX, "--id", "c-doc", "--text", "Gamma notes."], env=env
    )
    assert put.exit_code == 0, put.output
    got = runner.invoke(cli_app, ["docs", "get", INDEX, "c-doc"], env=env)
    assert got.exit_code == 0 and json.loads(got.output)["metadata"] == {"tenant": "c"}
    assert json.loads(runner.invoke(cli_app, ["docs", "ls", INDEX], env=env).output)["ids"] == [
        "c-doc"
    ]
    other = runner.invoke(cli_app, ["docs", "get", INDEX, "b-doc"], env=env)
    assert other.exit_code == 1 and "404" in other.output
    bad = runner.invoke(
        cli_app, ["keys", "create", "x", "--scope", "ask", "--filter", "{nope"], env=admin_env
    )
    assert bad.exit_code == 1 and "--filter" in bad.output


def test_the_page_asks_for_a_key_where_one_is_required(url):
    # the page is served without one; what it asks the gateway for then needs one (a 401,
    # which makes it show its Key field, sent with every request after)
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and 'id="api-key"' in page.text
    script = httpx.get(f"{url}/static/app.js").text
    assert "askForKey" in script and "withKey(" in script
    assert httpx.get(f"{url}/indexes").status_code == 401


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    # a bound on a wait, not a timing threshold: the condition decides
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.005)


def test_one_keys_flood_does_not_take_the_generator_from_another(url, admin, backends, tenants):
    # Key A floods the generator with answers (POST /answer); key B asks once (/v1 chat
    # completions) while A's wait in the generator's line. B's answer is admitted at the next
    # free place (fair share across keys, openbook_generator.policy), not behind A's flood:
    # the order answers complete in shows it, with no timing threshold. Every answer path
    # names its key to the generator: REST, /v1 and MCP.
    flood = create_key(url, admin, "flood", ["ask"])
    single = create_key(url, admin, "single", ["ask"])
    scheduler = backends.generator_servicer.scheduler
    done: list[str] = []
    lock = threading.Lock()

    def ask(key: str, who: str, tokens: int) -> None:
        if who == "a":
            body = {"k": 1, "max_new_tokens": tokens, "min_new_tokens": tokens}
            reply = _answer(url, key, **body)
        else:
            chat = {
                "model": f"openbook/{INDEX}",
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": tokens,
                "k": 1,
                "use_cache": False,
            }
            reply = httpx.post(
                f"{url}/v1/chat/completions", json=chat, headers=bearer(key), timeout=60
            )
        with lock:
            done.append(who if reply.status_code == 200 else f"{who}: {reply.text}")

    batch_size = scheduler.max_batch_size
    scheduler.max_batch_size = 1  # one answer at a time: the line decides who goes next
    slow = Throttle(step_s=0.02)  # each of A's answers takes 16 steps of at least 20 ms
    try:
        with (
            throttled(backends.generator_servicer.generator.backend, slow),
            ThreadPoolExecutor(8) as pool,
        ):
            floods = [pool.submit(ask, flood, "a", 16) for _ in range(6)]
            _wait_until(lambda: scheduler.depth() >= 4, "A's answers waiting in line")
            with lock:
                before = len(done)
            mine = pool.submit(ask, single, "b", 2)
            for call in [*floods, mine]:
                call.result()
    finally:
        scheduler.max_batch_size = batch_size
    assert sorted(done) == ["a"] * 6 + ["b"], done
    # first come first served, B's would come after the four (or more) of A's waiting when it
    # asked; fairly, after the one running then (and one more, had it just ended)
    assert done.index("b") <= before + 2, done
    # the generator took each request under its key's name: REST, /v1 and MCP
    mcp = create_key(url, admin, "mcp-caller", ["ask"])
    assert mcp_tool(url, mcp, "answer", question=QUESTION, k=1).get("isError") is not True
    for key_name in ("flood", "single", "mcp-caller"):
        assert scheduler.policy.last_started(key_name) is not None, key_name
