"""``openbook docs`` (issue 32) against the gateway served over HTTP, in front of an in-memory
retriever that keeps the retriever's contract (openbook_testkit.fake_retriever).

No generator: the documents API never reaches it. Checked: each sub-command's request and
output, the JSONL load in batches (one version per batch), resuming it with --start after a
refused line, the admin token taken from OPENBOOK_ADMIN_TOKEN, and refusals on stderr with
exit status 1.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from openbook_cli.app import app
from openbook_gateway.settings import GatewaySettings
from openbook_testkit.fake_retriever import FakeRetriever, fake_retriever
from openbook_testkit.stack import serving_gateway

TOKEN = "cli-docs-admin-token"


@pytest.fixture(scope="module")
def retriever():
    with fake_retriever(TOKEN) as running:
        yield running


@pytest.fixture(scope="module")
def gateway_url(retriever, redis_server):
    settings = GatewaySettings(
        retriever_addr=retriever.addr,
        generator_addr="127.0.0.1:9",  # never asked
        redis_url=redis_server.url,
        admin_token=TOKEN,
    )
    with serving_gateway(settings) as url:
        yield url


@pytest.fixture
def servicer(retriever) -> FakeRetriever:
    retriever.servicer.__dict__.update(FakeRetriever("live").__dict__)
    return retriever.servicer


def docs(gateway_url: str, *args: str, token: str | None = TOKEN):
    env = {"OPENBOOK_ADMIN_TOKEN": token} if token else {"OPENBOOK_ADMIN_TOKEN": ""}
    return CliRunner().invoke(app, ["docs", *args, "--url", gateway_url], env=env)


def ok(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_put_get_ls_rm_one_document(gateway_url, servicer):
    put = ok(
        docs(
            gateway_url,
            "put",
            "live",
            "--id",
            "hamlet",
            "--title",
            "Hamlet",
            "--text",
            "A tragedy by William Shakespeare.",
            "--metadata",
            '{"year": 1600}',
        )
    )
    assert put == {"index": "live", "id": "hamlet", "passages": 1, "version": 1}
    got = ok(docs(gateway_url, "get", "live", "hamlet"))
    assert (got["title"], got["metadata"], got["passage_ids"]) == (
        "Hamlet",
        {"year": 1600},
        ["hamlet#0"],
    )
    assert ok(docs(gateway_url, "ls", "live"))["ids"] == ["hamlet"]
    assert ok(docs(gateway_url, "rm", "live", "hamlet")) == {"version": 2}
    missing = docs(gateway_url, "get", "live", "hamlet")
    assert missing.exit_code == 1
    assert "HTTP 404" in missing.stderr


def test_an_id_with_url_characters_stays_one_segment(gateway_url, servicer):
    ok(docs(gateway_url, "put", "live", "--id", "what? 100%", "--text", "some words"))
    assert ok(docs(gateway_url, "get", "live", "what? 100%"))["id"] == "what? 100%"


def test_create_index(gateway_url, servicer):
    created = ok(docs(gateway_url, "create-index", "notes", "--type", "bm25"))
    assert (created["name"], created["index_type"], created["version"]) == ("notes", "bm25", 0)
    again = docs(gateway_url, "create-index", "notes")
    assert again.exit_code == 1 and "HTTP 409" in again.stderr


def test_writes_without_the_token_are_refused(gateway_url, servicer):
    result = docs(gateway_url, "put", "live", "--id", "a", "--text", "x", token=None)
    assert result.exit_code == 1
    assert "HTTP 401" in result.stderr
    assert servicer.calls == []


def test_a_bad_document_names_the_field(gateway_url, servicer):
    result = docs(gateway_url, "put", "live", "--id", "a", "--text", "x", "--metadata", "[1]")
    assert result.exit_code == 1
    assert "metadata" in result.stderr and "HTTP 422" in result.stderr


def _jsonl(path, documents) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in documents))


def test_a_jsonl_file_loads_in_batches(gateway_url, servicer, tmp_path):
    documents = [
        {"id": f"doc-{i:03}", "title": f"Doc {i}", "text": f"text of document {i}"}
        for i in range(25)
    ]
    documents[3]["metadata"] = {"source": "test"}
    path = tmp_path / "docs.jsonl"
    _jsonl(path, documents)
    summary = ok(docs(gateway_url, "put", "live", str(path), "--batch-size", "10", "--no-progress"))
    assert summary == {
        "index": "live",
        "documents": 25,
        "passages": 25,
        "version": 3,  # three batches: one version each
        "lines": 25,
    }
    assert servicer.calls.count("PutDocuments") == 3
    listed = ok(docs(gateway_url, "ls", "live", "--limit", "30"))
    assert listed["ids"] == [d["id"] for d in documents]
    page = ok(docs(gateway_url, "ls", "live", "--limit", "10", "--cursor", "doc-009"))
    assert page["ids"][0] == "doc-010" and page["next_cursor"] == "doc-019"


def test_a_refused_batch_says_where_to_resume(gateway_url, servicer, tmp_path):
    documents = [{"id": f"d{i}", "title": "", "text": f"words {i}"} for i in range(6)]
    documents[4]["text"] = ""  # refused: its batch (lines 4..6) is not written
    path = tmp_path / "docs.jsonl"
    _jsonl(path, documents)
    failed = docs(gateway_url, "put", "live", str(path), "--batch-size", "3", "--no-progress")
    assert failed.exit_code == 1
    assert "text" in failed.stderr and "resume with --start 3" in failed.stderr
    assert ok(docs(gateway_url, "ls", "live"))["ids"] == ["d0", "d1", "d2"]

    documents[4]["text"] = "fixed words"
    _jsonl(path, documents)
    resumed = ok(
        docs(
            gateway_url,
            "put",
            "live",
            str(path),
            "--batch-size",
            "3",
            "--start",
            "3",
            "--no-progress",
        )
    )
    assert resumed["documents"] == 3
    assert ok(docs(gateway_url, "ls", "live"))["ids"] == [f"d{i}" for i in range(6)]


def test_a_line_that_is_not_an_object_is_named(gateway_url, servicer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": "a", "title": "", "text": "x"}\n[1, 2]\n')
    result = docs(gateway_url, "put", "live", str(path), "--no-progress")
    assert result.exit_code == 1
    assert "docs.jsonl:2" in result.stderr and "--start 0" in result.stderr
