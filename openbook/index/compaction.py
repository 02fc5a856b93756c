"""Building a live index's next base from what the index already holds: nothing is encoded.

Write side; the one place a live index calls the build stages. :func:`build_base` builds an
index of the same type, encoders, score scale, views, fusion and shard as ``like`` over the
old base's live rows (in row order) followed by the write segment's passages, through
:func:`openbook.index.stages.stage_and_publish` with a :class:`BuildSource` whose vectors are
read, not computed:

* **Vectors.** Every dense index directory keeps each row's exact float32 vector in
  ``vectors.npy`` whatever its type (:mod:`openbook.index.layout`; ``open_index`` refuses a
  dense index without it, since rerank and hybrid scoring read it): flat, hnsw, hnsw-sq8,
  ivfpq and the shards ``split_index`` writes alike. So the old base's live rows are gathered
  from its ``vectors.npy`` (never reconstructed from a compressed faiss index, which for
  hnsw-sq8 and ivfpq would be lossy), and the segment's from the write log's vectors (the
  ones its searches scored with). The new base's vectors are therefore exactly the vectors the
  live index served before the compaction, and a compacted flat index returns the same ids
  and scores (up to float rounding) as the base plus segment did. A fresh build over the same
  passages would give the same vectors too, up to the encoder's own run-to-run rounding.
* **The faiss index** is built from those vectors as ``build_index`` builds it, with the old
  base's parameters (HNSW's M / efConstruction / efSearch and transform, IVF-PQ's ``pq_m``,
  ``nprobe`` and ``rerank``); hnsw-sq8's and ivfpq's quantizers are trained again on the new
  vectors, and IVF's ``nlist`` is chosen again for the new passage count (lists sized for
  another corpus would be too fine or too coarse).
* **BM25.** An unsharded base gets a BM25 view built over every passage, with the new
  corpus's statistics: what a fresh build gives. A shard's base (``manifest.shard``, written by
  ``split_index``) does not: its BM25 scores carry the parent's statistics (whole-corpus IDF
  and average length, :func:`openbook.index.bm25.slice_bm25`), which is what lets the gateway
  merge the shards' BM25 hits by score. A view rebuilt over the shard's own passages would
  score with the shard's statistics, differently on every shard. So a compacted shard keeps
  the scores its base holds for its kept rows and gives the segment's passages the scores the
  live index was already serving them with (:func:`openbook.index.segment_bm25.fold_bm25`):
  a compaction changes no BM25 score of a shard.
* **Identity.** ``name``, ``max_words`` (future documents split as before; passages are
  stored as given, never split again), ``input_format``, the fitted fusion, and a shard's
  ``shard`` (its index, shard count and parent checksum, hence the label its version is
  published under) are ``like``'s; a compacted shard's ``shard`` gains ``live_version`` (its
  rows are its own now, no longer ``row_offset``.. of the parent's).

Published by :mod:`openbook.storage.artifacts`' rules (every file fsynced, checksummed manifest,
rename): ``out_dir`` appears complete or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from openbook.index.arrays import open_array
from openbook.index.bm25 import BM25_DIR
from openbook.index.layout import VECTORS_FILE
from openbook.index.manifest import Manifest
from openbook.index.segment_bm25 import BaseBM25Statistics, PassageTerms, fold_bm25
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import BuildSource, build_lock, stage_and_publish
from openbook.index.vectors import ShardProducer, ShardWork, VectorSource
from openbook.types import Passage


@dataclass(frozen=True)
class BaseInputs:
    """What the next base is made of, in its row order: the old base's rows ``base_rows``
    (ascending), then the segment's passages.

    ``base_dir``: the old base's directory (None: an index created empty, no rows);
    ``passages``: yields every new row's passage, in order; ``segment_vectors``: the
    segment's float32 ``(segment passages, dim)`` (None on a bm25 index);
    ``segment_terms``: the segment's passages' BM25 terms, in order; ``bm25``: the
    statistics the live index scored the segment with (a shard's BM25 view keeps them).
    """

    base_dir: Path | None
    base_rows: np.ndarray
    passages: Callable[[], Iterator[Passage]]
    segment_vectors: np.ndarray | None
    segment_terms: Sequence[PassageTerms]
    bm25: BaseBM25Statistics | None

    @property
    def count(self) -> int:
        return len(self.base_rows) + len(self.segment_terms)


def build_base(inputs: BaseInputs, out_dir: Path, like: Manifest, version: int) -> int:
    """Build ``out_dir`` over ``inputs`` like ``like`` (module docstring), as the base of
    ``version``; returns the passage count. 0 passages build nothing (an index cannot be
    empty) and return 0."""
    started = time.monotonic()
    out_dir = Path(out_dir)
    count = inputs.count
    if count == 0:
        return 0
    like_spec = IndexSpec.from_manifest(like)
    # IVF's lists are sized for the passage count: let the build size them anew.
    spec = replace(like_spec, ann=replace(like_spec.ann, nlist=None))
    vectors = None
    if like.dense:
        vectors = VectorSource.like(
            like,
            digest=lambda: f"compaction of {like.checksum} at version {version}",
            produce=_stored_vectors(inputs, like.dim),
            desc="compacting",
        )
    shard = None if like.shard is None else {**like.shard, "live_version": version}
    fold = None
    if like.shard is not None and "bm25" in like.views and inputs.bm25 is not None:
        base_bm25 = None if inputs.base_dir is None else inputs.base_dir / BM25_DIR
        stats, terms, rows = inputs.bm25, inputs.segment_terms, inputs.base_rows

        def fold(out: Path) -> None:
            fold_bm25(base_bm25, rows, stats, terms, out)

    source = BuildSource(
        inputs=[],
        input_format=like.input_format,
        vectors=vectors,
        passages=inputs.passages,
        shard=shard,
        # Never resumed: an interrupted compaction's partial directory is removed on open.
        fingerprint_extra={"compaction_of": like.checksum, "version": version},
        fusion=like.fusion,
        bm25=fold,
    )
    options = BuildOptions(progress=False, overwrite=True)
    with build_lock(out_dir):
        stage_and_publish(out_dir, spec, options, source, started)
    return count


def _stored_vectors(inputs: BaseInputs, dim: int) -> ShardProducer:
    """A ``ShardProducer`` over the new rows: the old base's stored vectors of
    ``inputs.base_rows``, then the segment's."""
    kept = len(inputs.base_rows)
    segment = inputs.segment_vectors
    if segment is None:
        segment = np.zeros((0, dim), np.float32)

    def produce(work: ShardWork) -> Iterator[tuple[int, np.ndarray]]:
        base = None
        if kept:
            assert inputs.base_dir is not None  # rows come from a base directory
            base = open_array(inputs.base_dir / VECTORS_FILE)
        for i in work.todo:
            a, b = work.spans[i]
            out = np.empty((b - a, dim), dtype=np.float32)
            if a < kept:
                assert base is not None
                # Ascending rows: the mmap is read front to back, one shard's rows at a time.
                out[: min(b, kept) - a] = base[inputs.base_rows[a : min(b, kept)]]
            if b > kept:
                lo = max(a, kept)
                out[lo - a :] = segment[lo - kept : b - kept]
            work.update(b - a)
            yield i, out

    return produce
