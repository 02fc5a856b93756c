"""Keys and tenants (issue 43) through the stack `openbook up` starts, with keys required
(``OPENBOOK_GATEWAY_REQUIRE_KEYS=true``): two tenants' keys on one live index, each writing a
document of the same id, and every route that retrieves or reads documents asked with tenant A's
key, whatever the request sends. Never a B passage, title or id in A's reply; refusals where a
key is revoked, held to another index, sent in the query string, or probed for. Tiny random
models: the tests check where passages come from, not what the answer says.
"""

from __future__ import annotations

import httpx
import pytest

from openbook_cli.launcher import access_line
from openbook_testkit.gateway_calls import answer_with_key, bearer, create_key, mcp_tool
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import LocalStack, build_fact_indexes

pytestmark = pytest.mark.e2e

INDEX = "shared"
QUESTION = "What does the report say the launch code is?"
REPORTS = {
    "a": {"title": "Alpha report", "text": "The alpha report says the launch code is ORCHID."},
    "b": {"title": "Beta report", "text": "The beta report says the launch code is TULIP."},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    var = tmp_path_factory.mktemp("var")
    build_fact_indexes(var / "indexes")
    make_tiny_bart(var / "models" / "tiny-bart")
    stack = LocalStack(var, extra_env={"OPENBOOK_GATEWAY_REQUIRE_KEYS": "true"})
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def keys(stack) -> dict[str, str]:
    """Tenants a and b on one live index, each with its "report" and b with an upload."""
    made = httpx.post(
        f"{stack.url}/indexes", json={"name": INDEX, "like": "facts-b"}, headers=stack.auth
    )
    assert made.status_code == 201, made.text
    keys = {
        t: create_key(
            stack.url,
            stack.auth,
            f"tenant-{t}",
            ["ask", "write"],
            indexes=[INDEX],
            filter={"tenant": t},
        )
        for t in ("a", "b")
    }
    for tenant, report in REPORTS.items():
        put = httpx.put(
            f"{stack.url}/indexes/{INDEX}/documents/report",
            json=report,
            headers=bearer(keys[tenant]),
            timeout=120,
        )
        assert put.status_code == 200, put.text
    upload = httpx.post(
        f"{stack.url}/indexes/{INDEX}/documents",
        files={"file": ("beta.txt", b"Beta notes: the launch code is TULIP.", "text/plain")},
        data={"id": "b-upload"},
        headers=bearer(keys["b"]),
        timeout=120,
    )
    assert upload.status_code == 200, upload.text
    return keys


def _answer(stack: LocalStack, key: str, **body) -> httpx.Response:
    return answer_with_key(stack.url, key, QUESTION, **{"k": 5, **body})


def _never_b(text: str) -> None:
    for trace in ("TULIP", "Beta report", "beta report", "b-upload", "Beta notes", "~"):
        assert trace not in text, trace


def test_every_route_keeps_the_tenants_apart(stack, keys):
    a = bearer(keys["a"])
    # the cache path: B asks first and its answer is cached; A asks the same after
    b_first = _answer(stack, keys["b"], use_cache=True)
    assert b_first.status_code == 200 and "TULIP" in b_first.text
    assert _answer(stack, keys["b"], use_cache=True).json()["cached"] is True
    a_after = _answer(stack, keys["a"], use_cache=True)
    assert a_after.status_code == 200 and a_after.json()["cached"] is False
    _never_b(a_after.text)
    # /answer, whatever the body says: its own report, cited by the id it wrote
    for widened in (None, {"tenant": "b"}, {"$or": [{"tenant": "b"}, {"tenant": "a"}]}):
        reply = _answer(stack, keys["a"], filter=widened)
        assert reply.status_code == 200, reply.text
        _never_b(reply.text)
        assert {p["document"] for p in reply.json()["passages"]} <= {"report"}
    assert "ORCHID" in _answer(stack, keys["a"]).text
    assert _answer(stack, keys["a"], index="facts-a").status_code == 404
    streamed = httpx.post(
        f"{stack.url}/answer",
        json={"question": QUESTION, "k": 5, "max_new_tokens": 2, "stream": True},
        headers=a,
        timeout=120,
    )
    assert streamed.status_code == 200 and "event: answer" in streamed.text
    _never_b(streamed.text)
    # the OpenAI API
    chat = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={
            "model": f"openbook/{INDEX}",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 2,
            "filter": {"$or": [{"tenant": "b"}]},
        },
        headers=a,
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    _never_b(chat.text)
    responses = httpx.post(
        f"{stack.url}/v1/responses",
        json={"model": f"openbook/{INDEX}", "input": QUESTION, "max_output_tokens": 2},
        headers=a,
        timeout=120,
    )
    assert responses.status_code == 200, responses.text
    _never_b(responses.text)
    models = httpx.get(f"{stack.url}/v1/models", headers=a).json()
    assert [m["id"] for m in models["data"]] == ["openbook", f"openbook/{INDEX}"]
    # MCP
    found = mcp_tool(stack.url, keys["a"], "search", query=QUESTION, k=5, filter={"tenant": "b"})
    _never_b(str(found))
    found = mcp_tool(stack.url, keys["a"], "search", query=QUESTION, k=5)
    assert "ORCHID" in str(found)
    _never_b(str(found))
    _never_b(str(mcp_tool(stack.url, keys["a"], "answer", question=QUESTION, k=5)))
    assert (
        mcp_tool(stack.url, keys["a"], "search", query=QUESTION, index="facts-b")["isError"] is True
    )
    put = mcp_tool(stack.url, keys["a"], "put_document", index="facts-b", doc_id="x", text="Words.")
    assert put["isError"] is True
    # indexes: its own, no totals
    listed = httpx.get(f"{stack.url}/indexes", headers=a).json()
    assert [(i["name"], i["count"]) for i in listed["indexes"]] == [(INDEX, None)]
    _never_b(str(mcp_tool(stack.url, keys["a"], "list_indexes")))
    # documents: its own "report", nothing of B's, whatever the id
    base = f"{stack.url}/indexes/{INDEX}/documents"
    got = httpx.get(f"{base}/report", headers=a)
    assert got.status_code == 200 and got.json()["text"] == REPORTS["a"]["text"]
    assert httpx.get(base, headers=a).json()["ids"] == ["report"]
    for method in ("GET", "DELETE"):
        refused = httpx.request(method, f"{base}/b-upload", headers=a, timeout=60)
        assert refused.status_code == 404, method
    upload = httpx.post(
        base,
        files={"file": ("alpha.txt", b"Alpha notes.", "text/plain")},
        data={"metadata": '{"tenant": "b"}'},
        headers=a,
        timeout=120,
    )
    assert upload.status_code == 403 and "metadata.tenant" in upload.text
    # B's documents are all still there, as B wrote them
    b = bearer(keys["b"])
    assert httpx.get(f"{base}/report", headers=b).json()["text"] == REPORTS["b"]["text"]
    assert httpx.get(base, headers=b).json()["ids"] == ["b-upload", "report"]


def test_openbook_up_says_which_door_the_gateway_has(stack):
    assert "openbook up: gateway requires keys" in stack.log_tail(1_000_000)
    # the default stays open, and says so
    assert "gateway open" in access_line({})
    assert "requires keys" in access_line({"OPENBOOK_GATEWAY_REQUIRE_KEYS": "true"})


def test_keys_are_refused_where_they_must_be(stack, keys):
    # no key, a key in the query string: 401
    assert httpx.post(f"{stack.url}/answer", json={"question": QUESTION}).status_code == 401
    for param in ("key", "api_key", "access_token"):
        in_query = httpx.post(
            f"{stack.url}/answer", params={param: keys["a"]}, json={"question": QUESTION}
        )
        assert in_query.status_code == 401, param
    # a key held to another index: the shared index is as unknown to it as one that is not
    other = create_key(stack.url, stack.auth, "facts-only", ["ask"], indexes=["facts-a"])
    refused = _answer(stack, other, index=INDEX)
    assert refused.status_code == 404 and INDEX not in refused.json()["detail"].split("(")[1]
    # a revoked key
    revoked = create_key(stack.url, stack.auth, "short-lived", ["ask"])
    assert _answer(stack, revoked).status_code == 200
    gone = httpx.delete(f"{stack.url}/admin/keys/short-lived", headers=stack.auth, timeout=60)
    assert gone.status_code == 200
    assert _answer(stack, revoked).status_code == 401
    # a timing probe: a name that exists and one that does not get the same refusal
    probes = [_answer(stack, f"obk_{name}.wrong") for name in ("tenant-a", "nobody-here")]
    assert [p.status_code for p in probes] == [401, 401]
    assert probes[0].text == probes[1].text
