"""A live index opened read-only (a retriever replica that is not its writer) changes nothing
on disk, takes no writes, and sees the writer's writes when opened again."""

from __future__ import annotations

from pathlib import Path

import pytest

from openbook.index.documents import Document
from openbook.index.live import LiveIndex, LiveOptions, disk_stamp
from openbook.index.request import SearchRequest
from openbook.index.wal import WAL_FILE
from openbook_testkit.live import make_live_index

READ_ONLY = LiveOptions(verify=False, read_only=True)


def test_a_read_only_open_leaves_the_writers_files_alone(tmp_path: Path) -> None:
    writer = make_live_index(tmp_path, "bm25", None, passages=20)
    writer.put(Document.create("d1", "T", "alpha beta gamma"))
    wal = tmp_path / "live" / WAL_FILE
    with open(wal, "ab") as f:  # the writer's next append, half written
        f.write(b"OBW1\x00\x00\x10\x00")
    size = wal.stat().st_size
    leftover = tmp_path / "live" / ".base-000000000009.building"
    leftover.mkdir()  # a compaction of the writer in progress
    stamp = disk_stamp(tmp_path / "live")

    reader = LiveIndex(tmp_path / "live", READ_ONLY)
    assert reader.version == 1 and reader.get("d1").document.text == "alpha beta gamma"
    assert wal.stat().st_size == size and leftover.is_dir()
    with pytest.raises(RuntimeError, match="read-only"):
        reader.put(Document.create("d2", "T", "delta"))
    with pytest.raises(RuntimeError, match="read-only"):
        reader.compact()
    assert disk_stamp(tmp_path / "live") == stamp
    reader.close()
    writer.close()


def test_a_reader_opened_again_sees_the_writers_writes(tmp_path: Path) -> None:
    writer = make_live_index(tmp_path, "bm25", None, passages=20)
    reader = LiveIndex(tmp_path / "live", READ_ONLY)
    stamp = disk_stamp(tmp_path / "live")
    writer.put(Document.create("d1", "T", "zebraword quux"))
    assert disk_stamp(tmp_path / "live") != stamp  # how a replica tells it is behind
    reader.close()
    writer.compact()
    writer.put(Document.create("d2", "T", "zebraword again"))
    reader = LiveIndex(tmp_path / "live", READ_ONLY)
    assert reader.version == 2 and reader.base_version == 1
    hits = reader.search(SearchRequest(["zebraword"], k=5, retrieval="bm25"))[0]
    assert {p.id for p in hits} == {"d1#0", "d2#0"}
    reader.close()
    writer.close()
