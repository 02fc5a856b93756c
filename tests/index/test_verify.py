"""open_index refuses incomplete, corrupted or inconsistent indexes with a clear message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from openbook.index import IndexLoadError, build_index, load_encoder, open_index
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import random_rows, write_jsonl


@pytest.fixture()
def dpr_index(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> Path:
    src = write_jsonl(tmp_path / "r.jsonl", random_rows(20))
    out = tmp_path / "idx"
    build_index(
        [src],
        out,
        IndexSpec(name="tiny", encoder=str(dpr_dirs[0]), query_encoder=str(dpr_dirs[1])),
        BuildOptions(progress=False),
    )
    return out


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksum_mismatch(dpr_index: Path) -> None:
    f = dpr_index / "passages.sqlite"
    _flip_byte(f, f.stat().st_size - 10)
    with pytest.raises(IndexLoadError, match="index 'tiny': passages.sqlite checksum mismatch"):
        open_index(dpr_index)
    open_index(dpr_index, verify=False).close()  # same size: only hashing catches it


def test_truncated_file_caught_without_hashing(dpr_index: Path) -> None:
    f = dpr_index / "vectors.npy"
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(IndexLoadError, match=r"vectors.npy size \d+ != \d+ recorded"):
        open_index(dpr_index, verify=False)


def test_missing_manifest_and_files(dpr_index: Path, tmp_path: Path) -> None:
    with pytest.raises(IndexLoadError, match="index directory not found"):
        open_index(tmp_path / "nope")
    (dpr_index / "index.faiss").unlink()
    with pytest.raises(IndexLoadError, match="index.faiss missing"):
        open_index(dpr_index)
    (dpr_index / "manifest.json").unlink()
    with pytest.raises(IndexLoadError, match="manifest.json missing"):
        open_index(dpr_index)


def test_inconsistent_manifest(dpr_index: Path) -> None:
    mf = dpr_index / "manifest.json"
    raw = json.loads(mf.read_text())
    mf.write_text(json.dumps({**raw, "dim": 768}))
    with pytest.raises(IndexLoadError, match="dim 768 != index dim 32"):
        open_index(dpr_index)
    mf.write_text(json.dumps({**raw, "count": 21}))
    with pytest.raises(IndexLoadError, match="count 21 != 20"):
        open_index(dpr_index)
    mf.write_text(json.dumps({**raw, "format_version": 99}))
    with pytest.raises(IndexLoadError, match="format_version 99 not supported"):
        open_index(dpr_index)
    for bad in (0, -2.0, "20", None):
        mf.write_text(json.dumps({**raw, "score_scale": bad}))
        with pytest.raises(IndexLoadError, match="score_scale must be a positive number"):
            open_index(dpr_index)
    old = {k: v for k, v in raw.items() if k != "score_scale"}  # written before the field
    mf.write_text(json.dumps(old))
    with open_index(dpr_index) as idx:
        assert idx.manifest.score_scale == 1.0
    mf.write_text("{")
    with pytest.raises(IndexLoadError, match="not valid JSON"):
        open_index(dpr_index)


def test_wrong_dim_query_encoder(dpr_index: Path) -> None:
    with open_index(dpr_index) as idx:
        minilm = load_encoder("all-MiniLM-L6-v2")
        with pytest.raises(IndexLoadError, match=r"dim 384 != index dim 32"):
            idx.search(SearchRequest(["q"], k=1), encoder=minilm)
        with pytest.raises(ValueError, match=r"expected \(n, 32\)"):
            idx.search(SearchRequest(k=1, query_vectors=minilm.encode(["q"])))
    # a manifest naming a query encoder of the wrong dim fails on first search
    mf = dpr_index / "manifest.json"
    mf.write_text(json.dumps({**json.loads(mf.read_text()), "query_encoder": "all-MiniLM-L6-v2"}))
    with open_index(dpr_index) as idx, pytest.raises(IndexLoadError, match="dim 384 != index"):
        idx.search(SearchRequest(["q"], k=1))


def test_copied_index_still_opens(dpr_index: Path, tmp_path: Path) -> None:
    shutil.copytree(dpr_index, tmp_path / "copy")
    with open_index(tmp_path / "copy") as idx:
        assert len(idx.search(SearchRequest(["w1"], k=3))[0]) == 3
