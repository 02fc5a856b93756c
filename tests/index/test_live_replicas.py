"""Two opens of one live index directory, as two retriever replicas on one volume hold it:
either takes writes (one at a time, under the writer lock), each catches up with the other's
writes and compactions before it answers, and a writer that died mid-append loses nothing
acknowledged."""

from __future__ import annotations

from pathlib import Path

import pytest

from openbook.index.documents import Document
from openbook.index.live import LiveIndex, LiveOptions
from openbook.index.request import SearchRequest
from openbook.index.wal import WAL_FILE, WriteAheadLog
from openbook_testkit.live import make_live_index

OPTIONS = LiveOptions(verify=False)


def _ids(live: LiveIndex, query: str, k: int = 5) -> list[str]:
    return [p.id for p in live.search(SearchRequest([query], k=k, retrieval="bm25"))[0]]


def test_two_replicas_write_alternately_and_read_each_others_writes(tmp_path: Path) -> None:
    a = make_live_index(tmp_path, "bm25", None, passages=20)
    b = LiveIndex(tmp_path / "live", OPTIONS)
    try:
        versions = []
        for i in range(6):
            writer, reader = (a, b) if i % 2 == 0 else (b, a)
            versions.append(writer.put(Document.create(f"z{i}", "T", f"zebraword{i} quux")).version)
            reader.catch_up()  # what a replica's lease does before each request
            assert reader.version == versions[-1]
            assert _ids(reader, f"zebraword{i}")[0] == f"z{i}#0"
            assert reader.get(f"z{i}").document.text == f"zebraword{i} quux"
        assert versions == [1, 2, 3, 4, 5, 6]  # one sequence, never a version twice

        # A delete through one replica hides the passage on the other.
        assert b.delete("z0").version == 7
        a.catch_up()
        assert "z0#0" not in _ids(a, "zebraword0") and a.version == 7
        # A replaced document is the new one wholly.
        a.put(Document.create("z1", "T", "marmotword only"))
        b.catch_up()
        assert _ids(b, "zebraword1") == [] and _ids(b, "marmotword")[0] == "z1#0"

        # A compaction by one replica: the other reopens the new base and writes on it.
        result = a.compact()
        assert result is not None and result.version == 8
        b.catch_up()
        assert (b.base_version, b.version, b.segment_size) == (8, 8, 0)
        assert b.put(Document.create("after", "T", "owlword")).version == 9
        a.catch_up()
        assert _ids(a, "owlword")[0] == "after#0" and "z0#0" not in _ids(a, "zebraword0")
        assert [d.name for d in (tmp_path / "live").iterdir() if d.name.startswith("base-")] == [
            "base-000000000008"
        ]
    finally:
        a.close()
        b.close()


def test_a_torn_append_of_a_dead_writer_is_cut_by_the_next_writer(tmp_path: Path) -> None:
    a = make_live_index(tmp_path, "bm25", None, passages=20)
    b = LiveIndex(tmp_path / "live", OPTIONS)
    try:
        a.put(Document.create("d1", "T", "alpha quux"))
        with open(tmp_path / "live" / WAL_FILE, "ab") as f:  # a's next append, half written
            f.write(b"OBW1\x00\x00\x10\x00")
        b.catch_up()  # a reader leaves the torn tail alone
        assert b.version == 1
        assert b.put(Document.create("d2", "T", "beta quux")).version == 2
        a.catch_up()
        assert a.version == 2 and _ids(a, "beta")[0] == "d2#0"
        assert a.put(Document.create("d3", "T", "gamma quux")).version == 3
        with LiveIndex(tmp_path / "live", OPTIONS) as fresh:  # the log replays whole
            assert fresh.version == 3 and {"d1#0", "d2#0", "d3#0"} <= set(_ids(fresh, "quux"))
    finally:
        a.close()
        b.close()


def test_a_reader_that_opened_a_new_base_before_its_log_cut_reads_on_after_the_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica's request caught between another replica's compaction publishing ``base-<v>``
    and cutting the log opens the new base over the old (uncut) log. After the cut its log
    position is in a file that is gone, and the base is no newer than its own: it reads the
    new log whole, never serves that view on (the first answer after a hot swap came from it)."""
    a = make_live_index(tmp_path, "bm25", None, passages=20)
    b = LiveIndex(tmp_path / "live", OPTIONS)
    try:
        for i in range(3):
            a.put(Document.create(f"z{i}", "T", f"zebraword{i} quux"))
        b.catch_up()
        cut = WriteAheadLog.drop_through

        def b_reads_then_cut(wal: WriteAheadLog, version: int) -> None:
            b.catch_up()  # base-3 is published and its rows recorded: b opens it
            assert (b.base_version, b.version) == (3, 3)
            cut(wal, version)

        monkeypatch.setattr(WriteAheadLog, "drop_through", b_reads_then_cut)
        assert a.compact() is not None
        monkeypatch.setattr(WriteAheadLog, "drop_through", cut)
        for i in range(3, 5):
            assert a.put(Document.create(f"z{i}", "T", f"zebraword{i} quux")).version == i + 1
        b.catch_up()
        assert b.version == 5 and _ids(b, "zebraword4")[0] == "z4#0"
    finally:
        a.close()
        b.close()
