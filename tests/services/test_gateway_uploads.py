"""Uploading files (issue 33) through the gateway into the real retriever's live index, with
the real generator (a tiny random BART): files made on the spot (openbook_testkit.files).

What is checked: a PDF of several pages with headers and footers, an HTML page with
navigation, Markdown and plain text each become one document (title from the form, else the
document, else the file's name; id from the content when absent, so uploading again is
idempotent); a PDF's passages never span pages and each cites its page, in ``/answer`` and in
``/v1``'s citations; every bad file is a 4xx naming the reason and leaves the index unchanged;
the size limit cuts the body while it streams; ``openbook docs upload`` takes a directory and a
zip, skips what is already there, and refuses a zip bomb; words stay apart as each format
renders them (Markdown's soft and hard breaks, HTML's blocks and inline elements, a PDF's line
ends and hyphens); a PDF whose pages share one content stream is parsed once; a client gone
before the write gets nothing written.
"""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from openbook_cli.app import app
from openbook_cli.docs import GatewayTarget
from openbook_cli.docs_upload import ArchiveLimits, content_id, upload
from openbook_gateway.app import create_app
from openbook_testkit import files
from openbook_testkit.crafted_pdf import distinct_streams_pdf, shared_stream_pdf, text_operations
from openbook_testkit.stack import running_backends, serving_gateway

TOKEN = "uploads-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INDEX = "uploads"


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    with running_backends(tmp_path_factory.mktemp("uploads"), redis_server.url, TOKEN) as running:
        yield running


@pytest.fixture(scope="module")
def client(backends, redis_server):
    settings = backends.gateway_settings(
        redis_server.url, max_document_body_bytes=2 * 1024 * 1024, upload_max_pages=20
    )
    with TestClient(create_app(settings)) as client:
        created = client.post("/indexes", json={"name": INDEX, "like": "facts-a"}, headers=AUTH)
        assert created.status_code == 201, created.text
        yield client


def send(client, data: bytes, name: str, headers=AUTH, **form) -> object:
    return client.post(
        f"/indexes/{INDEX}/documents", files={"file": (name, data)}, data=form, headers=headers
    )


def version(client) -> int:
    listed = client.get(f"/indexes/{INDEX}/documents", params={"limit": 1000})
    assert listed.status_code == 200, listed.text
    return listed.json()["version"]


def test_a_pdf_is_cut_page_by_page_and_cited_with_its_page(client):
    pages = [f"Section {n}. " + files.sentences(n, 150) for n in range(1, 4)]
    pages[1] = "The zorblax turbine of the quay spins at dawn. " + pages[1]
    data = files.pdf_bytes(pages, title="Quay report")
    reply = send(client, data, "quay.pdf", metadata=json.dumps({"team": "harbour"}))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    doc_id, digest = content_id(data)
    assert body["id"] == doc_id and body["sha256"] == digest
    assert (body["title"], body["type"], body["pages"]) == ("Quay report", "pdf", 3)
    assert body["passages"] == 6  # each page's ~165 words: two passages, none across pages

    document = client.get(f"/indexes/{INDEX}/documents/{doc_id}").json()
    meta = document["metadata"]
    assert meta["team"] == "harbour" and meta["sha256"] == digest and meta["pages"] == 3
    assert meta["source"] == "quay.pdf" and meta["type"] == "pdf"
    assert "ACME Corp" in document["text"]  # the running header is part of the text layer

    answer = client.post(
        "/answer",
        json={"question": "zorblax turbine quay", "k": 3, "retrieval": "bm25", "index": INDEX},
    ).json()
    top = answer["passages"][0]
    assert top["id"] == f"{doc_id}#2" and "zorblax" in top["text"]
    assert (top["document"], top["title"], top["page"]) == (doc_id, "Quay report", 2)

    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "openbook",
            "messages": [{"role": "user", "content": "zorblax turbine quay"}],
            "max_tokens": 4,
            "retrieval": "bm25",
            "index": INDEX,
        },
    )
    assert chat.status_code == 200, chat.text
    cited = chat.json()["citations"][0]
    assert (cited["document"], cited["title"], cited["page"]) == (doc_id, "Quay report", 2)

    again = send(client, data, "renamed.pdf")  # the same bytes: the same document, replaced
    assert again.status_code == 200 and again.json()["id"] == doc_id


