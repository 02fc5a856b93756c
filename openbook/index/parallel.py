"""One logical index built as N slices in parallel (N GPUs or nodes), then joined or merged.

Write side.

``build_slice(inputs, out_root, spec, options, num_shards=N, shard_id=I)`` embeds and indexes
slice I: the input's passages (after ``read_passages``' splitting) are numbered 0..total-1 and
slice I is ``shard_spans(total, N)[I]``, the contiguous rows ``split_index`` would give shard I. The
slice is a complete serving shard (its own passages, vectors, faiss or bm25 index, manifest
with ``shard`` filled), built resumably exactly like ``build_index`` (partial dir, verified
embedding shards, its own lock) and published atomically into a staging area that nothing
serves: ``<out_root parent>/.<out_root name>.parts/shard-<I>/<name>``.

``join.join_slices(out_root, N)`` checks that all N slices are there and agree, writes the
set's manifest (:data:`SET_MANIFEST`, read back by :func:`read_index_set`) and publishes the
staging area as ``out_root`` with one rename: ``out_root/shard-<i>/<name>``, the layout
``split_index`` writes, so retriever i serves it with ``OPENBOOK_INDEX_ROOT=out_root/shard-<i>``.
It can then install the shards into a serving tree that holds other indexes too (hard links,
each shard directory appearing whole by a rename) and/or merge them into one unsharded index.

Invariants:

* Every slice computes the identity of the whole logical build on its own, without talking to
  the others (:func:`build_identity`: the inputs' content, format, ``max_words``, passage
  count, encoder and a digest of its weights, query encoder, precision, index type and
  parameters, ``score_scale``, N). Its sha256 is every slice's ``shard.parent_checksum``; the
  identity itself is kept in ``shard.build`` so that a join can name the setting that differs.
* Nothing half-written is ever served: a slice appears under its final name only when
  complete (``publish``), slices live in a hidden staging area until all N agree, and the set
  appears at ``out_root`` by one rename. A join with slices missing lists them (``if_complete``
  makes that a no-op, so in an Indexed Job each pod runs its build and then a join, and the
  last one to finish joins). Concurrent joins wait for each other (a lock) and a join of a set
  that is already published is a no-op, as is a slice build whose set is already published.
* Index types: ``flat`` slices, merged by score, serve exactly the unsharded top-k; ``hnsw``
  graphs are per slice (as approximate as any HNSW, as with ``split_index``); ``bm25`` slices
  score with per-slice IDF (a merge rebuilds one bm25 over all passages, identical to the
  unsharded one). ``ivfpq`` and ``hnsw-sq8`` train a quantizer on the whole corpus, which
  slices built apart cannot share: they are refused per slice; build ``flat`` slices (the
  encoding is the expensive, parallel part) and merge them into the trained type, then
  ``split_index`` the merged index if it must be served sharded (its shards reuse the merged
  quantizer).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from openbook.errors import InvalidArgument
from openbook.index import faiss_index
from openbook.index.encoders import Encoder
from openbook.index.manifest import MANIFEST, IndexLoadError, Manifest, combined_checksum
from openbook.index.passages import detect_format, read_passages
from openbook.index.shard import shard_spans
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import (
    BM25_PARAMS,
    BuildSource,
    build_lock,
    check_inputs,
    stage_and_publish,
)
from openbook.index.vectors import (
    VectorSource,
    default_score_scale,
    document_encoder,
    encoder_source,
)
from openbook.storage.artifacts import sha256_file, verify_files
from openbook.types import Passage

SET_MANIFEST = "shards.json"  # in out_root: the slices that make up the logical index
SET_FORMAT_VERSION = 1
PARTS_SUFFIX = ".parts"
_TRAINED_TYPES = ("hnsw-sq8", "ivfpq")
# How a join names the first setting two slices disagree on: causes before their consequences
# (max_words before the passage count it changes); anything not listed comes last.
_IDENTITY_ORDER = (
    "name",
    "num_shards",
    "encoder",
    "precision",  # before the weights: their digest records the precision too
    "encoder_weights",
    "query_encoder",
    "dim",
    "normalize",
    "index_type",
    "index_params",
    "score_scale",
    "views",
    "input_format",
    "max_words",
    "inputs",
    "total",
)
_LABELS = {"encoder_weights": "encoder weights (digest)", "num_shards": "shard count"}


def parts_dir(out_root: Path) -> Path:
    """The hidden staging area where slices wait for the join: ``.<out_root name>.parts``."""
    out_root = Path(out_root)
    return out_root.parent / f".{out_root.name}{PARTS_SUFFIX}"


def slice_dir(out_root: Path, shard_id: int, name: str) -> Path:
    """Where slice ``shard_id`` is published before the join."""
    return parts_dir(out_root) / f"shard-{shard_id}" / name


# ----------------------------------------------------------------------------- identity


def _inputs_identity(inputs: list[Path], input_format: str) -> list[dict[str, Any]]:
    """The inputs' content, in order: sha256, size and the format each is read as.

    Content, not path or mtime: slices on different nodes may mount the shared volume at
    different paths, and a copy of the corpus (a re-download, an rsync without -t) has new
    mtimes but the same passages. Hashing is one sequential read (DPR's Wikipedia, ~13 GB:
    ~30 s at sha256's ~0.5 GB/s, longer on slow network storage), small next to the hours of
    encoding it protects.
    """
    return [
        {
            "sha256": sha256_file(p),
            "size": p.stat().st_size,
            "format": detect_format(p) if input_format == "auto" else input_format,
        }
        for p in inputs
    ]


def count_passages(inputs: list[Path], input_format: str, max_words: int) -> int:
    """The number of passages ``read_passages`` yields, refusing duplicate ids as a build would
    (a slice sees only its own rows, so a duplicate across slices is caught here or never).

    Memory: one 8-byte hash per passage (~170 MB for Wikipedia's 21M; Python's string hash,
    consistent within this process, which is all it is used for); ids whose hashes collide
    are compared exactly in a second pass.
    """
    hashes = np.fromiter(
        (hash(p.id) for p in read_passages(inputs, input_format, max_words)), dtype=np.int64
    )
    total = len(hashes)
    hashes.sort()
    clashes = set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())
    if clashes:
        seen: set[str] = set()
        for p in read_passages(inputs, input_format, max_words):
            if hash(p.id) in clashes:
                if p.id in seen:
                    raise InvalidArgument(f"duplicate passage id {p.id!r}")
                seen.add(p.id)
    return total


def build_identity(
    *,
    name: str,
    inputs: list[dict[str, Any]],
    input_format: str,
    max_words: int,
    total: int,
    num_shards: int,
    index_type: str,
    index_params: dict[str, Any],
    score_scale: float,
    encoder: Encoder | None,
    encoder_weights: str | None,
    query_encoder: str | None,
    precision: str | None,
    views: list[str] | None = None,
) -> dict[str, Any]:
    """What the whole logical build is, as every slice computes it alone (module docstring)."""
    identity = {
        "name": name,
        "inputs": inputs,
        "input_format": input_format,
        "max_words": max_words,
        "total": total,
        "num_shards": num_shards,
        "index_type": index_type,
        "index_params": index_params,
        "score_scale": float(score_scale),
        "encoder": encoder.name if encoder else None,
        "encoder_weights": encoder_weights,
        "query_encoder": query_encoder,
        "dim": encoder.dim if encoder else 0,
        "normalize": bool(encoder.normalize) if encoder else False,
        "precision": precision,
    }
    if views is not None and views != ["dense"] and views != ["bm25"]:
        # Only where there is more than the type implies, so that the identity (and with it
        # the checksum) of a build without a second view is what it was before views existed.
        identity["views"] = views
    return identity


def identity_checksum(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _identity_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first key (in :data:`_IDENTITY_ORDER`) whose values differ, or None."""
    keys = [k for k in _IDENTITY_ORDER if k in a or k in b]
    keys += sorted((a.keys() | b.keys()) - set(keys))
    for key in keys:
        if a.get(key) != b.get(key):
            return key
    return None


def _show(key: str, value: Any) -> str:
    if key == "inputs" and isinstance(value, list):
        return (
            "["
            + ", ".join(f"{v.get('size')} B sha256 {v.get('sha256', '')[:12]}" for v in value)
            + "]"
        )
    if key == "encoder_weights" and isinstance(value, str):
        return value[:12]
    return repr(value)


# ----------------------------------------------------------------------------- building a slice


@dataclass(frozen=True)
class SliceResult:
    """A slice build's outcome: ``state`` is ``built``, ``already built`` (the staged slice
    is this build's) or ``already joined`` (``out_root`` holds this build's set)."""

    manifest: Manifest
    path: Path
    state: str
    span: tuple[int, int]
    total: int


def build_slice(
    inputs: list[Path],
    out_root: Path,
    spec: IndexSpec,
    options: BuildOptions | None = None,
    *,
    num_shards: int,
    shard_id: int,
) -> SliceResult:
    """Build slice ``shard_id`` of ``num_shards`` of ``spec`` over ``inputs`` (module doc).

    ``options.overwrite`` replaces a staged slice built from something else (otherwise
    refused, naming what differs). Otherwise as :func:`openbook.index.build.build_index`.
    """
    started = time.monotonic()
    options = options or BuildOptions()
    out_root = Path(out_root)
    inputs = [Path(p) for p in inputs]
    name, index_type = spec.name, spec.index_type
    if num_shards < 1:
        raise InvalidArgument(f"num-shards must be >= 1, got {num_shards}")
    if not 0 <= shard_id < num_shards:
        raise InvalidArgument(
            f"shard-id {shard_id} out of range for {num_shards} shards "
            f"(expected 0..{num_shards - 1})"
        )
    if index_type in _TRAINED_TYPES:
        raise InvalidArgument(
            f"index type {index_type!r} trains a quantizer on the whole corpus, which slices "
            f"built apart cannot share: build flat slices and join them with --merge DIR "
            f"--merge-type {index_type} (then `openbook index shard` the merged index to serve "
            "it sharded)"
        )
    out = slice_dir(out_root, shard_id, name)
    check_inputs(inputs, out, True)
    if "/" in name or name.startswith("."):
        raise InvalidArgument(f"index name {name!r} must be a plain, visible directory name")

    doc_enc: Encoder | None = None
    source: VectorSource | None = None
    q_name = resolved = weights = None
    params: dict[str, Any] = dict(BM25_PARAMS)
    if spec.dense:
        doc_enc, q_name, resolved = document_encoder(spec, options)
        source = encoder_source(doc_enc, q_name, options.batch_size, resolved)
        weights = source.digest()
        params = faiss_index.default_params(index_type, 0, doc_enc.dim, spec.ann)
    score_scale = spec.score_scale
    if score_scale is None:
        score_scale = default_score_scale(doc_enc)
        spec = replace(spec, score_scale=score_scale)
    input_format, max_words = options.input_format, spec.max_words

    total = count_passages(inputs, input_format, max_words)
    if num_shards > total:
        raise InvalidArgument(f"cannot split {total} passages into {num_shards} shards")
    identity = build_identity(
        name=name,
        inputs=_inputs_identity(inputs, input_format),
        input_format=input_format,
        max_words=max_words,
        total=total,
        num_shards=num_shards,
        index_type=index_type,
        index_params=params,
        score_scale=score_scale,
        encoder=doc_enc,
        encoder_weights=weights,
        query_encoder=q_name,
        precision=resolved,
        views=spec.views,
    )
    checksum = identity_checksum(identity)
    start, stop = shard_spans(total, num_shards)[shard_id]

    def result(m: Manifest, path: Path, state: str) -> SliceResult:
        return SliceResult(m, path, state, (start, stop), total)

    if out_root.exists():
        index_set = read_index_set(out_root)
        if index_set.parent_checksum != checksum:
            raise InvalidArgument(
                f"{out_root} already holds another index set "
                f"({difference_text(index_set.build, identity, 'it', 'this build')}); "
                "remove it or build into another --out"
            )
        path = out_root / index_set.shards[shard_id].path
        return result(Manifest.from_file(path / MANIFEST), path, "already joined")
    if (done := _staged(out)) is not None:
        staged = (done.shard or {}).get("build")
        if done.shard and done.shard.get("parent_checksum") == checksum:
            return result(done, out, "already built")
        if not options.overwrite:
            why = difference_text(staged or {}, identity, "it", "this build")
            raise InvalidArgument(
                f"{out} holds a slice of another build ({why}); pass --overwrite to replace it"
            )

    shard = {
        "index": shard_id,
        "count": num_shards,
        "row_offset": start,
        "parent_count": total,
        "parent_checksum": checksum,
        "build": identity,
    }

    def passages() -> Iterator[Passage]:
        return islice(read_passages(inputs, input_format, max_words), start, stop)

    with build_lock(out):
        manifest = stage_and_publish(
            out,
            spec,
            options,
            BuildSource(
                inputs=inputs,
                input_format=input_format,
                vectors=source,
                passages=passages,
                shard=shard,
                fingerprint_extra={"parent_checksum": checksum, "rows": [start, stop]},
            ),
            started,
        )
    return result(manifest, out, "built")


def _staged(path: Path) -> Manifest | None:
    """The manifest of a published slice at ``path``, or None where there is none."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        return Manifest.from_file(path / MANIFEST)
    except IndexLoadError:
        return None


def difference_text(a: dict, b: dict, a_name: str, b_name: str) -> str:
    key = _identity_difference(a, b)
    if key is None:
        return "its manifest does not match its build record"
    label = _LABELS.get(key, key)
    a_value, b_value = _show(key, a.get(key)), _show(key, b.get(key))
    return f"{a_name} was built with {label} {a_value}, {b_name} with {b_value}"


# ----------------------------------------------------------------------------- the set


@dataclass(frozen=True)
class SetShard:
    index: int
    path: str  # relative to the set's root: shard-<i>/<name>
    row_offset: int
    count: int
    checksum: str  # the shard manifest's checksum


@dataclass(frozen=True)
class IndexSet:
    """``out_root/shards.json``: the slices that make up one logical index."""

    name: str
    count: int
    num_shards: int
    parent_checksum: str
    build: dict[str, Any]
    shards: list[SetShard]
    created_at: str = ""
    format_version: int = SET_FORMAT_VERSION

    def to_json(self) -> str:
        data = {
            "format_version": self.format_version,
            "name": self.name,
            "count": self.count,
            "num_shards": self.num_shards,
            "parent_checksum": self.parent_checksum,
            "build": self.build,
            "shards": [s.__dict__ for s in self.shards],
            "created_at": self.created_at,
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def read_index_set(root: Path) -> IndexSet:
    """The set published at ``root``, its shards' manifests checked against it (sizes and the
    manifests' checksums; the retriever re-hashes every file when it loads a shard)."""
    root = Path(root)
    path = root / SET_MANIFEST
    if not path.is_file():
        raise IndexLoadError(f"{root}: not a joined index set ({SET_MANIFEST} missing)")
    try:
        data = json.loads(path.read_text())
        if data.get("format_version") != SET_FORMAT_VERSION:
            raise IndexLoadError(
                f"{path}: format_version {data.get('format_version')!r} not supported"
            )
        index_set = IndexSet(
            name=data["name"],
            count=data["count"],
            num_shards=data["num_shards"],
            parent_checksum=data["parent_checksum"],
            build=data["build"],
            shards=[SetShard(**s) for s in data["shards"]],
            created_at=data.get("created_at", ""),
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise IndexLoadError(f"{path}: not a valid index set ({e})") from None
    if len(index_set.shards) != index_set.num_shards:
        raise IndexLoadError(
            f"{path}: lists {len(index_set.shards)} of {index_set.num_shards} shards"
        )
    for s in index_set.shards:
        m = Manifest.from_file(root / s.path / MANIFEST)
        if m.checksum != s.checksum:
            raise IndexLoadError(f"{root / s.path}: manifest checksum differs from {SET_MANIFEST}")
        check_files(root / s.path, m)
    return index_set


def check_files(path: Path, m: Manifest) -> None:
    if problem := verify_files(path, sizes=m.sizes):
        raise IndexLoadError(f"{path}: {problem}")
    if combined_checksum(m.files) != m.checksum:
        raise IndexLoadError(f"{path}: manifest checksum does not match its file list")
