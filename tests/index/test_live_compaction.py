"""Compaction folds the write segment and the deletions into a new base from the vectors the
live index already holds (openbook/index/compaction.py): nothing is encoded, every type's base
gets exactly the served vectors, a flat index serves the same results before and after, and a
shard keeps its manifest identity and its parent's BM25 statistics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from openbook.index import open_index, split_index
from openbook.index.encoders import Encoder
from openbook.index.layout import VECTORS_FILE
from openbook.index.live import LiveIndex, newest_base
from openbook.index.loaded import read_index_manifest
from openbook.index.manifest import IndexLoadError
from openbook.index.request import SearchRequest
from openbook.types import Passage
from openbook_testkit.live import make_live_index, random_document


def _assert_same(before: list[list[Passage]], after: list[list[Passage]]) -> None:
    """The same scores, and the same passages, up to the order of equal scores (and which of
    those tied with the last hit made the cut)."""
    for b, a in zip(before, after, strict=True):
        assert [p.score for p in a] == pytest.approx([p.score for p in b], rel=1e-5, abs=1e-5)
        last = b[-1].score
        inside = [{p.id for p in h if p.score > last + 1e-5} for h in (b, a)]
        assert inside[0] == inside[1]


def _write(live: LiveIndex, seed: int) -> None:
    """Inserts, a replacement of a base document and of a new one, and deletes."""
    rng = np.random.default_rng(seed)
    live.put_many([random_document(rng, f"new-{i}") for i in range(6)])
    live.put(random_document(rng, "w3", words=40))
    live.put(random_document(rng, "new-2", words=30))
    live.delete("w5")
    live.delete("new-4")


def _served_vectors(live: LiveIndex) -> dict[str, np.ndarray]:
    """Every live passage id -> the vector it is searched with (base rows, then segment)."""
    view = live._view
    with open_index(view.base.path, verify=False) as base:
        vecs = base.get_vectors(range(len(base)))
        passages = base.get_passages(range(len(base)))
    out = {p.id: vecs[r] for r, p in enumerate(passages) if r not in view.hidden_rows}
    out.update(zip((p.id for p in view.segment_passages), view.segment_vectors, strict=True))
    return out


@pytest.fixture
def no_encoding(monkeypatch: pytest.MonkeyPatch):
    """Within the block, any encoder call fails the test."""

    def refuse(*args: object, **kwargs: object) -> np.ndarray:
        raise AssertionError("compaction encoded passages")

    class Patch:
        def __enter__(self) -> None:
            monkeypatch.setattr(Encoder, "encode", refuse)

        def __exit__(self, *exc: object) -> None:
            monkeypatch.undo()

    return Patch()


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "hnsw-sq8", "ivfpq"])
def test_compaction_reuses_the_served_vectors_without_encoding(
    index_type: str, dpr_dirs: tuple[Path, Path], tmp_path: Path, no_encoding
) -> None:
    live = make_live_index(tmp_path, index_type, dpr_dirs)
    _write(live, seed=3)
    served = _served_vectors(live)
    queries = np.random.default_rng(4).standard_normal((4, live.manifest.dim)).astype(np.float32)
    before = live.search(SearchRequest(k=8, query_vectors=queries))
    bm25_before = live.search(
        SearchRequest(["tower paris", "tagnew1 water"], k=5, retrieval="bm25")
    )
    old_manifest = live.manifest

    with no_encoding:
        result = live.compact()
    assert result is not None and result.passages == len(served) == len(live)

    # The new base holds exactly the vectors searched before, each under its passage's id.
    base_dir, version = newest_base(tmp_path / "live")
    assert base_dir is not None and version == live.version == result.version
    with open_index(base_dir) as base:
        ids = [p.id for p in base.get_passages(range(len(base)))]
        stored = np.load(base_dir / VECTORS_FILE)
    assert sorted(ids) == sorted(served)
    np.testing.assert_array_equal(stored, np.stack([served[i] for i in ids]))
    m = live.manifest
    assert (m.index_type, m.encoder, m.query_encoder, m.score_scale, m.max_words, m.views) == (
        old_manifest.index_type,
        old_manifest.encoder,
        old_manifest.query_encoder,
        old_manifest.score_scale,
        old_manifest.max_words,
        old_manifest.views,
    )
    if index_type == "flat":  # exact: the same ids and scores as the base plus segment gave
        _assert_same(before, live.search(SearchRequest(k=8, query_vectors=queries)))
    else:  # approximate types: k live passages each, none of them deleted or replaced
        for hits in live.search(SearchRequest(k=8, query_vectors=queries)):
            assert len(hits) == 8 and {p.id for p in hits} <= set(served)
    # BM25 over an unsharded base is rebuilt with the new corpus's statistics: the tagged
    # document still ranks first for its own term.
    after = live.search(SearchRequest(["tower paris", "tagnew1 water"], k=5, retrieval="bm25"))
    assert after[1][0].id == bm25_before[1][0].id
    live.close()


def test_a_compacted_shard_keeps_its_identity_and_bm25_scores(
    dpr_dirs: tuple[Path, Path], tmp_path: Path, no_encoding
) -> None:
    make_live_index(tmp_path, "flat", dpr_dirs).close()
    shard_dir = split_index(tmp_path / "built", 2, tmp_path / "shards", progress=False)[1]
    parent_shard = read_index_manifest(shard_dir).shard
    assert parent_shard is not None
    live = LiveIndex.create(tmp_path / "live-shard", shard_dir)
    _write_shard(live)
    queries = ["tower paris water", "tagnew1", "tagnew2 river", "king river city"]
    vectors = np.random.default_rng(5).standard_normal((3, live.manifest.dim)).astype("float32")
    bm25_before = live.search(SearchRequest(queries, k=6, retrieval="bm25"))
    dense_before = live.search(SearchRequest(k=6, query_vectors=vectors))
    assert bm25_before[1][0].id == "new-1#0"  # a segment passage found by BM25

    with no_encoding:
        result = live.compact()
    assert result is not None and live.segment_size == 0
    shard = live.manifest.shard
    assert shard == {**parent_shard, "live_version": result.version}
    # Every BM25 score is the one served before (the parent's statistics, not the shard's
    # own), and dense results are unchanged: merged across shards they rank as before.
    _assert_same(bm25_before, live.search(SearchRequest(queries, k=6, retrieval="bm25")))
    _assert_same(dense_before, live.search(SearchRequest(k=6, query_vectors=vectors)))
    live.put(random_document(np.random.default_rng(9), "late", words=30))
    live.close()

    # The compacted shard's manifest validates on open, and a second compaction keeps it.
    with LiveIndex(tmp_path / "live-shard") as again:
        assert again.manifest.shard == shard
        second = again.compact()
        assert second is not None
        assert again.manifest.shard == {**parent_shard, "live_version": second.version}
        assert again.search(SearchRequest(["taglate"], k=1, retrieval="bm25"))[0][0].id == "late#0"

    # Only a compacted shard may hold more rows than its parent slice did, and says so.
    base_dir, _ = newest_base(tmp_path / "live-shard")
    assert base_dir is not None
    data = json.loads((base_dir / "manifest.json").read_text())
    for bad in (-1, "1", None):
        (base_dir / "manifest.json").write_text(
            json.dumps({**data, "shard": {**data["shard"], "live_version": bad}})
        )
        with pytest.raises(IndexLoadError, match="invalid shard field"):
            read_index_manifest(base_dir)


def _write_shard(live: LiveIndex) -> None:
    rng = np.random.default_rng(6)
    live.put_many([random_document(rng, f"new-{i}", words=60) for i in range(4)])
    (first,) = live.list(cursor="w", limit=1).ids
    live.delete(first)  # a base document of this shard
    live.put(random_document(rng, "new-3", words=20))