@pytest.mark.parametrize(
    ("name", "data", "form", "kind", "title", "kept", "dropped"),
    [
        (
            "page.html",
            files.article_html(3, title="Field notes"),
            {},
            "html",
            "Field notes",
            "Field notes",
            ("Section 3 menu", "Sidebar link", "Copyright footer", "navigation script"),
        ),
        ("any-name", files.article_html(4, title="Sniffed"), {}, "html", "Sniffed", "", ()),
        (
            "notes.md",
            files.notes_markdown("Notes on harbours"),
            {},
            "markdown",
            "Notes on harbours",
            "tide_table",
            ("**", "](https", "|-------|"),
        ),
        ("plain.txt", b"The granite quay is twelve metres deep.", {}, "text", "plain.txt", "", ()),
        ("t.txt", b"A titled note.", {"title": "Given title"}, "text", "Given title", "", ()),
    ],
)
def test_html_markdown_and_text_files(client, name, data, form, kind, title, kept, dropped):
    reply = send(client, data, name, **form)
    assert reply.status_code == 200, reply.text
    assert (reply.json()["type"], reply.json()["title"]) == (kind, title)
    text = client.get(f"/indexes/{INDEX}/documents/{reply.json()['id']}").json()["text"]
    assert kept in text
    for junk in dropped:
        assert junk not in text


def _bomb_pdf() -> bytes:
    return files.pdf_bytes(["x " * 20] * 25)  # more pages than upload_max_pages


@pytest.mark.parametrize(
    ("name", "data", "form", "status", "reason"),
    [
        ("r.pdf", files.report_pdf(1, 2, 80)[:900], {}, 422, "not a readable PDF"),
        ("s.pdf", files.pdf_bytes(["secret"], encrypt_password="pw"), {}, 422, "encrypted"),
        ("scan.pdf", files.scanned_pdf_bytes(), {}, 422, "no OCR"),
        ("long.pdf", _bomb_pdf(), {}, 413, "more than 20"),
        ("e.html", b"<html><body><nav><a href='/'></a></nav></body></html>", {}, 422, "no text"),
        ("a.txt", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, {}, 415, "PNG image"),
        ("a.zip", b"PK\x03\x04" + b"\x00" * 64, {}, 415, "zip archive"),
        ("a.txt", "caf\xe9".encode("latin-1"), {}, 415, "not UTF-8"),
        ("a.txt", b"", {}, 422, "empty"),
        ("a.txt", b"text", {"metadata": "{not json"}, 422, "metadata is not JSON"),
        ("a.txt", b"text", {"metadata": '{"tags": ["a"]}'}, 422, "metadata.tags"),
        ("a.txt", b"text", {"metadata": "[1]"}, 422, "metadata must be an object"),
        ("a.txt", b"text", {"id": "a/b"}, 422, "id"),
        ("a.txt", b"text", {"colour": "red"}, 422, "colour is not a field"),
    ],
)
def test_bad_files_are_refused_naming_the_reason_and_change_nothing(
    client, name, data, form, status, reason
):
    before = version(client)
    reply = send(client, data, name, **form)
    assert reply.status_code == status, reply.text
    assert reason in reply.text
    assert version(client) == before


def _slow_pdf() -> bytes:
    """20 pages (the module's page limit), each its own content stream of 20,000 operators
    that draw nothing: within every budget, and seconds of interpreting, however fast the
    machine, against the deadline below."""
    page = text_operations("Slow words", 20_000)
    return distinct_streams_pdf([page] * 20)


