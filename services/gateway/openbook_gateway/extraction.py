"""Text out of an uploaded file: plain text, Markdown, HTML or PDF (issue 33).

What a file is comes from its content, never only from its name: a PDF is a PDF by its
``%PDF-`` header whatever it is called; the binary types people upload by mistake (archives,
images, office files) are recognised by their magic bytes and refused by name; anything else
must decode as UTF-8 text, and is HTML if it looks like HTML (a doctype or an ``<html>``,
``<head>`` or ``<body>`` tag near the start), Markdown if its name says so, plain text
otherwise. The parsing itself is the libraries': ``pypdf`` (a PDF's text layer),
``trafilatura`` (an HTML page's main content, without navigation and footers) and
``markdown-it-py`` (Markdown's tokens, whose text is kept and markup dropped).

Invariants:
  * :func:`extract` either returns an :class:`Extracted` whose text holds at least one word,
    at most :attr:`ExtractionLimits.max_chars` characters and no control character but tab,
    newline and carriage return (what ``openbook.limits.check_document_text`` takes), and a
    title that ``check_document_title`` takes (possibly empty), or raises
    :class:`ExtractionError` with the HTTP status and a message naming the reason. Nothing
    here writes anywhere: a refused file leaves the index unchanged.
  * Work is bounded by the input and the limits, not by what a file claims: a PDF with more
    than ``max_pages`` pages is refused before any page is read; text is extracted page by
    page and refused once past ``max_chars``; pypdf's own decompression limits
    (``ZLIB_MAX_OUTPUT_LENGTH`` and friends) stop a stream bomb inside one page.
  * A PDF's ``page_words`` has one entry per page: the number of whitespace-separated words of
    that page's text, in order; their sum is the number of words of ``text`` (pages are joined
    by a blank line). The document's passages are cut page by page from it
    (``openbook.limits.PAGE_WORDS_KEY``), so no passage spans two pages and each knows its
    page.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import pypdf
import trafilatura
from markdown_it import MarkdownIt

from openbook.errors import InvalidArgument
from openbook.limits import MAX_DOCUMENT_TEXT_CHARS, MAX_DOCUMENT_TITLE_CHARS

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
_HTML_START = re.compile(rb"<(!doctype\s+html|html[\s>]|head[\s>]|body[\s>])", re.IGNORECASE)
_SPACES = re.compile(r"\s+")
_BLANK_LINES = re.compile(r"\n{3,}")
# Unicode's control characters (category Cc: C0, DEL, C1) but tab, newline, carriage return.
_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class ExtractionLimits:
    """How much one file may give. ``max_pages`` bounds a PDF's page count (and so the
    per-page word map kept in the document's metadata); ``max_chars`` the text extracted."""

    max_pages: int = 1000
    max_chars: int = MAX_DOCUMENT_TEXT_CHARS


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
    (415: not a type openbook reads; 413: more than the limits; 422: unreadable or empty)."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


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


def extract(data: bytes, filename: str = "", limits: ExtractionLimits | None = None) -> Extracted:
    """The text and title of one uploaded file (see the module's invariants)."""
    limits = limits or ExtractionLimits()
    if not data:
        raise ExtractionError("file: the file is empty")
    kind = detect_kind(data, filename)
    if kind == "pdf":
        return _pdf(data, limits)
    text = _decoded(data)
    if kind == "html":
        extracted = _html(text)
    elif kind == "markdown":
        extracted = _markdown(text)
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


def _markdown(source: str) -> Extracted:
    """Markdown's text without its markup: every inline run, code block and table cell as
    text, block by block; the first heading is the title."""
    tokens = MarkdownIt("commonmark").enable("table").parse(source)
    blocks: list[str] = []
    title = ""
    in_heading = False
    for token in tokens:
        if token.type == "heading_open":
            in_heading = True
        elif token.type == "heading_close":
            in_heading = False
        elif token.type == "inline":
            text = "".join(
                child.content
                for child in token.children or ()
                if child.type in ("text", "code_inline")
            )
            if in_heading and not title:
                title = text
            blocks.append(text)
        elif token.type in ("fence", "code_block"):
            blocks.append(token.content)
    return Extracted("markdown", title, "\n\n".join(b for b in blocks if b.strip()))


def _html(source: str) -> Extracted:
    """The page's main content (trafilatura drops navigation, headers, footers and
    boilerplate) and its ``<title>``."""
    try:
        found = trafilatura.bare_extraction(
            source, with_metadata=True, include_comments=False, include_tables=True
        )
    except Exception:  # noqa: BLE001 - lxml and trafilatura raise many kinds on broken markup
        found = None
    text = getattr(found, "text", None) or ""
    title = getattr(found, "title", None) or ""
    if not text.split():
        # A short page can fall under trafilatura's minimum for "main content": its body's
        # text (still without scripts and styles) is then the content.
        text = trafilatura.html2txt(source) or ""
    if not text.split():
        raise ExtractionError("file: the HTML page holds no text")
    return Extracted("html", title, text)


def _pdf(data: bytes, limits: ExtractionLimits) -> Extracted:
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
    pages: list[str] = []
    chars = 0
    for number, page in enumerate(reader.pages, start=1):
        try:
            text = _clean(page.extract_text() or "")
        except Exception as exc:  # noqa: BLE001 - as above, and pypdf's LimitReachedError
            raise ExtractionError(
                f"file: page {number} of the PDF cannot be read (corrupt, or a stream past "
                f"pypdf's decompression limits): {exc}"
            ) from None
        chars += len(text)
        if chars > limits.max_chars:
            raise ExtractionError(
                f"file: the PDF's text passes {limits.max_chars} characters by page {number}: "
                "split it",
                413,
            )
        pages.append(_SPACES.sub(" ", text).strip())
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
