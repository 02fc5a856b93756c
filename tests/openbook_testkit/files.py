"""Real-world-shaped files, made on the spot, for the upload tests and the extraction benchmark
(no binary fixture is committed): multi-page PDFs with a running header, a footer with the page
number and a title in their metadata (fpdf2), HTML pages with navigation, a sidebar and a
footer around an article, Markdown with headings, code and a table.

Every generator is deterministic in its arguments: the same call gives the same bytes (fpdf2
writes a fixed creation date here), so a content-hash id is stable across runs.
"""

from __future__ import annotations

import datetime as dt
import html
import random

from fpdf import FPDF

_VOCABULARY = """river harbour lantern granite meadow orchard compass glacier beacon quarry ferry
summit canyon delta prairie tundra reef atoll fjord marsh basin ridge valley plateau estuary
lagoon dune steppe savanna grove spring brook cove"""
_WORDS = tuple(_VOCABULARY.split())
FIXED_DATE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def sentences(seed: int, n_words: int) -> str:
    """``n_words`` words of filler prose, in sentences, from ``seed``."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n_words):
        word = rng.choice(_WORDS)
        out.append(word.capitalize() if i % 12 == 0 else word)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out) + "."


def pdf_bytes(
    pages: list[str],
    *,
    title: str | None = "A report",
    header: str = "ACME Corp - internal",
    footer: bool = True,
    encrypt_password: str | None = None,
) -> bytes:
    """A PDF with one page per string of ``pages`` (text wrapped as a word processor would),
    a running header and a "Page n of N" footer on each; ``title`` in its metadata."""

    class _Report(FPDF):
        def header(self) -> None:
            if header:
                self.set_font("Helvetica", size=8)
                self.cell(0, 8, header, align="R")
                self.ln(10)

        def footer(self) -> None:
            if footer:
                self.set_y(-15)
                self.set_font("Helvetica", size=8)
                self.cell(0, 10, f"Page {self.page_no()} of {{nb}}", align="C")

    pdf = _Report()
    pdf.set_creation_date(FIXED_DATE)
    if title:
        pdf.set_title(title)
    if encrypt_password is not None:
        pdf.set_encryption(owner_password="owner", user_password=encrypt_password)
    pdf.set_font("Helvetica", size=11)
    for text in pages:
        pdf.add_page()
        if text:
            pdf.multi_cell(0, 6, text)
    return bytes(pdf.output())


def scanned_pdf_bytes(n_pages: int = 2) -> bytes:
    """A PDF whose pages hold only drawings: no text layer, as a scan has none."""
    pdf = FPDF()
    pdf.set_creation_date(FIXED_DATE)
    for _ in range(n_pages):
        pdf.add_page()
        pdf.rect(20, 20, 150, 200, style="F")
    return bytes(pdf.output())


def report_pdf(seed: int, n_pages: int, words_per_page: int = 350) -> bytes:
    """A report of ``n_pages`` pages of prose, each page's first sentence naming the page."""
    pages = [
        f"Section {n}. " + sentences(seed * 1000 + n, words_per_page) for n in range(1, n_pages + 1)
    ]
    return pdf_bytes(pages, title=f"Report {seed}")


def article_html(seed: int, n_paragraphs: int = 8, *, title: str = "Field notes") -> bytes:
    """A web page: a navigation bar, a sidebar, cookie banner and footer around one article."""
    nav = "".join(f'<li><a href="/s{i}">Section {i} menu</a></li>' for i in range(12))
    body = "".join(
        f"<p>{html.escape(sentences(seed * 100 + i, 80))}</p>" for i in range(n_paragraphs)
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<script>var tracking = "navigation script text";</script><style>body {{ margin: 0 }}</style>
</head><body>
<header><nav><ul>{nav}</ul></nav><div class="banner">Accept cookies? Subscribe now!</div></header>
<aside class="sidebar"><h3>Related</h3><ul><li><a href="/x">Sidebar link one</a></li>
<li><a href="/y">Sidebar link two</a></li></ul></aside>
<main><article><h1>{html.escape(title)}</h1>{body}</article></main>
<footer><p>Copyright footer text. All rights reserved.</p><a href="/privacy">Privacy</a></footer>
</body></html>"""
    return page.encode()


def notes_markdown(title: str = "Notes on harbours") -> bytes:
    """Markdown with a heading, emphasis, a link, a list, a code block and a table."""
    return f"""# {title}

The **harbour** at the *delta* was [charted](https://example.org/chart) in spring.

- granite quay
- lantern beacon

```
tide_table = load("harbour")
```

| place | depth |
|-------|-------|
| quay  | 12 m  |
""".encode()