def test_a_file_read_past_the_deadline_is_refused_and_nothing_written(
    backends, client, redis_server
):
    """OPENBOOK_GATEWAY_UPLOAD_MAX_SECONDS (30 s by default) bounds the wall time of reading
    any upload: a PDF whose pages take longer is a 413 naming the file and the setting, and
    the index is unchanged. The deadline is set far below what the file takes here, so the
    test holds on any machine."""
    settings = backends.gateway_settings(
        redis_server.url,
        max_document_body_bytes=2 * 1024 * 1024,
        upload_max_pages=20,
        upload_max_seconds=0.01,
    )
    before = version(client)
    with TestClient(create_app(settings)) as hurried:
        reply = send(hurried, _slow_pdf(), "slow.pdf", id="slow")
    assert reply.status_code == 413, reply.text
    assert "file:" in reply.text and "took more than 0.01 s" in reply.text
    assert "OPENBOOK_GATEWAY_UPLOAD_MAX_SECONDS" in reply.text
    assert version(client) == before
    assert client.get(f"/indexes/{INDEX}/documents/slow").status_code == 404


def test_the_body_limit_cuts_the_upload_while_it_streams_and_writes_need_the_token(client):
    before = version(client)

    def chunks():  # no Content-Length: only the streamed count can stop it
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.txt"\r\n\r\n'
        for _ in range(64):
            yield b"word " * 10_000  # 50 KB a chunk, 3 MB in all: past the 2 MiB limit

    too_big = client.post(
        f"/indexes/{INDEX}/documents",
        content=chunks(),
        headers={**AUTH, "Content-Type": "multipart/form-data; boundary=b"},
    )
    assert too_big.status_code == 413, too_big.text
    assert "MAX_DOCUMENT_BODY_BYTES" in too_big.text
    assert send(client, b"text", "a.txt", headers={}).status_code == 401
    not_a_form = client.post(f"/indexes/{INDEX}/documents", json={"text": "x"}, headers=AUTH)
    assert not_a_form.status_code == 415
    assert version(client) == before


def test_openbook_docs_upload_takes_directories_and_archives_and_resumes(
    client, backends, redis_server, tmp_path
):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.md").write_bytes(files.notes_markdown("Upload A"))
    (tree / "b.txt").write_text("The lantern of the ridge burns all night.")
    (tree / ".hidden.txt").write_text("never uploaded")
    (tree / "c.bin").write_bytes(b"\x7fELF" + b"\x00" * 32)
    archive = tmp_path / "more.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("inner/d.html", files.article_html(7, title="Zipped page"))
    tarball = tmp_path / "more.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        member = tarfile.TarInfo("e.txt")
        text = b"The beacon of the atoll is lit at dusk."
        member.size = len(text)
        tar.addfile(member, io.BytesIO(text))
    settings = backends.gateway_settings(redis_server.url)
    with serving_gateway(settings) as url:
        target = GatewayTarget(url, TOKEN, 60)
        first = upload(target, INDEX, [tree, archive, tarball], progress=False)
        assert len(first.uploaded) == 4 and not first.skipped
        assert [r["file"] for r in first.refused] == [str(tree / "c.bin")]
        assert "an executable" in first.refused[0]["error"]
        # the command, again: everything there already is skipped, the refused file reported
        ran = CliRunner().invoke(
            app,
            ["docs", "upload", INDEX, str(tree), str(archive), str(tarball), "--url", url],
            env={"OPENBOOK_ADMIN_TOKEN": TOKEN},
        )
        assert ran.exit_code == 1, ran.output
        summary = json.loads(ran.stdout[ran.stdout.index("{") :])
        assert (summary["uploaded"], summary["skipped"]) == (0, 4)
        assert "1 file(s) refused" in ran.stderr

        bomb = tmp_path / "bomb.zip"
        with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("zeros.txt", b"0" * (4 * 1024 * 1024))  # 4 MB of zeros: a few KB zipped
        assert bomb.stat().st_size < 64 * 1024
        limits = ArchiveLimits(max_file_bytes=1024 * 1024)
        refused = upload(target, INDEX, [bomb], limits=limits, progress=False)
        assert not refused.uploaded and "zip bomb" in refused.refused[0]["error"]

    uploaded = client.get(f"/indexes/{INDEX}/documents/{first.uploaded[2]['id']}").json()
    assert uploaded["title"] == "Zipped page"
    assert uploaded["metadata"]["source"] == f"{archive}!inner/d.html"


