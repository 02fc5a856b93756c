"""Documents written into a live index: validated once, split into the paper's passages.

Invariants:
  * A :class:`Document` that exists has passed :meth:`Document.validate`'s rules (limits from
    :mod:`openbook.validation.limits`): a non-empty id of at most ``MAX_DOCUMENT_ID_CHARS``
    characters without ``/`` or control characters, text holding at least one word and at most
    ``MAX_DOCUMENT_TEXT_CHARS`` characters, and metadata a flat map of string keys to scalars
    (str, int, finite float, bool, None). A violation is an
    :class:`openbook.errors.InvalidArgument` whose message starts with the field's name.
  * Its passages are the disjoint <=``max_words``-word windows of its text
    (:func:`openbook.index.passages.split_passages`, as a corpus build splits), each keeping
    the document's title, with ids ``<doc_id>#<n>`` (n from 0): the ids a corpus build gives
    an article's pieces, so a compaction rebuilds the same ids.
  * A paged document (metadata ``page_words``, ``openbook.validation.limits.PAGE_WORDS_KEY``: an
    uploaded PDF's words per page, which must add up to its text's words) is split page by page: the
    windows restart at each page, so no passage spans two pages, and passage ``n``'s page is
    known from the metadata and ``max_words`` alone (:func:`passage_page`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from openbook.errors import InvalidArgument
from openbook.index.passages import split_passages
from openbook.types import PASSAGE_ID_SEPARATOR, Passage, document_id_of

# The rules are the core's (the gateway checks a document with the same ones); re-exported.
from openbook.validation.limits import (
    MAX_BATCH_DOCUMENTS,
    PAGE_WORDS_KEY,
    check_document_id,
    check_document_ref,
    check_document_text,
    check_document_title,
    check_metadata,
    parse_page_words,
)

MetadataValue = str | int | float | bool | None


@dataclass(frozen=True)
class Document:
    """One document of a live index. Construct with :meth:`create` (validates); ``field``
    prefixes name it in errors (``documents[3]`` in a batch)."""

    id: str
    title: str
    text: str
    metadata: Mapping[str, MetadataValue] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        id: str,
        title: str,
        text: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        field: str = "",
        stored: bool = False,
    ) -> Document:
        # Anything but a map is kept as given, for validate() to refuse naming the field.
        meta: Any = dict(metadata) if isinstance(metadata, Mapping) else metadata
        doc = cls(id, title, text, {} if meta is None else meta)
        doc.validate(field, stored=stored)
        return doc

    def validate(self, field: str = "", *, stored: bool = False) -> None:
        """Raise InvalidArgument naming the first bad field (prefixed by ``field.``).
        ``stored``: a document read back from a log, held to the rules of the time it was
        written (``openbook.validation.limits``: without issue 42's visible-character rules), so
        that a document written before them still loads."""
        at = f"{field}." if field else ""
        check_document_id(f"{at}id", self.id, stored=stored)
        check_document_title(f"{at}title", self.title)
        check_document_text(f"{at}text", self.text, stored=stored)
        check_metadata(f"{at}metadata", self.metadata, stored=stored)
        if PAGE_WORDS_KEY in self.metadata:
            where = f"{at}metadata.{PAGE_WORDS_KEY}"
            pages = parse_page_words(where, self.metadata[PAGE_WORDS_KEY])
            words = len(self.text.split())
            if sum(pages) != words:
                raise InvalidArgument(
                    f"{where} must add up to the text's {words} words, got {sum(pages)}"
                )

    def passages(self, max_words: int = 100) -> list[Passage]:
        """The document's passages, in order, ids ``<id>#<n>``; a paged document's page by
        page."""
        page_words = self.page_words()
        if page_words is None:
            pieces = split_passages(self.title, self.text, max_words)
        else:
            words = self.text.split()
            pieces, start = [], 0
            for count in page_words:
                page = " ".join(words[start : start + count])
                pieces.extend(split_passages(self.title, page, max_words))
                start += count
        return [
            Passage(id=passage_id(self.id, n), title=self.title, text=piece)
            for n, piece in enumerate(pieces)
        ]

    def page_words(self) -> tuple[int, ...] | None:
        """Words per page of a paged document (validated), None for any other."""
        value = self.metadata.get(PAGE_WORDS_KEY)
        return None if value is None else parse_page_words(PAGE_WORDS_KEY, value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "text": self.text,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, field: str = "", stored: bool = False
    ) -> Document:
        """A document from a JSON object (a request body, a log record: ``stored``),
        validated."""
        at = f"{field}." if field else ""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"{field or 'document'} must be an object")
        for key in ("id", "title", "text"):
            if key not in data:
                raise InvalidArgument(f"{at}{key} is required")
        return cls.create(
            data["id"],
            data["title"],
            data["text"],
            data.get("metadata"),
            field=field,
            stored=stored,
        )


def passage_page(metadata: Mapping[str, Any], n: int, max_words: int) -> int | None:
    """The page (from 1) of a document's passage ``n``, from its metadata's ``page_words``
    (split as :meth:`Document.passages` splits); None for a document without pages."""
    value = metadata.get(PAGE_WORDS_KEY)
    if value is None:
        return None
    try:
        page_words = parse_page_words(PAGE_WORDS_KEY, value)
    except InvalidArgument:
        return None
    passed = 0
    for page, count in enumerate(page_words, start=1):
        passed += -(-count // max_words)  # this page's passages: ceil(count / max_words)
        if n < passed:
            return page
    return None


def passage_number(passage_id: str) -> int | None:
    """``n`` of a document's passage id ``<doc>#<n>``; None for any other id."""
    head, sep, tail = passage_id.rpartition(PASSAGE_ID_SEPARATOR)
    return int(tail) if sep and head and tail.isascii() and tail.isdigit() else None


def passage_id(doc_id: str, n: int) -> str:
    return f"{doc_id}{PASSAGE_ID_SEPARATOR}{n}"


def built_document_id(passage_id: str) -> str:
    """The document a *built* index's passage belongs to: its id without every trailing
    numeric ``#<n>``. A build names the pieces of a corpus row ``<row>#<n>`` (a one-piece row
    keeps ``<row>``), and a row is often itself one paragraph ``<doc>#<n>`` of a document
    (``data/squad/paragraphs.jsonl``): ``1973_oil_crisis#0``, too long for one passage, is
    built as ``1973_oil_crisis#0#0`` and ``#0#1`` beside a short ``1973_oil_crisis#1``; all
    of them are passages of ``1973_oil_crisis``. A live document's passages are always
    ``<doc_id>#<n>`` of an id that may itself end in ``#<n>``: those take
    :func:`document_id_of`."""
    doc = passage_id
    while (head := document_id_of(doc)) != doc:
        doc = head
    return doc


__all__ = [
    "Document",
    "MetadataValue",
    "built_document_id",
    "check_document_id",
    "check_document_ref",
    "check_metadata",
    "document_id_of",
    "passage_id",
    "passage_number",
    "passage_page",
]


def validated_batch(documents: Sequence[Document], field: str = "documents") -> list[Document]:
    """``documents`` as one write takes them: 1 to ``MAX_BATCH_DOCUMENTS`` valid documents of
    distinct ids; InvalidArgument naming the field (``field[i]``, or ``field`` itself for a
    single ``document``). What every engine's ``put_many`` checks before writing anything."""
    if isinstance(documents, Document):
        raise TypeError("put_many takes a sequence of documents")
    docs = list(documents)
    if not docs:
        raise InvalidArgument(f"{field} must not be empty")
    if len(docs) > MAX_BATCH_DOCUMENTS:
        raise InvalidArgument(
            f"{field} must hold at most {MAX_BATCH_DOCUMENTS} documents, got {len(docs)}"
        )
    seen: set[str] = set()
    for i, doc in enumerate(docs):
        at = field if field == "document" else f"{field}[{i}]"
        if not isinstance(doc, Document):
            raise InvalidArgument(f"{at} must be a Document")
        doc.validate(at)
        if doc.id in seen:
            raise InvalidArgument(f"{at}.id: {doc.id!r} appears twice in the batch")
        seen.add(doc.id)
    return docs
