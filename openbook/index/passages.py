"""Reading corpora and splitting them into the <=100-word passages DPR/RAG retrieve over.

Write side.
"""

from __future__ import annotations

import csv
import gzip
import io
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

from openbook.errors import InvalidArgument
from openbook.types import Passage
from openbook.validation.jsonl import json_object

FORMATS = ("auto", "jsonl", "dpr-tsv", "articles")

# DPR's psgs_w100.tsv has passages far longer than csv's default 128 KiB field limit in a few rows.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


def split_passages(title: str, text: str, max_words: int = 100) -> list[str]:
    """Split ``text`` into disjoint windows of at most ``max_words`` whitespace-separated words.

    As in DPR (and RAG, which reuses its Wikipedia split) windows do not overlap and the title
    is *not* counted; it is kept alongside each passage instead. Empty text gives no passages.
    """
    del title  # kept in the signature so callers can later switch to title-aware splitting
    if max_words < 1:
        raise InvalidArgument(f"max_words must be >= 1, got {max_words}")
    words = text.split()
    return [" ".join(words[i : i + max_words]) for i in range(0, len(words), max_words)]


def detect_format(path: Path) -> str:
    """Guess the input format from the file name (``.gz`` is looked through)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".tsv"):
        return "dpr-tsv"
    if name.endswith((".txt", ".md", ".text")):
        return "articles"
    raise InvalidArgument(
        f"{path}: cannot guess input format from the extension; "
        f"pass input_format as one of {', '.join(FORMATS[1:])}"
    )


def read_passages(
    paths: Iterable[Path], input_format: str = "auto", max_words: int = 100
) -> Iterator[Passage]:
    """Yield passages from every file in ``paths``, in order.

    Formats:
      * ``jsonl``: one ``{"id", "title", "text"}`` object per line. Text longer than
        ``max_words`` is split; split pieces get ids ``<id>#<n>`` (n from 0).
      * ``dpr-tsv``: DPR's ``psgs_w100.tsv`` (``id<TAB>text<TAB>title`` header), already split.
      * ``articles``: raw ``.txt``/``.md`` files (one article each; title = file stem) or JSONL
        articles (``title`` and ``text`` required, ``id`` optional: defaults to the title).
        Pieces always get ids ``<id>#<n>``.
    Malformed input raises :class:`~openbook.errors.InvalidArgument` naming the file and line.
    """
    if input_format not in FORMATS:
        raise InvalidArgument(f"unknown input format {input_format!r}; expected one of {FORMATS}")
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise InvalidArgument(f"{path}: no such file")
        fmt = detect_format(path) if input_format == "auto" else input_format
        if fmt == "jsonl":
            yield from _read_jsonl(path, max_words, articles=False)
        elif fmt == "dpr-tsv":
            yield from _read_dpr_tsv(path)
        elif _looks_like_jsonl(path):
            yield from _read_jsonl(path, max_words, articles=True)
        else:
            yield from _read_text_article(path, max_words)


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        # a text-mode gzip file is an io.TextIOWrapper; typeshed types it as the TextIO protocol
        return cast(io.TextIOBase, gzip.open(path, "rt", encoding="utf-8", newline=""))
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115 - caller closes


def _looks_like_jsonl(path: Path) -> bool:
    name = path.name.lower().removesuffix(".gz")
    return name.endswith((".jsonl", ".json", ".ndjson"))


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    # Decode per line (not via a text wrapper, which decodes ahead in blocks) so that an
    # encoding error is reported on the right line.
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None


def _read_jsonl(path: Path, max_words: int, *, articles: bool) -> Iterator[Passage]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        row = json_object(line, f"{path}:{lineno}")
        required = ("title", "text") if articles else ("id", "title", "text")
        missing = [k for k in required if k not in row]
        if missing:
            raise InvalidArgument(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        title, text = row["title"], row["text"]
        pid = row.get("id", title)
        for key, value in (("id", pid), ("title", title), ("text", text)):
            if not isinstance(value, str | int) or isinstance(value, bool):
                raise InvalidArgument(f"{path}:{lineno}: field {key!r} must be a string")
        pid, title, text = str(pid), str(title), str(text)
        pieces = split_passages(title, text, max_words)
        if not articles and len(pieces) == 1:
            yield Passage(id=pid, title=title, text=pieces[0])
            continue
        for n, piece in enumerate(pieces):
            yield Passage(id=f"{pid}#{n}", title=title, text=piece)


def _read_dpr_tsv(path: Path) -> Iterator[Passage]:
    reader = csv.reader((line for _, line in _lines(path)), delimiter="\t")
    start = 1
    try:
        for row in reader:
            # a quoted field may span lines: report the line the record started on
            lineno, start = start, reader.line_num + 1
            if not row:
                continue
            if lineno == 1 and [c.strip().lower() for c in row] == ["id", "text", "title"]:
                continue
            if len(row) != 3:
                raise InvalidArgument(
                    f"{path}:{lineno}: expected 3 tab-separated columns (id, text, title), "
                    f"got {len(row)}"
                )
            pid, text, title = row
            if not pid.strip():
                raise InvalidArgument(f"{path}:{lineno}: empty id")
            yield Passage(id=pid.strip(), title=title, text=text)
    except csv.Error as e:
        raise InvalidArgument(f"{path}:{start}: malformed TSV: {e}") from None


def _read_text_article(path: Path, max_words: int) -> Iterator[Passage]:
    try:
        with _open_text(path) as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    stem = path.name.removesuffix(".gz")
    title = stem.rsplit(".", 1)[0] if "." in stem else stem
    for n, piece in enumerate(split_passages(title, text, max_words)):
        yield Passage(id=f"{title}#{n}", title=title, text=piece)