def test_a_zip_of_too_many_members_is_refused_before_reading(tmp_path):
    many = tmp_path / "many.zip"
    with zipfile.ZipFile(many, "w") as z:
        for i in range(5):
            z.writestr(f"{i}.txt", "x")
    target = GatewayTarget("http://127.0.0.1:9", TOKEN, 1)  # never reached
    with pytest.raises(Exception, match="more than 3"):
        upload(target, INDEX, [many], limits=ArchiveLimits(max_members=3), progress=False)


def test_a_page_survives_the_merge_of_sharded_results():
    """Over shards the gateway merges results as openbook.types.Passage: the page goes along."""
    from openbook.v1 import common_pb2
    from openbook_gateway import retrieval

    hits = [
        [
            [
                retrieval._to_passage(
                    common_pb2.Passage(id="d#3", title="T", text="x", score=2.0, page=4)
                )
            ]
        ],
        [[retrieval._to_passage(common_pb2.Passage(id="e#0", title="U", text="y", score=1.0))]],
    ]
    merged = [retrieval._to_proto(p) for p in retrieval.merge_results(hits, 2)[0]]
    assert [(p.id, p.page) for p in merged] == [("d#3", 4), ("e#0", 0)]


def test_extraction_stops_at_the_text_limit_page_by_page():
    """A PDF whose text passes the document's limit is refused (413) at the page that passes
    it, without extracting the rest (what bounds a PDF whose streams inflate to much text)."""
    from openbook_gateway.extraction import ExtractionError, ExtractionLimits, extract

    data = files.report_pdf(2, 6, 200)
    with pytest.raises(ExtractionError, match="by page 2") as refused:
        extract(data, "r.pdf", ExtractionLimits(max_chars=2000))
    assert refused.value.status == 413
    assert extract(data, "r.pdf").pages == 6


def _uploaded_text(client, data: bytes, name: str) -> str:
    reply = send(client, data, name)
    assert reply.status_code == 200, reply.text
    document = client.get(f"/indexes/{INDEX}/documents/{reply.json()['id']}")
    assert document.status_code == 200, document.text
    return document.json()["text"]


@pytest.mark.parametrize(
    ("name", "data", "text"),
    [
        # CommonMark: a soft break is a space, two trailing spaces or a backslash a hard one.
        ("s.md", b"# Soft\n\nalpha\nbeta gamma\n", "Soft\n\nalpha beta gamma"),
        (
            "h.md",
            b"Skarvik.\nIt was  \nhere\\\nand *also*\nkept.\n\n- one\n- two\nlines\n",
            "Skarvik. It was\nhere\nand also kept.\n\none\n\ntwo lines",
        ),
        (
            "t.md",
            b"| a | b |\n|---|---|\n| c | d |\n\n```\nx = 1\n\ny = 2\n```\n",
            "a\tb\nc\td\n\nx = 1\n\ny = 2",
        ),
        # HTML: blocks start lines, <br> ends one, inline elements keep words whole.
        (
            "p.html",
            b"<html><body><div>Skarvik.</div><div>It was<br>here</div>"
            b"<p>ex<b>am</b>ple and <a href='/x'>link</a>s</p>"
            b"<div>outer<div>inner</div>tail</div><ul><li>also</li><li>kept</li></ul>"
            b"<table><tr><td>a</td><th>b</th></tr><tr><td>c</td><td>d</td></tr></table>"
            b"<h2>Head</h2><blockquote>Quote</blockquote><pre>code\n  indented</pre>"
            b"<section>one</section><section>two</section></body></html>",
            "Skarvik.\nIt was\nhere\nexample and links\nouter\ninner\ntail\nalso\nkept\n"
            "a\tb\nc\td\nHead\nQuote\ncode\n  indented\none\ntwo",
        ),
    ],
)
def test_words_stay_apart_as_markdown_and_html_render_them(client, name, data, text):
    assert _uploaded_text(client, data, name) == text


