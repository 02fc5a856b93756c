"""The documents API through the stack `openbook up` starts: gateway → retriever, Redis.

A document written over HTTP is in the next answer; a replaced one is never answered from the
cache with its old text; a deleted one is never served again; an acknowledged write survives
`kill -9` of the retriever (the launcher restarts it); the `openbook docs` CLI loads a file.
Tiny random models: the tests check where passages come from, not what the answer says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import REPO_ROOT, LocalStack, build_fact_indexes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    var = tmp_path_factory.mktemp("var")
    build_fact_indexes(var / "indexes")
    make_tiny_bart(var / "models" / "tiny-bart")
    stack = LocalStack(var)
    stack.start()
    yield stack
    stack.stop()


def _ask(stack: LocalStack, question: str, **extra) -> dict:
    body = {"question": question, "k": 3, "retrieval": "bm25", **extra}
    reply = httpx.post(f"{stack.url}/answer", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _put(stack: LocalStack, index: str, doc_id: str, text: str, title: str = "Notes") -> dict:
    reply = httpx.put(
        f"{stack.url}/indexes/{index}/documents/{doc_id}",
        json={"title": title, "text": text, "metadata": {"source": "e2e"}},
        headers=stack.auth,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_written_document_is_in_the_next_answer_and_the_cache_never_outlives_it(stack):
    question = "Where is the zorblax machine kept?"
    before = _ask(stack, question, retrieval="dense")  # BM25 knows none of its words yet
    assert before["index"] == "facts-a"
    assert before["index_version"] == 0
    assert (
        httpx.put(
            f"{stack.url}/indexes/facts-a/documents/zorblax",
            json={"title": "Zorblax", "text": "The zorblax machine is kept in Tromso."},
            timeout=60,
        ).status_code
        == 401
    )  # a write needs the admin token

    # The active index is a built one: its first write adopts it into the live layout.
    written = _put(stack, "facts-a", "zorblax", "The zorblax machine is kept in Tromso.")
    assert written["passages"] == 1 and written["version"] >= 1
    first = _ask(stack, question)
    assert first["index_version"] == written["version"]
    assert first["passages"][0]["id"] == "zorblax#0"
    assert _ask(stack, question)["cached"] is True

    replaced = _put(stack, "facts-a", "zorblax", "The zorblax machine is now kept in Bergen.")
    assert replaced["version"] == written["version"] + 1
    after = _ask(stack, question)
    assert after["cached"] is False
    assert after["index_version"] == replaced["version"]
    assert "Bergen" in after["passages"][0]["text"]
    assert all("Tromso" not in p["text"] for p in after["passages"])

    deleted = httpx.delete(
        f"{stack.url}/indexes/facts-a/documents/zorblax", headers=stack.auth, timeout=60
    )
    assert deleted.status_code == 200, deleted.text
    gone = _ask(stack, question, retrieval="dense", k=10)  # BM25: no passage matches now
    assert all(not p["id"].startswith("zorblax#") for p in gone["passages"])
    document = httpx.get(f"{stack.url}/indexes/facts-a/documents/zorblax", timeout=30)
    assert document.status_code == 404
    listed = {i["name"]: i for i in httpx.get(f"{stack.url}/indexes", timeout=30).json()["indexes"]}
    assert listed["facts-a"]["version"] == deleted.json()["version"]


def test_a_new_index_takes_documents_and_the_active_one_cannot_be_deleted(stack):
    created = httpx.post(
        f"{stack.url}/indexes",
        json={"name": "notes", "like": "facts-a"},
        headers=stack.auth,
        timeout=120,
    )
    assert created.status_code == 201, created.text
    _put(stack, "notes", "kettle", "The blue kettle of the workshop boils in ninety seconds.")
    answer = _ask(stack, "How fast does the blue kettle boil?", index="notes")
    assert answer["index"] == "notes"
    assert answer["passages"][0]["id"] == "kettle#0"

    active = httpx.delete(f"{stack.url}/indexes/facts-a", headers=stack.auth, timeout=60)
    assert active.status_code == 409, active.text
    dropped = httpx.delete(f"{stack.url}/indexes/notes", headers=stack.auth, timeout=60)
    assert dropped.status_code == 200, dropped.text
    assert httpx.get(f"{stack.url}/indexes/notes/documents", timeout=30).status_code == 404


def test_bad_documents_are_422_naming_the_field_and_change_nothing(stack):
    version = httpx.get(f"{stack.url}/indexes/facts-a/documents", timeout=30).json()["version"]
    bad = [
        ({"title": "T", "text": ""}, "text"),
        ({"title": "T", "text": "words", "metadata": {"nested": {"a": 1}}}, "metadata"),
    ]
    for body, field in bad:
        reply = httpx.put(
            f"{stack.url}/indexes/facts-a/documents/doc", json=body, headers=stack.auth, timeout=30
        )
        assert reply.status_code == 422, reply.text
        assert field in json.dumps(reply.json()["detail"])
    slash = httpx.put(
        f"{stack.url}/indexes/facts-a/documents/a/b",
        json={"title": "T", "text": "words"},
        headers=stack.auth,
        timeout=30,
    )
    assert slash.status_code == 422
    unknown = httpx.put(
        f"{stack.url}/indexes/no-such-index/documents/doc",
        json={"title": "T", "text": "words"},
        headers=stack.auth,
        timeout=30,
    )
    assert unknown.status_code == 404
    after = httpx.get(f"{stack.url}/indexes/facts-a/documents", timeout=30).json()["version"]
    assert after == version


def test_an_acknowledged_write_survives_kill_9_of_the_retriever(stack):
    written = _put(stack, "facts-a", "durable", "The quokka archive survives every crash.")
    os.kill(stack.service_pid("retriever"), signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:  # the launcher restarts the retriever; the gateway answers 503 meanwhile
        try:
            reply = httpx.get(f"{stack.url}/indexes/facts-a/documents/durable", timeout=10)
            if reply.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(1)
    assert reply.json()["text"] == "The quokka archive survives every crash."
    answer = _ask(stack, "What does the quokka archive survive?")
    assert answer["index_version"] >= written["version"]
    assert answer["passages"][0]["id"] == "durable#0"


def test_openbook_docs_loads_a_jsonl_file(stack, tmp_path):
    rows = [
        {"id": f"cli-{i}", "title": "Loaded", "text": f"Line {i} of the marmoset ledger."}
        for i in range(5)
    ]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "OPENBOOK_ADMIN_TOKEN": stack.admin_token}
    run = subprocess.run(
        [sys.executable, "-m", "openbook_cli", "docs", "put", "facts-a", str(source),
         "--url", stack.url, "--batch-size", "2"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "openbook_cli", "docs", "ls", "facts-a", "--url", stack.url,
         "--cursor", "cli-", "--limit", "1000"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    for row in rows:
        assert row["id"] in listed.stdout
