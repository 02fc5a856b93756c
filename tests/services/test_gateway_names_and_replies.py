"""Ids that mean what they show, and replies that say neither too much nor too little (issue
42, items 6 and 7), through the gateway under uvicorn in front of the real retriever and
generator.

Item 6: a path that is not UTF-8 is a 422 (it was read as U+FFFD, so ``%FF%FE`` and ``%FE%FF``
were one document); ids and metadata keys with bidi, invisible, format or control characters
are refused naming the field; a document whose text shows nothing is refused (body and upload).
Item 7: a 422 echoes a prefix of what was sent, never all of it; no reply names a model by
its filesystem path; a 5,000-digit integer is a 422; ``page_words`` exists only where pages
do; ``GET /mcp`` is a 405; MCP tool arguments are as strict as HTTP bodies.
"""

from __future__ import annotations

import json

import httpx
import pytest

from openbook.index.documents import Document
from openbook.index.encoders import load_encoder
from openbook_testkit.gateway_calls import MCP_HEADERS
from openbook_testkit.stack import backends_serving, build_fact_indexes, serving_gateway

TOKEN = "names-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIVE = "names-live"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    """(gateway URL, the directory the retriever's query encoder was loaded from): a
    retriever configured with an encoder by its path, as ``openbook up`` configures the demo's
    adapter, so a reply that named the path would show it."""
    from openbook_generator.settings import GeneratorSettings
    from openbook_retriever.settings import RetrieverSettings
    from openbook_testkit.rag import make_tiny_bart

    workdir = tmp_path_factory.mktemp("names")
    build_fact_indexes(workdir / "indexes")
    # MiniLM saved into a directory of its own (it records what it was saved from, so it
    # pairs with the MiniLM fact indexes): an encoder known by its path
    encoder_dir = workdir / "models" / "minilm-query"
    load_encoder("all-MiniLM-L6-v2", cached=False).save(encoder_dir)
    common = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_server.url,
        "checkpoint_dir": workdir / "checkpoints",
        "admin_token": TOKEN,
    }
    retriever = RetrieverSettings(
        index_root=workdir / "indexes",
        default_index="facts-a",
        query_encoder=str(encoder_dir),
        **common,
    )
    generator = GeneratorSettings(model=make_tiny_bart(workdir / "models" / "tiny-bart"), **common)
    with backends_serving(retriever, generator) as backends:
        settings = backends.gateway_settings(
            redis_server.url, admin_token=TOKEN, max_body_bytes=8 * 1024 * 1024
        )
        with serving_gateway(settings) as url:
            with httpx.Client(base_url=url, timeout=60) as client:
                created = client.post("/indexes", json={"name": LIVE}, headers=AUTH)
                assert created.status_code == 201, created.text
            yield url, encoder_dir


@pytest.fixture
def client(stack):
    # the admin token opens every route, whichever need a key
    with httpx.Client(base_url=stack[0], timeout=60, headers=AUTH) as client:
        yield client


def _named(reply: httpx.Response, field: str) -> bool:
    detail = reply.json()["detail"]
    return any(field in [str(p) for p in err["loc"]] or field in err["msg"] for err in detail)


def _ids(client: httpx.Client) -> list[str]:
    listed = client.get(f"/indexes/{LIVE}/documents")
    assert listed.status_code == 200, listed.text
    return listed.json()["ids"]


DOC = {"title": "t", "text": "Hamlet is a tragedy by William Shakespeare."}


# --- item 6: ids and text ------------------------------------------------------------------


def test_a_path_that_is_not_utf8_is_refused_not_read_as_fffd(client):
    before = _ids(client)
    for raw in ("%FF%FE", "%FE%FF", "a%C3"):
        reply = client.put(f"/indexes/{LIVE}/documents/{raw}", json=DOC, headers=AUTH)
        assert reply.status_code == 422, reply.text
        assert _named(reply, "doc_id") and "UTF-8" in reply.text, reply.text
    assert _ids(client) == before
    # a U+FFFD sent as UTF-8 is a character like any other
    assert client.put(f"/indexes/{LIVE}/documents/x%EF%BF%BD", json=DOC, headers=AUTH).is_success


BIDI_AND_INVISIBLE = [
    "\u202eevil\u200b",  # right-to-left override, zero-width space: shows as "live"
    "a\u200db",  # zero-width joiner
    "a\u2066b",  # bidi isolate
    "a\ufeffb",  # BOM
    "a\u00a0b",  # no-break space: looks like "a b"
    "a\u3000b",  # ideographic space
    "a\u2028b",  # line separator
    "\u3164",  # Hangul filler
    " padded",  # shows as "padded"
]


@pytest.mark.parametrize("doc_id", BIDI_AND_INVISIBLE, ids=[ascii(i) for i in BIDI_AND_INVISIBLE])
def test_ids_with_bidi_or_invisible_characters_are_refused(client, doc_id):
    before = _ids(client)
    path = httpx.URL(f"/indexes/{LIVE}/documents/").copy_with(
        raw_path=f"/indexes/{LIVE}/documents/".encode() + _quote(doc_id)
    )
    put = client.put(path, json=DOC, headers=AUTH)
    assert put.status_code == 422 and _named(put, "doc_id"), put.text
    batch = client.post(
        f"/indexes/{LIVE}/documents:batch",
        json={"documents": [{**DOC, "id": doc_id}]},
        headers=AUTH,
    )
    assert batch.status_code == 422 and _named(batch, "id"), batch.text
    upload = client.post(
        f"/indexes/{LIVE}/documents",
        files={"file": ("a.txt", b"Some words in a file.", "text/plain")},
        data={"id": doc_id},
        headers=AUTH,
    )
    assert upload.status_code == 422 and _named(upload, "id"), upload.text
    assert _ids(client) == before


def _quote(text: str) -> bytes:
    from urllib.parse import quote

    return quote(text, safe="").encode("ascii")


@pytest.mark.parametrize("key", ["a\x00b", "\u202ekey", "k\u200b", "a\u00a0b"])
def test_metadata_keys_with_nul_or_invisible_characters_are_refused(client, key):
    reply = client.put(
        f"/indexes/{LIVE}/documents/meta", json={**DOC, "metadata": {key: 1}}, headers=AUTH
    )
    assert reply.status_code == 422 and _named(reply, "metadata"), reply.text
    upload = client.post(
        f"/indexes/{LIVE}/documents",
        files={"file": ("a.txt", b"Some words in a file.", "text/plain")},
        data={"metadata": json.dumps({key: 1})},
        headers=AUTH,
    )
    assert upload.status_code == 422 and _named(upload, "metadata"), upload.text
    assert "meta" not in _ids(client)


def test_a_text_with_no_visible_character_is_not_a_document(client):
    before = _ids(client)
    invisible = "\u202e\u200b \u202e\u200b\n\u2066"
    reply = client.put(
        f"/indexes/{LIVE}/documents/blank", json={"title": "t", "text": invisible}, headers=AUTH
    )
    assert reply.status_code == 422 and _named(reply, "text"), reply.text
    upload = client.post(
        f"/indexes/{LIVE}/documents",
        files={"file": ("blank.txt", invisible.encode(), "text/plain")},
        headers=AUTH,
    )
    assert upload.status_code == 422 and _named(upload, "file"), upload.text
    assert _ids(client) == before


def test_a_document_logged_before_the_rules_still_loads():
    # The write-ahead log replays its documents with the rules of when they were written:
    # an index holding one from before issue 42 loads, and the document can be deleted.
    logged = {"id": "\u202eold\u200b", "title": "", "text": "\u200b", "metadata": {"a\x00": 1}}
    assert Document.from_dict(logged, stored=True).id == logged["id"]
    with pytest.raises(ValueError, match="id"):
        Document.from_dict(logged)


# --- item 7: replies ----------------------------------------------------------------------


def test_a_validation_error_echoes_a_prefix_not_the_body(client):
    huge = "a" * 3_000_000
    for body in (
        {"question": huge},
        {"question": "q", huge: 1},
        {"question": "q", "k": [1] * 10**5},
    ):
        reply = client.post("/answer", json=body)
        assert reply.status_code == 422, reply.text[:500]
        assert len(reply.content) < 4096, len(reply.content)
    reply = client.post("/answer", json={"question": huge})
    (error,) = reply.json()["detail"]
    assert error["loc"] == ["body", "question"]
    assert error["input"] == huge[:256] and error["input_truncated"] is True


def test_no_reply_names_a_filesystem_path(client, stack):
    encoder_dir = stack[1]
    answered = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 2})
    assert answered.status_code == 200, answered.text
    body = answered.json()
    for key in ("retriever_version", "model_version"):
        assert "/" not in body[key], body[key]
    assert body["retriever_version"].startswith(encoder_dir.name + "-")
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    indexes = client.get("/indexes")
    for reply in (answered, ready, indexes):
        assert str(encoder_dir) not in reply.text
        assert str(encoder_dir.parent) not in reply.text
    for replica in ready.json().get("replicas", []):
        assert "/" not in replica["version"], replica


def test_a_number_of_5000_digits_is_422_naming_the_body(client):
    content = '{"question": "q", "k": 1' + "0" * 5000 + "}"
    reply = client.post("/answer", content=content, headers={"content-type": "application/json"})
    assert reply.status_code == 422, reply.text
    assert _named(reply, "body") and "4300 digits" in reply.text, reply.text


def test_page_words_only_where_pages_exist(client):
    before = _ids(client)
    upload = client.post(
        f"/indexes/{LIVE}/documents",
        files={"file": ("notes.txt", b"one two three four five six seven eight", "text/plain")},
        data={"id": "notes", "metadata": json.dumps({"page_words": "2,2,2,2"})},
        headers=AUTH,
    )
    assert upload.status_code == 422, upload.text
    assert _named(upload, "metadata") and "page_words" in upload.text, upload.text
    assert _ids(client) == before


def test_get_mcp_is_refused_in_stateless_mode(client):
    # The SDK answered with an SSE stream that never ends: a read timeout here.
    reply = client.get("/mcp", headers={"Accept": "text/event-stream"}, timeout=10)
    assert reply.status_code == 405, reply.text
    assert "POST" in reply.headers["allow"]


def _call(client: httpx.Client, tool: str, arguments: dict) -> dict:
    reply = client.post(
        "/mcp",
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": tool, "arguments": arguments},
        },
        headers=MCP_HEADERS,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


@pytest.mark.parametrize(
    "tool,arguments,named",
    [
        ("search", {"query": "Hamlet", "k": "5"}, "k"),
        ("search", {"query": "Hamlet", "k": 5.0}, "k"),
        ("search", {"query": "Hamlet", "filtr": {"a": 1}}, "filtr"),
        ("answer", {"question": "Who wrote Hamlet?", "k": True}, "k"),
        ("answer", {"question": "Who wrote Hamlet?", "min_confidence": "0.5"}, "min_confidence"),
        ("answer", {"question": "Who wrote Hamlet?", "temperature": 1}, "temperature"),
        ("list_indexes", {"verbose": True}, "verbose"),
    ],
)
def test_mcp_arguments_are_as_strict_as_http_bodies(client, tool, arguments, named):
    result = _call(client, tool, arguments)
    assert result["isError"] is True, result
    text = result["content"][0]["text"]
    assert named in text, text


def test_mcp_still_takes_good_arguments(client):
    result = _call(client, "search", {"query": "Hamlet", "k": 2})
    assert result.get("isError") is not True, result
    listed = _call(client, "list_indexes", {})
    assert listed.get("isError") is not True, listed
