"""Split an index into shards served by separate retrievers, and merge their results.

Write side (``split_index``); ``merge_results`` is the gateway's read side.

``split_index`` cuts an index into ``n`` contiguous row ranges; shard ``i`` is a complete index
directory (its own passages, vectors slice, index, manifest and checksums) at
``out_root/shard-<i>/<dir name of the source>``, so retriever ``i`` runs with
``OPENBOOK_INDEX_ROOT=out_root/shard-<i>`` and serves it under the same name as before. A query
fans out to every shard and the gateway's ``merge_results``
(:mod:`openbook_gateway.retrieval`) keeps the top-k by score.

Exactness of merged results vs. the unsharded index, per type:

* ``flat``: identical passages and scores (up to float rounding).
* ``ivfpq`` / ``hnsw-sq8``: shards reuse the parent's trained quantizer, so each vector has
  the score it has in the parent; ivfpq shards probe the same lists as the parent, so merged
  results equal the parent's (with ``rerank``, every shard re-ranks ``k * rerank`` candidates
  of its own: at least as good). HNSW graphs are rebuilt per shard, so hnsw / hnsw-sq8 results
  are as approximate as any HNSW search (merged recall is usually a bit higher: every shard
  is searched with the full efSearch).
* ``bm25`` (and the bm25 view of a dense index): a shard keeps its documents' entries of the
  parent's BM25 matrix (:func:`openbook.index.bm25.slice_bm25`), whose scores already hold
  the whole corpus's IDF and average length: every shard scores as the parent does, and
  merged results equal the unsharded index's. (Slices of a parallel build are indexed apart
  and use per-slice statistics instead; see ``parallel.py``.)
* hybrid: the parent's ``fusion`` (fitted or not) goes into every shard's manifest. A shard
  scores its own candidates (its dense and BM25 top N) with exact features and the parent's
  weights, and the gateway merges by fused score. Any passage in the parent's candidate set is
  in its shard's (a global top N member is in its shard's top N), so merged results equal the
  unsharded index's, or beat it where a shard's extra candidates score higher.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from openbook.errors import InvalidArgument
from openbook.index import faiss_index
from openbook.index.arrays import open_array
from openbook.index.bm25 import BM25_DIR, slice_bm25
from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
from openbook.index.loaded import open_index
from openbook.index.manifest import MANIFEST, Manifest, checksum_fields
from openbook.index.store import PassageStore, PassageWriter
from openbook.storage.artifacts import clean_stale_partials, publish, staging_dir

_TRAINED_TYPES = ("hnsw-sq8", "ivfpq")  # types whose quantizer the shards inherit


def shard_spans(count: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row ranges whose sizes differ by at most one."""
    return [(i * count // n_shards, (i + 1) * count // n_shards) for i in range(n_shards)]


def split_index(src: Path, n_shards: int, out_root: Path, progress: bool = True) -> list[Path]:
    """Split the index at ``src`` into ``n_shards`` shard indexes; returns their directories.

    The source is verified first (every checksum). All shards are written into a hidden
    staging directory beside ``out_root`` and published as ``out_root`` together
    (:mod:`openbook.storage.artifacts`), so ``out_root`` never holds a partial set. Passage ids are
    the parent's; rows are renumbered from 0 per shard (``manifest.shard["row_offset"]`` maps them
    back).
    """
    src, out_root = Path(src), Path(out_root)
    if n_shards < 2:
        raise InvalidArgument(f"need at least 2 shards, got {n_shards}")
    if out_root.exists():
        raise InvalidArgument(f"{out_root} already exists")
    with open_index(src, verify=True) as parent:
        m = parent.manifest
    if out_root.resolve().is_relative_to(src.resolve()):
        raise InvalidArgument(f"{out_root} is inside the source index {src}")
    if m.shard is not None:
        raise InvalidArgument(f"{src} is already shard {m.shard['index']} of {m.shard['count']}")
    if n_shards > m.count:
        raise InvalidArgument(f"cannot split {m.count} passages into {n_shards} shards")

    name = src.resolve().name  # retrievers serve an index under its directory name
    # What interrupted splits left: shards are cheap to redo.
    clean_stale_partials(out_root.parent, name=out_root.name)
    with staging_dir(out_root) as work:
        template = _trained_template(src, m)
        manifests = {}
        for i, (start, stop) in enumerate(shard_spans(m.count, n_shards)):
            shard = {
                "index": i,
                "count": n_shards,
                "row_offset": start,
                "parent_count": m.count,
                "parent_checksum": m.checksum,
            }
            rel = f"shard-{i}/{name}"
            sm = _write_shard(src, m, work / rel, start, stop, shard, template, progress)
            manifests[f"{rel}/{MANIFEST}"] = sm.to_json()
        try:
            publish(work, out_root, manifests=manifests)
        except FileExistsError:  # appeared while we worked
            raise InvalidArgument(f"{out_root} already exists") from None
    return [out_root / f"shard-{i}" / name for i in range(n_shards)]


def _trained_template(src: Path, m: Manifest):
    """The parent's index emptied of vectors (keeping its training), for compressed types."""
    if m.index_type not in _TRAINED_TYPES:
        return None
    index = faiss_index.read(src / faiss_index.INDEX_FILE)
    index.reset()
    return index


def _write_shard(
    src: Path,
    m: Manifest,
    out: Path,
    start: int,
    stop: int,
    shard: dict,
    template,
    progress: bool,
) -> Manifest:
    """Write shard ``shard`` (rows ``[start, stop)`` of the index at ``src``) into ``out``;
    return its manifest, which the caller publishes with it."""
    t0 = time.monotonic()
    out.mkdir(parents=True)
    store = PassageStore(src / PASSAGES_FILE)
    writer = PassageWriter(out / PASSAGES_FILE)
    try:
        for batch in store.iter_passages(start, stop):
            writer.add(batch)
    finally:
        writer.close()
        store.close()

    count = stop - start
    desc = f"shard {shard['index'] + 1}/{shard['count']} ({m.index_type})"
    params = dict(m.index_params)
    with tqdm(total=count, unit="psg", desc=desc, disable=not progress) as bar:
        if m.dense:
            parent_vecs = open_array(src / VECTORS_FILE)
            vecs = np.lib.format.open_memmap(
                out / VECTORS_FILE, mode="w+", dtype=np.float32, shape=(count, m.dim)
            )
            for s in range(0, count, 100_000):
                vecs[s : s + 100_000] = parent_vecs[start + s : min(start + s + 100_000, stop)]
            vecs.flush()
            if template is not None:
                index = faiss_index.fill_trained(template, vecs, m.index_type, params, bar.update)
            else:  # flat / hnsw need no training: build as build_index does, same params
                index, params = faiss_index.build_faiss(vecs, m.index_type, params, bar.update)
            del vecs
            faiss_index.write(index, out / faiss_index.INDEX_FILE)
        if "bm25" in m.views:  # a bm25 index, or the bm25 view of a dense one
            slice_bm25(src / BM25_DIR, out / BM25_DIR, start, stop)
            if not m.dense:
                bar.update(count)

    return dataclasses.replace(
        m,
        count=count,
        index_params=params,
        **checksum_fields(out),
        build_seconds=round(time.monotonic() - t0, 3),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        shard=shard,
    )
