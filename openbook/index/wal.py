"""The write-ahead log of a live index: every acknowledged write, durable before it is answered.

File format: a sequence of records, each ``MAGIC | length (u32 BE) | crc32 (u32 BE) | payload``,
the payload a UTF-8 JSON object ``{"version", "ops": [...]}``; an op is ``{"op": "put",
"document": {...}, "vectors": base64 float32 (passages, dim) | null}`` or ``{"op": "delete",
"id"}``. A batch is one record, so it is replayed whole or not at all.

Invariants:
  * :meth:`WriteAheadLog.append` returns only once the record is written and fsynced; a
    record that :meth:`WriteAheadLog.read` returns was appended whole (length and checksum
    agree), so an acknowledged write is in the log and an unacknowledged one is wholly there
    or wholly absent.
  * Versions strictly increase along the file.
  * A damaged *last* record (a crash mid-append) is a torn write: :func:`open_log` drops it and
    cuts the file back to the end of the last whole record. Damage followed by more data is not
    a torn write; it is refused (:class:`WalCorrupted`) instead of silently losing what follows.
  * :meth:`WriteAheadLog.drop_through` (after a compaction) replaces the file atomically
    (temp file, fsync, rename, fsync of the directory): after a crash the log is the old one or
    the new one.
  * The vectors are logged with the document, so a replay reproduces the searched vectors bit
    for bit without loading the encoder.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openbook.errors import InternalError
from openbook.index.documents import Document
from openbook.storage.artifacts import clean_stale_partials, fsync_dir, temp_sibling

WAL_FILE = "wal.log"
MAGIC = b"OBW1"
_HEADER = struct.Struct(">4sII")


class WalCorrupted(Exception):
    """The log is damaged before its last record: not a torn append, and not repairable here."""


@dataclass(frozen=True)
class PutOp:
    document: Document
    vectors: np.ndarray | None  # float32 (passages, dim); None for a bm25-only index


@dataclass(frozen=True)
class DeleteOp:
    doc_id: str


WalOp = PutOp | DeleteOp


@dataclass(frozen=True)
class WalRecord:
    version: int
    ops: tuple[WalOp, ...]


def encode_record(record: WalRecord) -> bytes:
    ops: list[dict[str, Any]] = []
    for op in record.ops:
        if isinstance(op, PutOp):
            vecs = None
            if op.vectors is not None:
                arr = np.ascontiguousarray(op.vectors, dtype="<f4")
                vecs = {"shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}
            ops.append({"op": "put", "document": op.document.to_dict(), "vectors": vecs})
        else:
            ops.append({"op": "delete", "id": op.doc_id})
    payload = json.dumps({"version": record.version, "ops": ops}, ensure_ascii=False).encode()
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> WalRecord:
    data = json.loads(payload.decode("utf-8"))
    ops: list[WalOp] = []
    for op in data["ops"]:
        if op["op"] == "put":
            vecs = op.get("vectors")
            arr = None
            if vecs is not None:
                raw = base64.b64decode(vecs["data"])
                arr = np.frombuffer(raw, dtype="<f4").reshape(vecs["shape"]).astype(np.float32)
            ops.append(PutOp(Document.from_dict(op["document"], stored=True), arr))
        elif op["op"] == "delete":
            ops.append(DeleteOp(str(op["id"])))
        else:
            # a record this log's writer did not write (its checksum agrees): damage
            raise InternalError(f"unknown op {op['op']!r}")
    return WalRecord(int(data["version"]), tuple(ops))


@dataclass(frozen=True)
class _Span:
    version: int
    start: int
    end: int


class WriteAheadLog:
    """An open log, appended to by one writer (the live index's write lock serialises them)."""

    def __init__(self, path: Path, spans: list[_Span]) -> None:
        self.path = Path(path)
        self._spans = spans
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()

    @property
    def last_version(self) -> int | None:
        return self._spans[-1].version if self._spans else None

    @property
    def size(self) -> int:
        return self._spans[-1].end if self._spans else 0

    @property
    def position(self) -> LogPosition:
        """Where the records this log knows end (what :func:`read_log_from` continues from)."""
        return LogPosition(os.fstat(self._file.fileno()).st_ino, self.size)

    def append(self, record: WalRecord) -> None:
        """Write ``record`` and fsync it; on any failure the file is cut back to its previous
        end, so a failed append leaves no partial record behind a later one."""
        data = encode_record(record)
        with self._lock:
            last = self.last_version
            if last is not None and record.version <= last:
                # the live index's writer numbers its versions: a lower one is its bug
                raise InternalError(f"version {record.version} after {last}: versions must grow")
            start = self.size
            try:
                self._file.write(data)
                self._file.flush()
                os.fsync(self._file.fileno())
            except BaseException:
                self._file.truncate(start)
                raise
            self._spans.append(_Span(record.version, start, start + len(data)))

    def extend(self) -> list[WalRecord] | None:
        """The records other processes appended since this log was opened or last extended
        (their spans added, a torn tail cut off the file); None when the file was replaced
        since (a compaction cut it): open it again. Only the holder of the index's writer
        lock may call it (``writer_lock.py``): it cuts the file."""
        with self._lock:
            try:
                on_disk = os.stat(self.path).st_ino
            except FileNotFoundError:
                return None
            if on_disk != os.fstat(self._file.fileno()).st_ino:
                return None
            start = self.size
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read()
            records, spans, at = _scan(self.path, data)
            if at < len(data):  # a writer that died mid-append: cut, as open_log does
                self._file.truncate(start + at)
                self._file.flush()
                os.fsync(self._file.fileno())
            if records and self._spans and records[0].version <= self._spans[-1].version:
                raise WalCorrupted(
                    f"{self.path}: version {records[0].version} after {self._spans[-1].version}"
                )
            self._spans.extend(_Span(s.version, s.start + start, s.end + start) for s in spans)
            return records

    def drop_through(self, version: int) -> None:
        """Remove the records of versions <= ``version`` (they are in a published base now)."""
        with self._lock:
            keep = [s for s in self._spans if s.version > version]
            offset = keep[0].start if keep else self.size
            tmp = temp_sibling(self.path)
            try:
                with open(self.path, "rb") as src, open(tmp, "wb") as dst:
                    src.seek(offset)
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                    dst.flush()
                    os.fsync(dst.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(self.path.parent)
            self._file.close()
            self._file = open(self.path, "ab")  # noqa: SIM115
            self._spans = [_Span(s.version, s.start - offset, s.end - offset) for s in keep]

    def close(self) -> None:
        with self._lock:
            self._file.close()


def open_log(path: Path) -> tuple[WriteAheadLog, list[WalRecord]]:
    """Open (or create) the log at ``path``: its whole records in order, a torn last record
    dropped and cut off the file. Only the index's writer may open it (it cuts the file)."""
    path = Path(path)
    # A writer killed while :meth:`WriteAheadLog.drop_through` rewrote the log left its copy
    # beside it. Only the index's writer opens the log, under the writer lock, so no copy can
    # be in progress now: every one is abandoned, whatever its age.
    clean_stale_partials(path.parent, name=path.name, grace_s=0.0, max_age_s=0.0)
    if not path.exists():
        with open(path, "wb") as f:
            os.fsync(f.fileno())
        fsync_dir(path.parent)
    data = path.read_bytes()
    records, spans, at = _scan(path, data)
    if at < len(data):
        # A torn last append: cut it off so the next append starts on a record boundary.
        with open(path, "r+b") as f:
            f.truncate(at)
            f.flush()
            os.fsync(f.fileno())
    return WriteAheadLog(path, spans), records


@dataclass(frozen=True)
class LogPosition:
    """Where a reader's view of a log ends: the file (its inode) and the end of the last whole
    record it read."""

    inode: int
    offset: int


def read_log_from(
    path: Path, since: LogPosition | None
) -> tuple[list[WalRecord], LogPosition] | None:
    """The whole records after ``since`` (None: from the start) and the new position, changing
    nothing (a torn tail, an append in progress, is left for the next read); None when the
    file is no longer the one ``since`` read (replaced by a compaction): read it whole again.
    An absent log reads as empty."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return [], LogPosition(-1, 0)
    with f:
        inode = os.fstat(f.fileno()).st_ino
        if since is not None and since.inode not in (inode, -1):  # -1: absent then
            return None
        start = since.offset if since is not None else 0
        f.seek(start)
        data = f.read()
    records, _, at = _scan(path, data)
    return records, LogPosition(inode, start + at)


def _scan(path: Path, data: bytes) -> tuple[list[WalRecord], list[_Span], int]:
    """The whole records of ``data``, their spans, and where the whole records end."""
    records: list[WalRecord] = []
    spans: list[_Span] = []
    at = 0
    while at < len(data):
        record, end = _read_at(data, at)
        if record is None:
            break
        if spans and record.version <= spans[-1].version:
            raise WalCorrupted(f"{path}: version {record.version} after {spans[-1].version}")
        records.append(record)
        spans.append(_Span(record.version, at, end))
        at = end
    return records, spans, at


def _read_at(data: bytes, at: int) -> tuple[WalRecord | None, int]:
    """The record at ``at`` and its end, or (None, at) for a torn tail; WalCorrupted for
    damage that is not at the tail."""
    header_end = at + _HEADER.size
    if header_end > len(data):
        return None, at  # the header itself was cut short
    magic, length, crc = _HEADER.unpack_from(data, at)
    end = header_end + length
    if magic == MAGIC and end <= len(data):
        payload = data[header_end:end]
        if zlib.crc32(payload) == crc:
            try:
                return _decode_payload(payload), end
            except (ValueError, KeyError, TypeError, InternalError) as e:
                raise WalCorrupted(f"record at byte {at}: checksum agrees but {e}") from None
    # A bad record is a torn append only if it is the file's last thing: it claims to reach
    # the end (or beyond), or it is garbage with no record header after it (a file extended
    # by a crash but never written). Anything else would lose records that follow it.
    if magic == MAGIC and end >= len(data):
        return None, at
    if magic != MAGIC and MAGIC not in data[at + 1 :]:
        return None, at
    raise WalCorrupted(f"damaged record at byte {at} of {len(data)} followed by more data")
