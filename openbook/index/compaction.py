"""Building a live index's next base: the one place a live index calls the build API.

:func:`build_base` writes the passages it is given (the old base's live passages, then the
write segment's) as a one-passage-per-line JSONL corpus and builds an index of the same type,
encoders, score scale, views and fitted fusion as ``like`` with ``build_index``; the build
publishes by :mod:`openbook.artifacts`' rules (every file fsynced, checksummed manifest,
rename), into a hidden directory that is renamed to ``out_dir`` only once the fusion is
recorded too, so ``out_dir`` appears complete or not at all.

Parameters: HNSW's M / efConstruction / efSearch and transform, IVF-PQ's ``pq_m`` and
``nprobe``, and ``rerank`` are the base's; IVF's ``nlist`` is chosen again for the new passage
count (a quantizer trained for another corpus size would be too fine or too coarse).
Passages are re-encoded with the base's document encoder: the vectors are those a fresh
build over the same passages gives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from openbook.artifacts import fsync_dir
from openbook.index.build import build_index
from openbook.index.fusion import Fusion, store_fusion
from openbook.index.manifest import Manifest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.types import Passage


def build_base(passages: Iterable[Passage], out_dir: Path, like: Manifest) -> int:
    """Build ``out_dir`` over ``passages`` (ids kept, in order) like ``like``; returns the
    passage count. 0 passages build nothing (an index cannot be empty) and return 0."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    corpus = parent / f".{out_dir.name}.corpus.jsonl"
    building = parent / f".{out_dir.name}.building"
    count, longest = 0, 0
    try:
        with open(corpus, "w", encoding="utf-8") as f:
            for p in passages:
                f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n")
                count += 1
                longest = max(longest, len(p.text.split()))
        if count == 0:
            return 0
        like_spec = IndexSpec.from_manifest(like)
        spec = dataclasses.replace(
            like_spec,
            # Never split again: a passage longer than the base's split (an imported corpus's)
            # must keep its id.
            max_words=max(like.max_words, longest),
            # IVF's lists are sized for the passage count: let the build size them anew.
            ann=dataclasses.replace(like_spec.ann, nlist=None),
        )
        build_index(
            [corpus],
            building,
            spec,
            BuildOptions(input_format="jsonl", progress=False, overwrite=True),
        )
        if like.fusion is not None and {"dense", "bm25"} <= set(like.views):
            store_fusion(building, Fusion.from_dict(like.fusion))
        if out_dir.exists():
            shutil.rmtree(out_dir)  # a base of this version left by a crash after its rename
        os.rename(building, out_dir)
        fsync_dir(parent)
        return count
    finally:
        corpus.unlink(missing_ok=True)
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)