def test_a_pdfs_line_ends_are_spaces_and_its_hyphenated_words_whole(client):
    pages = [
        "The granite quay was exam-\nined at dawn by the\nharbour master. Well-\nKnown ferries.",
        "Second page.",
    ]
    text = _uploaded_text(client, files.pdf_bytes(pages, header="", footer=False), "h.pdf")
    assert text == (
        "The granite quay was examined at dawn by the harbour master. Well- Known ferries."
        "\n\nSecond page."
    )


def test_a_content_stream_shared_by_all_pages_is_parsed_once(client, monkeypatch):
    from pypdf.generic import ContentStream

    parses = []
    parse = ContentStream._parse_content_stream

    def counted(self, stream):
        parses.append(1)
        return parse(self, stream)

    monkeypatch.setattr(ContentStream, "_parse_content_stream", counted)
    data = shared_stream_pdf(15, text_operations("Shared quay words", 2000))
    reply = send(client, data, "shared.pdf")
    assert reply.status_code == 200, reply.text
    assert reply.json()["pages"] == 15
    assert len(parses) == 1  # pypdf alone: one parse per page
    text = client.get(f"/indexes/{INDEX}/documents/{reply.json()['id']}").json()["text"]
    assert text == "\n\n".join(["Shared quay words"] * 15)


def test_a_client_gone_before_the_write_gets_nothing_written(client):
    """The client's connection closes right after its body: the file is read, its document
    is not written."""
    data = b"A document nobody waits for: the lantern of the gone client."
    request = httpx.Request(
        "POST",
        f"http://testserver/indexes/{INDEX}/documents",
        files={"file": ("gone.txt", data)},
        headers=AUTH,
    )
    body = request.read()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": request.url.path,
        "raw_path": request.url.raw_path,
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "client": ("testclient", 50000),
        "server": ("testserver", 80),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send_message(message: dict) -> None:
        sent.append(message)

    before = version(client)
    client.portal.call(client.app, scope, receive, send_message)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert starts and starts[0]["status"] == 499, sent
    assert version(client) == before
    doc_id, _ = content_id(data)
    assert client.get(f"/indexes/{INDEX}/documents/{doc_id}").status_code == 404


def test_the_openapi_document_describes_the_multipart_form():
    """The upload's body, which the route parses itself, is in the OpenAPI document as the
    form it reads: a required binary ``file``, optional text ``id``, ``title``, ``metadata``,
    nothing else."""
    from openbook_gateway.settings import GatewaySettings

    operation = create_app(GatewaySettings()).openapi()["paths"]["/indexes/{index}/documents"]
    body = operation["post"]["requestBody"]
    assert body["required"] is True and list(body["content"]) == ["multipart/form-data"]
    schema = body["content"]["multipart/form-data"]["schema"]
    assert set(schema["properties"]) == {"file", "id", "title", "metadata"}
    assert schema["required"] == ["file"] and schema["additionalProperties"] is False
    file = schema["properties"]["file"]
    assert file["type"] == "string" and file["contentMediaType"] == "application/octet-stream"
    for text in ("id", "title", "metadata"):
        assert {"type": "string"} in [
            {k: v for k, v in option.items() if k == "type"}
            for option in schema["properties"][text]["anyOf"]
        ]
