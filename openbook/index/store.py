"""On-disk passage text store (SQLite), addressed by the same row numbers as the vector index.

Read side (``PassageWriter``: the write side's passage stage).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from openbook.errors import InvalidArgument
from openbook.types import Passage

_SCHEMA = """
CREATE TABLE IF NOT EXISTS passages (
    row   INTEGER PRIMARY KEY,  -- 0-based, equals the faiss / vectors.npy row
    id    TEXT NOT NULL UNIQUE,
    title TEXT NOT NULL,
    text  TEXT NOT NULL
);
"""


class PassageWriter:
    """Appends passages in row order; ``close`` commits. Duplicate ids are an InvalidArgument."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.unlink(missing_ok=True)
        self._conn = sqlite3.connect(self.path)
        # A build is all-or-nothing (it lives in a temp dir until renamed), so durability per
        # statement buys nothing and costs a lot on large corpora.
        self._conn.execute("PRAGMA journal_mode=OFF")
        self._conn.execute("PRAGMA synchronous=OFF")
        self._conn.executescript(_SCHEMA)
        self.count = 0

    def add(self, passages: Iterable[Passage]) -> None:
        rows = []
        for p in passages:
            rows.append((self.count, p.id, p.title, p.text))
            self.count += 1
        try:
            self._conn.executemany("INSERT INTO passages VALUES (?, ?, ?, ?)", rows)
        except sqlite3.IntegrityError as e:
            dup = _first_duplicate(self._conn, rows)
            raise InvalidArgument(f"duplicate passage id {dup!r}" if dup else str(e)) from None

    def close(self) -> None:
        self._conn.commit()
        self._conn.close()


def _first_duplicate(conn: sqlite3.Connection, rows: list[tuple]) -> str | None:
    seen: set[str] = set()
    for _, pid, _, _ in rows:
        if pid in seen or conn.execute("SELECT 1 FROM passages WHERE id=?", (pid,)).fetchone():
            return pid
        seen.add(pid)
    return None


class PassageStore:
    """Read-only access, safe to share between threads (one connection behind a lock)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(str(self.path))
        uri = f"file:{self.path.resolve()}?mode=ro&immutable=1"
        self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM passages").fetchone()[0])

    def get(self, rows: Sequence[int]) -> list[Passage]:
        """Passages for ``rows`` in the given order (duplicates allowed)."""
        wanted = sorted({int(r) for r in rows})
        found: dict[int, tuple[str, str, str]] = {}
        with self._lock:
            # SQLite's default limit on host parameters is 32766; stay well below it.
            for s in range(0, len(wanted), 900):
                chunk = wanted[s : s + 900]
                marks = ",".join("?" * len(chunk))
                q = f"SELECT row, id, title, text FROM passages WHERE row IN ({marks})"
                for row, pid, title, text in self._conn.execute(q, chunk):
                    found[row] = (pid, title, text)
        missing = [r for r in wanted if r not in found]
        if missing:
            raise KeyError(f"rows not in passage store: {missing[:5]}")
        return [Passage(*found[int(r)]) for r in rows]

    def rows_for_ids(self, ids: Sequence[str]) -> list[int]:
        out = []
        with self._lock:
            for pid in ids:
                hit = self._conn.execute("SELECT row FROM passages WHERE id=?", (pid,)).fetchone()
                if hit is None:
                    raise KeyError(f"passage id {pid!r} not in store")
                out.append(int(hit[0]))
        return out

    def _row_batches(self, columns: str, start: int, stop: int, batch: int) -> Iterator[list[Any]]:
        """``columns`` of the rows in [start, stop), ``batch`` rows at a time, in row order.
        The lock is held for each read only, never while the caller works on a batch."""
        query = f"SELECT {columns} FROM passages WHERE row >= ? AND row < ? ORDER BY row"
        for s in range(start, stop, batch):
            with self._lock:
                rows = self._conn.execute(query, (s, min(s + batch, stop))).fetchall()
            yield rows

    def iter_batches(
        self, start: int, stop: int, batch: int = 10_000
    ) -> Iterator[list[tuple[str, str]]]:
        """Yield lists of (title, text) for rows in [start, stop), in row order."""
        yield from self._row_batches("title, text", start, stop, batch)

    def ids(self, start: int, stop: int) -> list[str]:
        """Passage ids of rows [start, stop), in row order."""
        with self._lock:
            cur = self._conn.execute(
                "SELECT id FROM passages WHERE row >= ? AND row < ? ORDER BY row", (start, stop)
            )
            return [r[0] for r in cur.fetchall()]

    def iter_ids_titles(self, batch: int = 100_000) -> Iterator[list[tuple[int, str, str]]]:
        """Yield lists of (row, id, title) of every row, in row order (no text read)."""
        yield from self._row_batches("row, id, title", 0, len(self), batch)

    def iter_passages(self, start: int, stop: int, batch: int = 10_000) -> Iterator[list[Passage]]:
        """Yield lists of ``Passage`` (id, title, text) for rows in [start, stop), in row order."""
        for rows in self._row_batches("id, title, text", start, stop, batch):
            yield [Passage(*r) for r in rows]

    def with_id_prefix(self, prefix: str, exact: str) -> list[Passage]:
        """Passages whose id is ``exact`` or starts with ``prefix``, in row order (the
        ``id`` column's unique index serves the range)."""
        with self._lock:
            cur = self._conn.execute(
                "SELECT id, title, text FROM passages WHERE id = ? OR (id >= ? AND id < ?) "
                "ORDER BY row",
                (exact, prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)),
            )
            return [Passage(*r) for r in cur.fetchall()]

    def ids_after(self, after: str, limit: int) -> list[str]:
        """Up to ``limit`` passage ids above ``after``, in id order."""
        with self._lock:
            cur = self._conn.execute(
                "SELECT id FROM passages WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
            )
            return [r[0] for r in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
