"""prepare_demo_indexes on a tiny copy of the data (~25 passages per snapshot)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("openbook.index")

from openbook_trainer.demo.data import DEMO_SNAPSHOTS  # noqa: E402
from openbook_trainer.demo.indexes import index_is_complete, prepare_demo_indexes  # noqa: E402

ALL = [s.name for s in DEMO_SNAPSHOTS]


def test_builds_all_then_skips(tiny_index_root: Path, tiny_data_dir: Path) -> None:
    from openbook.index import open_index

    for snap in DEMO_SNAPSHOTS:
        manifest = open_index(tiny_index_root / snap.name).manifest
        assert manifest.name == snap.name and manifest.index_type == snap.index_type
        assert 15 < manifest.count < 60
    assert prepare_demo_indexes(tiny_index_root, tiny_data_dir, progress=False) == []


def test_snapshots_differ_in_leaders_passages(tiny_index_root: Path) -> None:
    from openbook.index import open_index

    counts = {n: open_index(tiny_index_root / n).manifest.count for n in ALL}
    assert counts["wiki-2016"] == counts["wiki-2016-bm25"]
    assert counts["wiki-2018"] == counts["wiki-2018-bm25"]


def test_rebuilds_only_a_damaged_index(
    tiny_index_root: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "indexes"
    shutil.copytree(tiny_index_root, root)
    victim = root / "wiki-2018-bm25"
    biggest = max((p for p in victim.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:-1])
    snap = next(s for s in DEMO_SNAPSHOTS if s.name == "wiki-2018-bm25")
    assert not index_is_complete(victim, snap)
    assert prepare_demo_indexes(root, tiny_data_dir, progress=False) == ["wiki-2018-bm25"]
    assert index_is_complete(victim, snap)


def test_names_and_missing_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown"):
        prepare_demo_indexes(tmp_path, tmp_path, names=["wiki-1999"])
    with pytest.raises(FileNotFoundError, match="paragraphs.jsonl"):
        prepare_demo_indexes(tmp_path / "i", tmp_path, progress=False, names=["wiki-2016-bm25"])
