"""Text out of an uploaded file: plain text, Markdown, HTML or PDF (issue 33).

What a file is comes from its content, never only from its name: a PDF is a PDF by its
``%PDF-`` header whatever it is called; the binary types people upload by mistake (archives,
images, office files) are recognised by their magic bytes and refused by name; anything else
must decode as UTF-8 text, and is HTML if it looks like HTML (a doctype or an ``<html>``,
``<head>`` or ``<body>`` tag near the start), Markdown if its name says so, plain text
otherwise. The parsing itself is the libraries': ``pypdf`` (a PDF's text layer), ``lxml``'s
pull parser (an HTML page's text, as a browser lays out its blocks) and ``markdown-it-py``
(Markdown's tokens, whose text is kept and markup dropped).

Words stay apart as a reader sees them: Markdown's soft line breaks are a space, its hard
breaks (two trailing spaces, a backslash) a newline, its blocks (paragraphs, headings, list
items, code) a blank line apart, as CommonMark renders them; HTML's ``<br>`` is a newline,
its block elements (``p``, ``div``, ``li``, ``h1``-``h6``, ``tr``, ``blockquote``, ``pre``,
``section``...) start and end lines, table cells are a tab apart and inline elements
(``b``, ``a``, ``span``...) never split a word; a PDF's line end is a space, a hyphen at a
line end between two letters joins the word (``exam-`` / ``ple``: ``example``), a blank line
in its text layer is a new line and pages are a blank line apart.

Invariants:
  * :func:`extract` either returns an :class:`Extracted` whose text holds at least one word,
    at most :attr:`ExtractionLimits.max_chars` characters and no control character but tab,
    newline and carriage return (what ``openbook.validation.limits.check_document_text`` takes), and
    a title that ``check_document_title`` takes (possibly empty), or raises
    :class:`ExtractionError` with the HTTP status and a message naming the reason. Nothing
    here writes anywhere: a refused file leaves the index unchanged.
  * Work and memory are bounded by the input and the limits, not by what a file claims or
    how its markup nests: a Markdown source past ``max_markdown_source_ratio`` times
    ``max_chars`` characters is refused before it is parsed, and a smaller one is parsed in
    blocks of at most :data:`MARKDOWN_CHUNK_CHARS` (cut at blank lines outside code fences
    and HTML blocks), so the parser's tokens for one block at a time are alive; HTML is read
    by a pull parser whose finished elements are dropped as it goes; both stop as soon as
    their text passes ``max_chars``. A PDF with more than ``max_pages`` pages is refused
    before any page is read; its pages are read one by one against a budget of decoded
    content-stream bytes parsed (``max_pdf_content_bytes``; a stream shared by several
    pages is parsed once, see :class:`_PdfContents`) and of content operators interpreted
    (``max_pdf_operations``); pypdf's own decompression limits (``ZLIB_MAX_OUTPUT_LENGTH``
    and friends) stop a stream bomb inside one page. Every kind is read under a deadline
    (``max_seconds``) and a ``cancel`` event (the gateway sets it when the client goes),
    checked between Markdown blocks, HTML chunks, PDF pages and every few thousand PDF
    operators: past either, a 413 (budget, deadline) or :data:`CANCELLED_STATUS`.
  * A PDF's ``page_words`` has one entry per page: the number of whitespace-separated words of
    that page's text, in order; their sum is the number of words of ``text`` (pages are joined
    by a blank line). The document's passages are cut page by page from it
    (``openbook.validation.limits.PAGE_WORDS_KEY``), so no passage spans two pages and each knows
    its page.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pypdf
from lxml import etree
from markdown_it import MarkdownIt
from markdown_it.token import Token
from pypdf.generic import ArrayObject, ContentStream, IndirectObject, NameObject

from openbook.errors import InvalidArgument
from openbook.validation.limits import MAX_DOCUMENT_TEXT_CHARS, MAX_DOCUMENT_TITLE_CHARS

KINDS = ("text", "markdown", "html", "pdf")
MARKDOWN_SUFFIXES = (".md", ".markdown", ".mdown", ".mkd")
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
# How far into a file its type is looked for: a PDF's header may follow up to 1 KiB of junk
# (the PDF spec allows it, and some producers write it); HTML's first tag is near the start.
SNIFF_BYTES = 1024
# Magic bytes of what people upload by mistake, refused by name (415) rather than as "not
# UTF-8": the message then says what the file is. Archives go through `openbook docs upload`,
# which unpacks them with bounds on size and member count (openbook_cli.docs_upload).
REFUSED_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", "a zip archive (or an office file): unpack it with `openbook docs upload`"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x1f\x8b", "a gzip file: unpack it with `openbook docs upload`"),
    (b"BZh", "a bzip2 file"),
    (b"\xfd7zXZ\x00", "an xz file"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive"),
    (b"Rar!\x1a\x07", "a rar archive"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image (no OCR)"),
    (b"\xff\xd8\xff", "a JPEG image (no OCR)"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"II*\x00", "a TIFF image (no OCR)"),
    (b"MM\x00*", "a TIFF image (no OCR)"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old office file (doc, xls, ppt)"),
    (b"\x7fELF", "an executable"),
    (b"MZ", "an executable"),
    (b"{\\rtf", "an RTF file"),
)
# The status of an extraction stopped because the client went away (nginx's "client closed
# request"): nobody reads the answer, the log does.
CANCELLED_STATUS = 499
# Markdown is parsed a block of at most this many characters at a time: markdown-it keeps
# ~500 bytes of tokens and line tables per source character while it parses, and some
# inputs (long lists) cost it more than linear time in the size of what it parses at once.
MARKDOWN_CHUNK_CHARS = 32 * 1024
# HTML is fed to the pull parser in pieces of this many characters.
HTML_FEED_CHARS = 64 * 1024
# How many PDF content operators run between two checks of the deadline and the cancel event.
PDF_CHECK_EVERY = 4096
# A shared content stream stays parsed for the pages after it while the parsed ones (decoded
# bytes) stay under this; past it a stream is parsed again, and charged again, for each page.
PDF_SHARED_CACHE_BYTES = 8 * 1024 * 1024

_HTML_START = re.compile(rb"<(!doctype\s+html|html[\s>]|head[\s>]|body[\s>])", re.IGNORECASE)
_SPACES = re.compile(r"\s+")
_BLANK_LINES = re.compile(r"\n{3,}")
# Unicode's control characters (category Cc: C0, DEL, C1) but tab, newline, carriage return.
_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class ExtractionLimits:
    """How much one file may give and cost. ``max_pages`` bounds a PDF's page count (and so
    the per-page word map kept in the document's metadata); ``max_chars`` the text
    extracted; ``max_markdown_source_ratio`` a Markdown source's characters, as a multiple of
    ``max_chars``, before it is parsed; ``max_pdf_content_bytes`` the decoded content-stream
    bytes parsed over all pages, ``max_pdf_operations`` the content operators interpreted
    (each page's, and its form XObjects'); ``max_seconds`` the wall time of one extraction."""

    max_pages: int = 1000
    max_chars: int = MAX_DOCUMENT_TEXT_CHARS
    # 1: a Markdown source of at most max_chars characters. markdown-it-py parses ~10-20 µs
    # a character on its worst inputs (long lists), so twice that took ~30 s here
    # (docs/benchmarks.md, bench/ingest/extraction_worst.py).
    max_markdown_source_ratio: float = 1.0
    max_pdf_content_bytes: int = 64 * 1024 * 1024
    max_pdf_operations: int = 5_000_000
    max_seconds: float = 30.0  # OPENBOOK_GATEWAY_UPLOAD_MAX_SECONDS


@dataclass(frozen=True)
class Extracted:
    """A file's text. ``title`` is the document's own ("" if it names none); ``page_words``
    is set for PDFs only (see the module's invariants)."""

    kind: str
    title: str
    text: str
    page_words: tuple[int, ...] = ()

    @property
    def pages(self) -> int:
        return len(self.page_words)


class ExtractionError(InvalidArgument):
    """A file that gives no document; ``status`` is the HTTP status the gateway answers
    (415: not a type openbook reads; 413: more than the limits; 422: unreadable or empty;
    :data:`CANCELLED_STATUS`: the client went away)."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


class _Budget:
    """The deadline and the cancel event of one extraction, checked between its steps."""

    def __init__(self, limits: ExtractionLimits, cancel: threading.Event | None) -> None:
        self.limits = limits
        self.cancel = cancel
        self.deadline = time.monotonic() + limits.max_seconds

    def check(self, where: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise ExtractionError(
                f"file: reading it stopped at {where}: the client went away; nothing was written",
                CANCELLED_STATUS,
            )
        if time.monotonic() >= self.deadline:
            raise ExtractionError(
                f"file: reading it took more than {self.limits.max_seconds:g} s "
                f"(stopped at {where}; OPENBOOK_GATEWAY_UPLOAD_MAX_SECONDS): split it",
                413,
            )

    def too_long(self) -> ExtractionError:
        return ExtractionError(
            f"file: its text passes a document's {self.limits.max_chars} characters: split it",
            413,
        )


def detect_kind(data: bytes, filename: str = "") -> str:
    """One of :data:`KINDS`, from the content (the name only tells Markdown from plain text);
    :class:`ExtractionError` (415) for anything else."""
    head = data[:SNIFF_BYTES]
    if b"%PDF-" in head:
        return "pdf"
    for magic, what in REFUSED_MAGIC:
        if head.startswith(magic):
            raise ExtractionError(f"file: unsupported type, the content is {what}", 415)
    if b"\x00" in head:
        raise ExtractionError("file: unsupported type, the content is binary", 415)
    name = filename.lower()
    if _HTML_START.search(head.lstrip()[:SNIFF_BYTES]) or (
        name.endswith(HTML_SUFFIXES) and b"<" in head
    ):
        return "html"
    if name.endswith(MARKDOWN_SUFFIXES):
        return "markdown"
    return "text"


def extract(
    data: bytes,
    filename: str = "",
    limits: ExtractionLimits | None = None,
    cancel: threading.Event | None = None,
) -> Extracted:
    """The text and title of one uploaded file (see the module's invariants); ``cancel``, once
    set (from another thread), stops the extraction at its next check."""
    limits = limits or ExtractionLimits()
    budget = _Budget(limits, cancel)
    if not data:
        raise ExtractionError("file: the file is empty")
    kind = detect_kind(data, filename)
    if kind == "pdf":
        return _pdf(data, limits, budget)
    text = _decoded(data)
    if kind == "html":
        extracted = _html(text, budget)
    elif kind == "markdown":
        extracted = _markdown(text, budget)
    else:
        extracted = Extracted("text", "", text)
    return _checked(extracted, limits)


def _decoded(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ExtractionError(
            f"file: unsupported type, not a PDF and not UTF-8 text (byte {exc.start})", 415
        ) from None


def _clean(text: str) -> str:
    """``text`` without the control characters a document may not hold (tab, newline and
    carriage return stay): PDFs and web pages carry stray ones, a document must not."""
    return _CONTROLS.sub(" ", text)


def _normalized(block: str) -> str:
    """One block as :func:`_checked` leaves it: so blocks joined by at most a blank line and
    then checked are as long as the sum of their lengths and separators."""
    return _BLANK_LINES.sub("\n\n", _clean(block)).strip()


def clean_title(title: str) -> str:
    """A title as ``check_document_title`` takes it: one line, at most its length."""
    return _SPACES.sub(" ", _clean(title)).strip()[:MAX_DOCUMENT_TITLE_CHARS]


def _checked(extracted: Extracted, limits: ExtractionLimits) -> Extracted:
    text = _BLANK_LINES.sub("\n\n", _clean(extracted.text)).strip()
    if len(text) > limits.max_chars:
        raise ExtractionError(
            f"file: its text has {len(text)} characters, more than a document's "
            f"{limits.max_chars}: split it",
            413,
        )
    if not text.split():
        raise ExtractionError(f"file: the {extracted.kind} file holds no text")
    return Extracted(extracted.kind, clean_title(extracted.title), text, extracted.page_words)


class _Blocks:
    """Text blocks in order, each normalized, joined by ``separator``; ``over`` once their
    joined length passes ``limit`` (a few characters of slack: the final check is exact),
    after which nothing more is kept, so what is kept stays within the limit. ``pack`` joins
    the blocks kept so far into one string, so many short blocks do not cost an object
    each."""

    def __init__(self, limit: int, separator: str) -> None:
        self.limit = limit
        self.separator = separator
        self.packed: list[str] = []
        self.blocks: list[str] = []
        self.count = 0
        self.last_empty = True  # so no empty block comes first
        self.chars = 0
        self.over = False
        self.words = False

    def add(self, block: str, *, empty: bool = False) -> None:
        """Keep ``block``; an empty one only if ``empty`` (an HTML ``<br>``'s blank line),
        never two in a row nor first."""
        block = _normalized(block)
        if self.over or (not block and (not empty or self.last_empty)):
            return
        self.chars += len(block) + (len(self.separator) if self.count else 0)
        if self.chars > self.limit + 2:
            self.over = True
            return
        self.blocks.append(block)
        self.count += 1
        self.last_empty = not block
        self.words = self.words or bool(block)

    def pack(self) -> None:
        if self.blocks:
            self.packed.append(self.separator.join(self.blocks))
            self.blocks = []

    def text(self) -> str:
        self.pack()
        return self.separator.join(self.packed)


# --- Markdown ------------------------------------------------------------------------------

# A line that opens or closes a fenced code block (CommonMark: up to three spaces, then three
# or more backticks or tildes).
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
# The HTML blocks that run past a blank line (CommonMark's kinds 1-5), with what ends each.
_HTML_BLOCK_OPEN: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...] = (
    (
        re.compile(r" {0,3}<(script|pre|style|textarea)(\s|>|$)", re.IGNORECASE),
        re.compile(r"</(script|pre|style|textarea)>", re.IGNORECASE),
    ),
    (re.compile(r" {0,3}<!--"), re.compile(r"-->")),
    (re.compile(r" {0,3}<\?"), re.compile(r"\?>")),
    (re.compile(r" {0,3}<![A-Za-z]"), re.compile(r">")),
    (re.compile(r" {0,3}<!\[CDATA\["), re.compile(r"\]\]>")),
)
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]+\]:", re.MULTILINE)
_MARKDOWN = MarkdownIt("commonmark").enable("table")


def _markdown_chunks(source: str) -> Iterator[str]:
    """``source`` in pieces of at most :data:`MARKDOWN_CHUNK_CHARS` characters (a line longer
    than that is cut at a space), each ending where a block ends: after a blank line whose
    next line starts at column 0 (no list item, quote or indented code runs on past it),
    outside a fenced code block and an HTML block that runs past blank lines. Where no such
    place is in reach the piece ends at its last line end, and a fence it leaves open is
    opened again at the start of the next piece, so code stays code."""
    start = 0
    reopen = ""  # the fence line the next piece starts with, if the last one cut a fence
    n = len(source)
    while start < n:
        if n - start + len(reopen) <= MARKDOWN_CHUNK_CHARS:
            yield reopen + source[start:]
            return
        end_of_window = start + MARKDOWN_CHUNK_CHARS - len(reopen)
        fence = _FENCE.match(reopen.rstrip("\n")) if reopen else None
        fence_mark = fence.group(1) if fence else ""
        html_end: re.Pattern[str] | None = None
        last_cut = -1  # the last safe place seen: a blank line, then a line at column 0
        last_line_end = -1
        cut_state: tuple[str, str] = ("", "")  # (fence mark, fence line) open at last_line_end
        fence_line = reopen.rstrip("\n")
        previous_blank = False
        pos = start
        while pos < end_of_window:
            newline = source.find("\n", pos, end_of_window)
            if newline < 0:
                break
            line = source[pos:newline]
            blank = not line.strip()
            if previous_blank and not fence_mark and html_end is None and line[:1].strip():
                last_cut = pos
            if fence_mark:
                closing = _FENCE.match(line)
                if (
                    closing
                    and closing.group(1)[0] == fence_mark[0]
                    and len(closing.group(1)) >= len(fence_mark)
                    and not closing.group(2).strip()
                ):
                    fence_mark = ""
            elif html_end is not None:
                if html_end.search(line):
                    html_end = None
            else:
                opening = _FENCE.match(line)
                if opening and not (opening.group(1)[0] == "`" and "`" in opening.group(2)):
                    fence_mark, fence_line = opening.group(1), line[:200]
                else:
                    for opens, ends in _HTML_BLOCK_OPEN:
                        found = opens.match(line)
                        if found:
                            if not ends.search(line, found.end()):
                                html_end = ends
                            break
            previous_blank = blank
            pos = newline + 1
            last_line_end = pos
            cut_state = (fence_mark, fence_line)
        if last_cut > start:
            yield reopen + source[start:last_cut]
            start, reopen = last_cut, ""
        elif last_line_end > start:
            yield reopen + source[start:last_line_end]
            start = last_line_end
            reopen = cut_state[1] + "\n" if cut_state[0] else ""
        else:  # one line longer than a piece: cut it at its last space, else anywhere
            space = source.rfind(" ", start, end_of_window)
            cut = space + 1 if space > start else end_of_window
            yield reopen + source[start:cut]
            start, reopen = cut, ""


def _inline_text(token: Token) -> str:
    """An inline token's text as CommonMark renders it: a soft break is a space, a hard
    break a newline, markup (emphasis, links, raw HTML, images) dropped."""
    parts: list[str] = []
    for child in token.children or ():
        if child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type == "softbreak":
            parts.append(" ")
        elif child.type == "hardbreak":
            parts.append("\n")
    return "".join(parts)


def _markdown(source: str, budget: _Budget) -> Extracted:
    """Markdown's text without its markup: every inline run, code block and table row as
    text, block by block a blank line apart (a table's cells a tab apart, its rows a line);
    the first heading is the title. Parsed in pieces (:func:`_markdown_chunks`); link
    reference definitions are gathered from all pieces first when there is more than one."""
    limits = budget.limits
    most = int(limits.max_markdown_source_ratio * limits.max_chars)
    if len(source) > most:
        raise ExtractionError(
            f"file: the Markdown source has {len(source)} characters, more than {most} "
            f"({limits.max_markdown_source_ratio:g} times a document's text limit): split it",
            413,
        )
    env: dict[str, Any] = {}
    if len(source) > MARKDOWN_CHUNK_CHARS and _REFERENCE_DEFINITION.search(source):
        # A reference may be used before, and so in a piece before, its definition.
        for number, chunk in enumerate(_markdown_chunks(source), start=1):
            budget.check(f"Markdown block {number}")
            _MARKDOWN.block.parse(chunk, _MARKDOWN, env, [])
    out = _Blocks(limits.max_chars, "\n\n")
    title = ""
    for number, chunk in enumerate(_markdown_chunks(source), start=1):
        budget.check(f"Markdown block {number}")
        tokens = _MARKDOWN.parse(chunk, env)
        in_heading = False
        row: list[str] | None = None
        table: list[str] = []
        for token in tokens:
            kind = token.type
            if kind == "heading_open":
                in_heading = True
            elif kind == "heading_close":
                in_heading = False
            elif kind == "tr_open":
                row = []
            elif kind == "tr_close":
                table.append("\t".join(row or ()))
                row = None
            elif kind == "table_close":
                out.add("\n".join(table))
                table = []
            elif kind == "inline":
                text = _inline_text(token)
                if row is not None:
                    row.append(_SPACES.sub(" ", text).strip())
                    continue
                if in_heading and not title:
                    title = text
                out.add(text)
            elif kind in ("fence", "code_block"):
                out.add(token.content)
        del tokens
        out.pack()
        if out.over:
            raise budget.too_long()
    return Extracted("markdown", title, out.text())


# --- HTML ----------------------------------------------------------------------------------

# Elements that start and end a line (HTML's block-level and list, table and form boxes).
_HTML_BLOCKS = frozenset(
    [
        "address",
        "article",
        "aside",
        "blockquote",
        "body",
        "caption",
        "center",
        "dd",
        "details",
        "dialog",
        "dir",
        "div",
        "dl",
        "dt",
        "fieldset",
        "figcaption",
        "figure",
        "footer",
        "form",
        "frameset",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "header",
        "hgroup",
        "hr",
        "html",
        "legend",
        "li",
        "main",
        "menu",
        "nav",
        "ol",
        "optgroup",
        "option",
        "p",
        "pre",
        "search",
        "section",
        "summary",
        "table",
        "tbody",
        "tfoot",
        "thead",
        "tr",
        "ul",
    ]
)
_HTML_CELLS = frozenset(("td", "th"))
# Never text: code, styles, embedded media and the document's head (its <title> is read apart).
_HTML_NEVER = frozenset(
    [
        "script",
        "style",
        "template",
        "noscript",
        "svg",
        "math",
        "canvas",
        "iframe",
        "object",
        "embed",
        "audio",
        "video",
        "head",
        "select",
        "textarea",
    ]
)
# Boilerplate around a page's content: dropped unless the page has nothing else.
_HTML_BOILERPLATE = frozenset(["nav", "aside", "form", "button", "dialog"])
_HTML_PAGE_FRAME = frozenset(("header", "footer"))  # the page's, not an article's
_HTML_MAIN = frozenset(("main", "article"))
_BOILERPLATE_ROLES = frozenset(
    [
        "navigation",
        "banner",
        "contentinfo",
        "complementary",
        "search",
        "menu",
        "menubar",
        "dialog",
        "alertdialog",
    ]
)
_BOILERPLATE_NAMES = frozenset(
    [
        "nav",
        "navbar",
        "navigation",
        "menu",
        "sidebar",
        "side-bar",
        "breadcrumb",
        "breadcrumbs",
        "footer",
        "site-footer",
        "site-header",
        "masthead",
        "cookie",
        "cookies",
        "cookie-banner",
        "cookie-consent",
        "consent",
        "banner",
        "advert",
        "advertisement",
        "ads",
        "ad",
        "share",
        "sharing",
        "social",
        "related",
        "comments",
        "comment",
        "newsletter",
        "skip-link",
    ]
)


@dataclass(frozen=True)
class _Frame:
    """Where an open element's text goes: nowhere (``never``), only to the whole page's
    text (``boilerplate``), and whether it is inside the page's main content."""

    never: bool = False
    boilerplate: bool = False
    main: bool = False
    pre: bool = False


class _HtmlText:
    """A page's text, three ways at once, so the choice needs one pass: its main content
    (``<main>``, ``<article>``, ``role="main"``) without boilerplate, the whole body without
    boilerplate, and the whole body; the first with a word wins."""

    def __init__(self, limit: int) -> None:
        self.sinks = (_Blocks(limit, "\n"), _Blocks(limit, "\n"), _Blocks(limit, "\n"))
        self.lines = ["", "", ""]
        self.title: str | None = None

    def _targets(self, frame: _Frame) -> tuple[int, ...]:
        if frame.never:
            return ()
        if frame.boilerplate:
            return (2,)
        return (0, 1, 2) if frame.main else (1, 2)

    def text(self, frame: _Frame, text: str | None) -> None:
        if not text:
            return
        if not frame.pre:
            text = _SPACES.sub(" ", text)
        for sink in self._targets(frame):
            line = self.lines[sink]
            if not frame.pre and (not line or line[-1].isspace()):
                self.lines[sink] = line + text.lstrip(" ")
            else:
                self.lines[sink] = line + text

    def cell(self, frame: _Frame) -> None:
        """A table cell's edge: a tab, unless the line is empty or ends in white space."""
        for sink in self._targets(frame):
            line = self.lines[sink]
            if line.strip() and not line[-1].isspace():
                self.lines[sink] = line + "\t"

    def block(self, frame: _Frame, *, line_break: bool = False) -> None:
        """End the line in progress in every view (a block's edge is one wherever its text
        goes): if it holds text, and at a ``<br>`` in the views it reaches even if not (so
        two are a blank line)."""
        targets = self._targets(frame) if line_break else ()
        for sink, line in enumerate(self.lines):
            if line.strip() or sink in targets:
                self.sinks[sink].add(line, empty=sink in targets)
            self.lines[sink] = ""

    def finish(self) -> _Blocks:
        for sink, line in enumerate(self.lines):
            self.sinks[sink].add(line)
        return next((sink for sink in self.sinks if sink.words), self.sinks[-1])


def _html_frame(element: Any, parent: _Frame) -> _Frame:
    tag = element.tag if isinstance(element.tag, str) else ""
    tag = tag.lower()
    if parent.never or tag in _HTML_NEVER:
        return _Frame(never=True)
    role = (element.get("role") or "").lower()
    names = set((element.get("class") or "").lower().split())
    names.add((element.get("id") or "").lower())
    boilerplate = (
        parent.boilerplate
        or tag in _HTML_BOILERPLATE
        or (tag in _HTML_PAGE_FRAME and not parent.main)
        or role in _BOILERPLATE_ROLES
        or (tag not in ("html", "body", "main", "article") and bool(names & _BOILERPLATE_NAMES))
        or element.get("hidden") is not None
        or (element.get("aria-hidden") or "").lower() == "true"
    )
    main = parent.main or tag in _HTML_MAIN or role == "main"
    return _Frame(False, boilerplate, main, parent.pre or tag in ("pre", "textarea"))


def _html(source: str, budget: _Budget) -> Extracted:
    """The page's text as a browser lays it out (see the module's docstring) and its
    ``<title>``: the main content when the page marks one, without navigation, headers,
    footers, sidebars, forms, cookie banners and the like (by element, ARIA role and class
    or id names), else the body without them, else the whole body; never scripts and
    styles. Read by lxml's pull parser, chunk by chunk, each element dropped once its text
    is taken, so memory holds the open elements and the text, not the page's tree."""
    parser = etree.HTMLPullParser(
        events=("start", "end"), remove_comments=True, remove_pis=True, no_network=True
    )
    out = _HtmlText(budget.limits.max_chars)
    frames: list[_Frame] = [_Frame()]

    def handle(events: Iterator[tuple[str, Any]]) -> None:
        for event, element in events:
            tag = element.tag.lower() if isinstance(element.tag, str) else ""
            if event == "start":
                # What came before this element is whole now: its parent's text, or its
                # previous sibling's tail (then the sibling is done with and dropped).
                previous = element.getprevious()
                parent = element.getparent()
                if previous is None:
                    if parent is not None:
                        out.text(frames[-1], parent.text)
                        parent.text = None
                else:
                    out.text(frames[-1], previous.tail)
                    while element.getprevious() is not None and parent is not None:
                        del parent[0]
                frame = _html_frame(element, frames[-1])
                frames.append(frame)
                if tag in _HTML_BLOCKS:
                    out.block(frame)
                elif tag in _HTML_CELLS:
                    out.cell(frame)
            else:
                frame = frames[-1]
                if tag == "title" and out.title is None:
                    out.title = element.text or ""
                if len(element):
                    out.text(frame, element[-1].tail)
                else:
                    out.text(frame, element.text)
                if tag == "br":
                    out.block(frame, line_break=True)
                elif tag in _HTML_BLOCKS:
                    out.block(frame)
                elif tag in _HTML_CELLS:
                    out.cell(frame)
                if len(frames) > 1:
                    frames.pop()
                element.clear(keep_tail=True)

    try:
        for number, at in enumerate(range(0, len(source), HTML_FEED_CHARS), start=1):
            budget.check(f"HTML chunk {number}")
            parser.feed(source[at : at + HTML_FEED_CHARS])
            handle(parser.read_events())
            for sink in out.sinks:
                sink.pack()
        parser.close()
        handle(parser.read_events())
    except ExtractionError:
        raise
    except etree.LxmlError:
        pass  # broken past lxml's recovery: what was read so far is the text
    found = out.finish()
    if found.over:
        raise budget.too_long()
    if not found.words:
        raise ExtractionError("file: the HTML page holds no text")
    return Extracted("html", out.title or "", found.text())


# --- PDF -----------------------------------------------------------------------------------

# A word cut by a hyphen at a line end: a letter, the hyphen, the line end, a lower-case letter.
_HYPHENATED = re.compile(r"(?<=[^\W\d_])-[ \t]*\n[ \t]*(?=[^\W\d_])")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _joined_lines(paragraph: str) -> str:
    """A paragraph's lines as one: a hyphenated word is joined, any other line end a space."""

    def join(match: re.Match[str]) -> str:
        return "" if paragraph[match.end()].islower() else match.group()

    return _SPACES.sub(" ", _HYPHENATED.sub(join, paragraph)).strip()


def _pdf_page_text(raw: str) -> str:
    """A page's text layer as one line per paragraph (a blank line in the layer)."""
    paragraphs = (_joined_lines(p) for p in _PARAGRAPH_BREAK.split(_clean(raw)))
    return "\n".join(p for p in paragraphs if p)


class _PdfContents:
    """Pages' content streams, parsed once when pages share one (pypdf parses a page's
    stream anew for each page that refers to it, so one stream under every page costs its
    parse times the pages), and every parse counted against ``max_pdf_content_bytes``; the
    operators interpreted, counted by pypdf's visitor, against ``max_pdf_operations``."""

    def __init__(self, reader: pypdf.PdfReader, budget: _Budget) -> None:
        self.reader = reader
        self.budget = budget
        self.uses: Counter[object] = Counter(self._key(page) for page in reader.pages)
        self.cache: dict[object, ContentStream] = {}
        self.cached_bytes = 0
        self.parsed_bytes = 0
        self.operations = 0
        self.page = 0
        self.original: Any = None  # the /Contents of the page prepared, as the file has it

    @staticmethod
    def _key(page: Any) -> object:
        contents = page.get("/Contents")
        if isinstance(contents, IndirectObject):
            return ("ref", contents.idnum, contents.generation)
        if isinstance(contents, ArrayObject):
            return tuple(
                ("ref", part.idnum, part.generation)
                if isinstance(part, IndirectObject)
                else id(part)
                for part in contents
            )
        return id(contents)

    def prepare(self, page: Any, number: int) -> None:
        """Give ``page`` its content stream, parsed once if another page shares it."""
        self.page = number
        self.original = page.get("/Contents")
        if self.original is None:
            return
        key = self._key(page)
        self.uses[key] -= 1
        stream = self.cache.get(key)
        if stream is None:
            stream = ContentStream(page["/Contents"].get_object(), self.reader, "bytes")
            size = len(stream.get_data())
            self.parsed_bytes += size
            if self.parsed_bytes > self.budget.limits.max_pdf_content_bytes:
                raise ExtractionError(
                    f"file: the PDF's pages need more than "
                    f"{self.budget.limits.max_pdf_content_bytes} bytes of content read by page "
                    f"{number}: split it",
                    413,
                )
            if self.uses[key] > 0 and self.cached_bytes + size <= PDF_SHARED_CACHE_BYTES:
                self.cache[key] = stream
                self.cached_bytes += size
        elif self.uses[key] <= 0:  # its last page: let it go
            del self.cache[key]
            self.cached_bytes -= len(stream.get_data())
        page[NameObject("/Contents")] = stream

    def release(self, page: Any) -> None:
        """``page`` as it was before :meth:`prepare`: the reader keeps every page, and a page
        holding its parsed stream kept every page's operators alive (~400 MB for 1,000 pages
        of 5,000 operators, docs/benchmarks.md); only the cache holds a shared one now."""
        if self.original is not None:
            page[NameObject("/Contents")] = self.original
        self.original = None

    def visit(self, operator: Any, operands: Any, cm: Any, tm: Any) -> None:
        """pypdf's ``visitor_operand_before``: one more operator interpreted."""
        self.operations += 1
        if self.operations > self.budget.limits.max_pdf_operations:
            raise ExtractionError(
                f"file: the PDF needs more than {self.budget.limits.max_pdf_operations} content "
                f"operations to read by page {self.page}: split it",
                413,
            )
        if self.operations % PDF_CHECK_EVERY == 0:
            self.budget.check(f"page {self.page} of the PDF")


def _pdf(data: bytes, limits: ExtractionLimits, budget: _Budget) -> Extracted:
    """The text layer of every page, page by page, with the words of each (see the module's
    invariants); the title from the PDF's metadata."""
    try:
        reader = pypdf.PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            _decrypt(reader)
        n_pages = len(reader.pages)
    except ExtractionError:
        raise
    except Exception as exc:  # noqa: BLE001 - pypdf raises many kinds on a broken file
        raise ExtractionError(f"file: not a readable PDF (corrupt or truncated): {exc}") from None
    if n_pages == 0:
        raise ExtractionError("file: the PDF has no pages")
    if n_pages > limits.max_pages:
        raise ExtractionError(
            f"file: the PDF has {n_pages} pages, more than {limits.max_pages} "
            "(OPENBOOK_GATEWAY_UPLOAD_MAX_PAGES): split it",
            413,
        )
    try:
        contents = _PdfContents(reader, budget)
    except Exception as exc:  # noqa: BLE001 - as above
        raise ExtractionError(f"file: not a readable PDF (corrupt or truncated): {exc}") from None
    pages: list[str] = []
    chars = 0
    for number, page in enumerate(reader.pages, start=1):
        budget.check(f"page {number} of the PDF")
        try:
            contents.prepare(page, number)
            try:
                raw = page.extract_text(visitor_operand_before=contents.visit) or ""
            finally:
                contents.release(page)
            text = _pdf_page_text(raw)
        except ExtractionError:
            raise
        except Exception as exc:  # noqa: BLE001 - as above, and pypdf's LimitReachedError
            raise ExtractionError(
                f"file: page {number} of the PDF cannot be read (corrupt, or a stream past "
                f"pypdf's decompression limits): {exc}"
            ) from None
        chars += len(text) + (2 if pages else 0)
        if chars > limits.max_chars:
            raise ExtractionError(
                f"file: the PDF's text passes {limits.max_chars} characters by page {number}: "
                "split it",
                413,
            )
        pages.append(text)
    page_words = tuple(len(text.split()) for text in pages)
    if not any(page_words):
        raise ExtractionError("file: the PDF has no text layer (a scan?); openbook does no OCR")
    try:
        title = (reader.metadata.title if reader.metadata else None) or ""
    except Exception:  # noqa: BLE001 - a broken info dictionary only loses the title
        title = ""
    text = "\n\n".join(pages)
    if len(text) > limits.max_chars:  # the pages' separators can still tip it over
        raise ExtractionError(
            f"file: the PDF's text passes {limits.max_chars} characters: split it", 413
        )
    return Extracted("pdf", clean_title(str(title)), text, page_words)


def _decrypt(reader: pypdf.PdfReader) -> None:
    """Open a PDF encrypted with an empty user password (permissions only, as many are);
    refuse one that needs a password."""
    try:
        opened = reader.decrypt("")
    except Exception:  # noqa: BLE001 - unknown or unsupported encryption
        opened = pypdf.PasswordType.NOT_DECRYPTED
    if opened == pypdf.PasswordType.NOT_DECRYPTED:
        raise ExtractionError("file: the PDF is encrypted (password-protected): decrypt it first")
