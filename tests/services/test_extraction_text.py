"""Bounded work for every byte of an upload (openbook_gateway.extraction), in process: the
route's own tests (test_gateway_uploads.py) drive the same code through the gateway.

What is checked, by counting, never by timing: a 4 MB Markdown list is refused before it is
parsed, with memory about its size; Markdown under the bound is parsed in pieces, whose text is
the whole parse's (fences, HTML blocks and link references across pieces included), with memory
a small multiple of the input rather than markdown-it's ~500 bytes per character; HTML is read
with memory a small multiple of the input (a child process's peak RSS; lxml's memory is not
Python's); a PDF whose pages share one content stream parses it once, and its operators,
content bytes, the deadline and the cancel event each stop it with a 4xx naming ``file``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import pytest
from pypdf.generic import ContentStream

from openbook_gateway import extraction
from openbook_gateway.extraction import (
    CANCELLED_STATUS,
    ExtractionError,
    ExtractionLimits,
    extract,
)
from openbook_testkit.crafted_pdf import distinct_streams_pdf, shared_stream_pdf, text_operations


def _peak_traced(fn):
    """``fn()``'s result (or the ExtractionError it raised) and its peak of traced memory."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except ExtractionError as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_4mb_markdown_list_is_refused_before_it_is_parsed():
    data = b"- a\n" * (1 << 20)  # took 49 s and 2.26 GB before its 413, parsed whole
    refused, peak = _peak_traced(lambda: extract(data, "list.md"))
    assert isinstance(refused, ExtractionError) and refused.status == 413
    assert str(refused).startswith("file:") and "more than 1000000" in str(refused)
    assert peak < 2 * len(data)  # the decoded source, nothing more


def test_a_pdfs_pages_do_not_keep_their_parsed_operators():
    """The reader keeps every page; a page that kept its parsed content stream kept every
    page's operators alive (~400 MB for 1,000 pages of 5,000 operators: ~80 B an operator,
    ~160 KB for each page of 2,000 here). What each page adds now is the reader's own page
    objects (~20 KB measured). Compared as the growth per page between 6 and 120 pages, not as
    a ratio of peaks: tracemalloc also counts other threads' allocations (a suite's leftover
    servers), which moved a ratio of two small peaks past its bound once."""
    page = text_operations("Page words", 2_000)
    few, few_peak = _peak_traced(lambda: extract(distinct_streams_pdf([page] * 6), "f.pdf"))
    many, many_peak = _peak_traced(lambda: extract(distinct_streams_pdf([page] * 120), "m.pdf"))
    assert few.pages == 6 and many.pages == 120
    per_page = (many_peak - few_peak) / (120 - 6)
    assert per_page < 64 * 2**10, (few_peak, many_peak)


def test_markdown_is_parsed_in_pieces_with_bounded_memory(monkeypatch):
    data = b"- a\n" * 8192
    monkeypatch.setattr(extraction, "MARKDOWN_CHUNK_CHARS", 2048)
    pieces, peak = _peak_traced(lambda: extract(data, "list.md"))
    monkeypatch.setattr(extraction, "MARKDOWN_CHUNK_CHARS", 1 << 20)
    whole, whole_peak = _peak_traced(lambda: extract(data, "list.md"))
    assert pieces.text == whole.text == "\n\n".join(["a"] * 8192)
    # Parsed whole, markdown-it holds ~500 bytes per character; in pieces, one piece's worth.
    assert whole_peak > 200 * len(data)
    assert peak < 50 * len(data)


def test_markdown_past_the_text_limit_stops_at_the_piece_that_passes_it(monkeypatch):
    monkeypatch.setattr(extraction, "MARKDOWN_CHUNK_CHARS", 1024)
    parsed = []
    parse = extraction._MARKDOWN.parse
    monkeypatch.setattr(
        extraction._MARKDOWN, "parse", lambda src, env=None: parsed.append(src) or parse(src, env)
    )
    with pytest.raises(ExtractionError, match="passes a document's 3000 characters") as refused:
        extract(
            b"word " * 400 + b"\n\n" + b"- a\n" * 2000,
            "l.md",
            ExtractionLimits(max_chars=3000, max_markdown_source_ratio=10),
        )
    assert refused.value.status == 413
    assert sum(map(len, parsed)) < 6000  # of the 10,000 characters: it stopped


DOCUMENT = textwrap.dedent(
    """\
    # Pieces

    A [reference][far] used before its definition.

    ```python
    def f():

    x = 1

    ```

    <!-- a comment

    # not a heading
    -->

    Soft
    break and hard\\
    break.

    """
)


@pytest.mark.parametrize("piece", [64, 100, 200])
def test_pieces_keep_fences_html_blocks_and_references_whole(monkeypatch, piece):
    source = DOCUMENT + "filler paragraph.\n\n" * 20 + "[far]: https://example.org\n"
    monkeypatch.setattr(extraction, "MARKDOWN_CHUNK_CHARS", 1 << 20)
    whole = extract(source.encode(), "d.md")
    monkeypatch.setattr(extraction, "MARKDOWN_CHUNK_CHARS", piece)
    chunks = list(extraction._markdown_chunks(source))
    assert len(chunks) > 2 and max(map(len, chunks)) <= piece
    pieces = extract(source.encode(), "d.md")
    assert pieces.text == whole.text and pieces.title == "Pieces"
    assert "A reference used before" in pieces.text and "[far]" not in pieces.text
    assert "def f():\n\nx = 1" in pieces.text
    assert "not a heading" not in pieces.text
    assert "Soft break and hard\nbreak." in pieces.text


