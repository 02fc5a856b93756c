"""The live index's write-ahead log: fsynced appends, torn tails dropped, damage refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openbook.errors import InternalError
from openbook.index.documents import Document
from openbook.index.wal import (
    DeleteOp,
    PutOp,
    WalCorrupted,
    WalRecord,
    encode_record,
    open_log,
)
from openbook.storage.artifacts import temp_sibling


def _record(version: int, dim: int = 4) -> WalRecord:
    doc = Document.create(f"d{version}", "Title", f"text of document {version}", {"v": version})
    vecs = np.random.default_rng(version).standard_normal((1, dim)).astype(np.float32)
    return WalRecord(version, (PutOp(doc, vecs), DeleteOp(f"old{version}")))


def _write(path: Path, n: int) -> None:
    wal, records = open_log(path)
    assert records == []
    for v in range(1, n + 1):
        wal.append(_record(v))
    wal.close()


def test_records_round_trip_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "wal.log"
    _write(path, 3)
    wal, records = open_log(path)
    assert [r.version for r in records] == [1, 2, 3] and wal.last_version == 3
    for got in records:
        want = _record(got.version)
        put, delete = got.ops
        assert isinstance(put, PutOp) and isinstance(delete, DeleteOp)
        assert put.document == want.ops[0].document  # type: ignore[union-attr]
        assert np.array_equal(put.vectors, want.ops[0].vectors)  # type: ignore[union-attr]
        assert delete.doc_id == f"old{got.version}"
    with pytest.raises(InternalError, match="versions must grow"):  # the writer's bug
        wal.append(_record(3))
    wal.close()


def test_every_torn_tail_is_dropped(tmp_path: Path) -> None:
    """A crash mid-append leaves any prefix of the last record: each is dropped, the records
    before it kept, and the next append lands on a record boundary."""
    whole = tmp_path / "whole.log"
    _write(whole, 3)
    data = whole.read_bytes()
    last = len(encode_record(_record(3)))
    keep = len(data) - last
    for cut in range(keep + 1, len(data)):
        path = tmp_path / f"torn-{cut}.log"
        path.write_bytes(data[:cut])
        wal, records = open_log(path)
        assert [r.version for r in records] == [1, 2], cut
        assert path.stat().st_size == keep
        wal.append(_record(3))
        wal.close()
        assert [r.version for r in open_log(path)[1]] == [1, 2, 3]


def test_a_damaged_last_record_is_dropped_but_damage_inside_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wal.log"
    _write(path, 3)
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # the last record's payload: its checksum no longer agrees
    path.write_bytes(bytes(flipped))
    assert [r.version for r in open_log(path)[1]] == [1, 2]

    inside = bytearray(data)
    inside[len(encode_record(_record(1))) - 3] ^= 0xFF  # record 1 of 3
    path.write_bytes(bytes(inside))
    with pytest.raises(WalCorrupted, match="followed by more data"):
        open_log(path)

    path.write_bytes(bytes(data) + b"\x00" * 7)  # a file extended but never written
    assert [r.version for r in open_log(path)[1]] == [1, 2, 3]


def test_drop_through_keeps_later_records_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "wal.log"
    _write(path, 5)
    wal, _ = open_log(path)
    wal.drop_through(3)
    wal.append(_record(6))
    wal.close()
    assert [r.version for r in open_log(path)[1]] == [4, 5, 6]
    wal, _ = open_log(path)
    wal.drop_through(6)
    assert wal.last_version is None and path.stat().st_size == 0
    wal.close()


def test_a_rewrite_cut_short_by_a_kill_is_removed_when_the_log_is_opened(tmp_path: Path) -> None:
    """kill -9 during drop_through leaves its copy of the log beside it; the next writer to
    open the log (the only one, under the writer lock) removes it, however young."""
    path = tmp_path / "wal.log"
    _write(path, 2)
    left = temp_sibling(path)
    left.write_bytes(path.read_bytes()[:7])  # a copy written halfway
    other = tmp_path / ".base-000000000001.tmp-x-1-deadbeef"  # not the log's: not touched
    other.mkdir()
    wal, records = open_log(path)
    assert [r.version for r in records] == [1, 2]
    assert not left.exists() and other.exists()
    wal.close()
