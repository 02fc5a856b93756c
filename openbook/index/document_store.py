"""The documents of a live index (SQLite, ``documents.sqlite`` beside the write-ahead log).

Answers ``get`` and ``list`` and knows which rows of each published base belong to which
document (what a delete or a replacement must hide).

Invariants:
  * ``documents`` holds exactly the live documents as of ``applied_version`` (a meta key): the
    base's adopted documents and every write of the log up to that version. The log, not this
    file, is what makes a write durable: the live index replays every log record above
    ``applied_version`` into it on open, so a crash between the log's fsync and this commit
    loses nothing. Each record is applied in one transaction with its version.
  * ``base_rows`` maps (base version, document id) to that base's rows and passage ids; the
    rows of a base are written in one transaction, and recomputed from the base's passages if
    a crash came between its publication and that transaction.
  * Commits are synchronous (``synchronous=FULL``): the log is cut after a compaction only
    once everything below the cut is committed here.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from openbook.index.documents import Document

DOCUMENTS_FILE = "documents.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id        TEXT PRIMARY KEY,
    title     TEXT NOT NULL,
    text      TEXT NOT NULL,
    metadata  TEXT NOT NULL,   -- JSON object of scalars
    passages  TEXT NOT NULL,   -- JSON list of passage ids
    version   INTEGER NOT NULL -- the write that put it (0: adopted with a base)
);
CREATE TABLE IF NOT EXISTS base_rows (
    base_version INTEGER NOT NULL,
    doc_id       TEXT NOT NULL,
    row          INTEGER NOT NULL,
    passage_id   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS base_rows_doc ON base_rows(base_version, doc_id);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class StoredDocument:
    """A live document, its passage ids and the version of the write that put it."""

    document: Document
    passage_ids: tuple[str, ...]
    version: int


@dataclass(frozen=True)
class BaseRow:
    doc_id: str
    row: int
    passage_id: str


class DocumentStore:
    """Thread-safe; one connection guarded by a lock (writes are serialised anyway)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)

    @property
    def applied_version(self) -> int:
        with self._lock:
            row = self._conn.execute(
                "SELECT value FROM meta WHERE key='applied_version'"
            ).fetchone()
        return int(row[0]) if row else -1

    def apply(
        self,
        version: int,
        puts: Sequence[tuple[Document, Sequence[str]]],
        deletes: Sequence[str],
    ) -> None:
        """Apply one write (a log record) and record its version, in one transaction."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("DELETE FROM documents WHERE id = ?", [(d,) for d in deletes])
                conn.executemany(
                    "INSERT OR REPLACE INTO documents VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (
                            doc.id,
                            doc.title,
                            doc.text,
                            json.dumps(dict(doc.metadata)),
                            json.dumps(list(pids)),
                            version,
                        )
                        for doc, pids in puts
                    ],
                )
                conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('applied_version', ?)", (str(version),)
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def get(self, doc_id: str) -> StoredDocument | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT id, title, text, metadata, passages, version FROM documents WHERE id = ?",
                (doc_id,),
            ).fetchone()
        if row is None:
            return None
        doc = Document(row[0], row[1], row[2], json.loads(row[3]))
        return StoredDocument(doc, tuple(json.loads(row[4])), int(row[5]))

    def metadata(self, doc_ids: Iterable[str]) -> dict[str, dict]:
        """The metadata of those of ``doc_ids`` that are live (without reading their text)."""
        wanted = list(dict.fromkeys(doc_ids))
        if not wanted:
            return {}
        marks = ",".join("?" * len(wanted))
        with self._lock:
            rows = self._conn.execute(
                f"SELECT id, metadata FROM documents WHERE id IN ({marks})", wanted
            ).fetchall()
        return {row[0]: json.loads(row[1]) for row in rows}

    def contains(self, doc_id: str) -> bool:
        with self._lock:
            row = self._conn.execute("SELECT 1 FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return row is not None

    def list_ids(self, cursor: str | None, limit: int) -> list[str]:
        """Up to ``limit`` document ids after ``cursor`` (exclusive), in id order."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id FROM documents WHERE id > ? ORDER BY id LIMIT ?", (cursor or "", limit)
            ).fetchall()
        return [r[0] for r in rows]

    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    # ------------------------------------------------------------------ base rows

    def has_base(self, base_version: int) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT value FROM meta WHERE key = ?", (f"base_rows:{base_version}",)
            ).fetchone()
        return row is not None

    def set_base(
        self,
        base_version: int,
        rows: Iterable[BaseRow],
        adopt: Iterable[tuple[Document, Sequence[str]]] = (),
    ) -> None:
        """Record the rows of base ``base_version`` and, for a base adopted from a built
        index, its documents (version 0). Older bases' rows stay until
        :meth:`forget_bases_before`: writes look them up until the switch to this base."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM base_rows WHERE base_version = ?", (base_version,))
                conn.executemany(
                    "INSERT INTO base_rows VALUES (?, ?, ?, ?)",
                    ((base_version, r.doc_id, r.row, r.passage_id) for r in rows),
                )
                conn.executemany(
                    "INSERT OR REPLACE INTO documents VALUES (?, ?, ?, ?, ?, 0)",
                    (
                        (d.id, d.title, d.text, json.dumps(dict(d.metadata)), json.dumps(list(p)))
                        for d, p in adopt
                    ),
                )
                conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES (?, 'done')", (f"base_rows:{base_version}",)
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def forget_bases_before(self, base_version: int) -> None:
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM base_rows WHERE base_version < ?", (base_version,))
                for (key,) in conn.execute(
                    "SELECT key FROM meta WHERE key LIKE 'base_rows:%'"
                ).fetchall():
                    if int(key.split(":", 1)[1]) < base_version:
                        conn.execute("DELETE FROM meta WHERE key = ?", (key,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def records(self) -> list[tuple[str, str, dict]]:
        """Every live document's (id, title, metadata): what a metadata filter sees."""
        with self._lock:
            rows = self._conn.execute("SELECT id, title, metadata FROM documents").fetchall()
        return [(r[0], r[1], json.loads(r[2])) for r in rows]

    def all_base_rows(self, base_version: int) -> dict[int, str]:
        """Every row of base ``base_version`` -> its document id."""
        with self._lock:
            return {
                int(r[0]): r[1]
                for r in self._conn.execute(
                    "SELECT row, doc_id FROM base_rows WHERE base_version = ?", (base_version,)
                )
            }

    def base_rows(self, base_version: int, doc_ids: Iterable[str]) -> list[BaseRow]:
        """The rows of base ``base_version`` that belong to ``doc_ids``."""
        out: list[BaseRow] = []
        ids = list(doc_ids)
        with self._lock:
            for at in range(0, len(ids), 500):
                chunk = ids[at : at + 500]
                marks = ",".join("?" * len(chunk))
                out.extend(
                    BaseRow(r[0], int(r[1]), r[2])
                    for r in self._conn.execute(
                        f"SELECT doc_id, row, passage_id FROM base_rows "
                        f"WHERE base_version = ? AND doc_id IN ({marks})",
                        (base_version, *chunk),
                    )
                )
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()