def test_a_fence_longer_than_a_piece_is_opened_again_in_the_next(monkeypatch):
    code = "".join(f"line_{i} = {i}\n" for i in range(60))
    source = f"Before.\n\n```\n{code}```\n\nAfter.\n"
    monkeypatch.setattr(extraction, "MARKDOWN_CHUNK_CHARS", 256)
    chunks = list(extraction._markdown_chunks(source))
    assert len(chunks) > 3 and all(c.startswith(("```", "Before")) for c in chunks[:-1])
    text = extract(source.encode(), "f.md").text
    assert text.startswith("Before.\n\nline_0 = 0\n") and text.endswith("line_59 = 59\n\nAfter.")
    assert all(f"line_{i} = {i}" in text for i in range(60))


_RSS_CHILD = """
import sys
from openbook_gateway.extraction import extract


def status(key):  # kB; VmHWM is this process's peak RSS (ru_maxrss keeps its parent's)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


data = b"<html><body><ul>" + b"<li>a</li>" * int(sys.argv[1]) + b"</ul></body></html>"
try:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak from here on
except OSError:
    pass
rss = status("VmRSS")
extracted = extract(data, "list.html")
assert extracted.text == "\\n".join(["a"] * int(sys.argv[1])), extracted.text[:100]
print(len(data), status("VmHWM") - rss)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_html_is_read_with_memory_a_small_multiple_of_its_size():
    """4 MB of list items: lxml's whole tree alone is ~29 bytes a byte (trafilatura ~130);
    read by the pull parser, each element dropped when done, the decoded page and its text."""
    ran = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, "400000"], capture_output=True, text=True, check=True
    )
    size, grown = map(int, ran.stdout.split())
    assert grown < 10 * size, (size, grown)


def test_html_past_the_text_limit_is_refused_naming_the_limit():
    data = b"<html><body>" + b"<p>word word</p>" * 1000 + b"</body></html>"
    with pytest.raises(ExtractionError, match="passes a document's 5000 characters") as refused:
        extract(data, "p.html", ExtractionLimits(max_chars=5000))
    assert refused.value.status == 413


def test_html_keeps_the_main_content_without_boilerplate():
    data = (
        b"<!doctype html><html><head><title>Page</title><style>p{}</style></head><body>"
        b"<header><nav><a href='/'>Home menu</a></nav></header>"
        b"<div class='cookie-banner'>Accept cookies</div>"
        b"<main><article><header><h1>The quay</h1></header><p>Deep <em>water</em>.</p>"
        b"<div class='share'>Share this</div></article></main>"
        b"<aside>Related links</aside><footer>Copyright</footer><script>var x;</script>"
        b"</body></html>"
    )
    extracted = extract(data, "page.html")
    assert (extracted.title, extracted.text) == ("Page", "The quay\nDeep water.")
    # No main element: the body without boilerplate; nothing but boilerplate: all of it.
    assert extract(b"<html><body><nav>Menu</nav><p>Body</p></body></html>").text == "Body"
    assert extract(b"<html><body><nav>Only a menu</nav></body></html>").text == "Only a menu"


@pytest.fixture
def parses(monkeypatch):
    counted: list[int] = []
    parse = ContentStream._parse_content_stream

    def counting(self, stream):
        counted.append(1)
        return parse(self, stream)

    monkeypatch.setattr(ContentStream, "_parse_content_stream", counting)
    return counted


def test_a_content_stream_shared_by_many_pages_is_parsed_once(parses):
    data = shared_stream_pdf(60, text_operations("Shared harbour words", 3000))
    extracted = extract(data, "shared.pdf")
    assert extracted.page_words == (3,) * 60
    assert len(parses) == 1  # pypdf alone parses it once a page: 60 times


def test_a_pdf_past_its_operator_budget_is_refused_naming_the_page(parses):
    data = shared_stream_pdf(60, text_operations("Shared harbour words", 3000))
    with pytest.raises(ExtractionError, match=r"file: .* more than 30000 content operations"):
        try:
            extract(data, "shared.pdf", ExtractionLimits(max_pdf_operations=30_000))
        except ExtractionError as exc:
            assert exc.status == 413 and "by page 5" in str(exc)  # 6,005 a page
            raise
    assert len(parses) == 1


def test_a_pdf_past_its_content_budget_is_refused():
    data = shared_stream_pdf(2, text_operations("Words", 3000))  # ~18 KB of content
    with pytest.raises(ExtractionError, match="more than 1000 bytes of content") as refused:
        extract(data, "p.pdf", ExtractionLimits(max_pdf_content_bytes=1000))
    assert refused.value.status == 413


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("shared.pdf", shared_stream_pdf(5, text_operations("Shared words", 10_000))),
        ("list.md", b"- a\n\n" * 20_000),
        ("page.html", b"<html><body>" + b"<p>word</p>" * 20_000 + b"</body></html>"),
    ],
)
def test_the_deadline_and_the_cancel_event_stop_every_kind(name, data):
    with pytest.raises(ExtractionError, match="took more than 0 s") as late:
        extract(data, name, ExtractionLimits(max_seconds=0))
    assert late.value.status == 413 and str(late.value).startswith("file:")
    gone = threading.Event()
    gone.set()
    with pytest.raises(ExtractionError, match="the client went away") as cancelled:
        extract(data, name, cancel=gone)
    assert cancelled.value.status == CANCELLED_STATUS
