"""Joining the slices of a parallel build (``parallel.py``) into one logical index.

Write side.

``join_slices(out_root, N)`` checks that all N slices staged for ``out_root`` exist and are
slices of one build (same identity: inputs, encoder and its weights, precision, index type and
parameters, ``score_scale``, N; contiguous rows covering 0..total-1), writes the set's
manifest (``shards.json``) and publishes the staging area as ``out_root`` with one rename.
Missing slices are listed (``if_complete``: a no-op instead, for the pods of an Indexed Job
that finish before the last one), a disagreement is named ("shard 1 was built with encoder
X, shard 0 with Y"). Concurrent joins take turns under a lock, and a set already published is
joined again as a no-op.

Afterwards, optionally: ``install_shards`` links the set into a serving tree beside other
indexes (``into/shard-<i>/<name>``), ``merge_slices`` writes one unsharded index from it
(passages and vectors in row order, indexed as ``build_index`` would), both no-ops where
already done.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from openbook.errors import InternalError, InvalidArgument
from openbook.index.arrays import open_array
from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
from openbook.index.manifest import MANIFEST, IndexLoadError, Manifest
from openbook.index.parallel import (
    SET_MANIFEST,
    IndexSet,
    SetShard,
    check_files,
    difference_text,
    identity_checksum,
    parts_dir,
    read_index_set,
)
from openbook.index.shard import shard_spans
from openbook.index.spec import INDEX_TYPES, AnnParams, BuildOptions, IndexSpec
from openbook.index.stages import (
    BuildSource,
    build_lock,
    locked_file_in_place,
    stage_and_publish,
)
from openbook.index.store import PassageStore
from openbook.index.vectors import ShardProducer, ShardWork, VectorSource
from openbook.storage.artifacts import lock_is_free, publish, staging_dir
from openbook.types import Passage

# ----------------------------------------------------------------------------- joining


@dataclass
class JoinResult:
    """``state``: ``joined`` (published now), ``already joined``, or ``incomplete`` (slices
    listed in ``missing`` are not built yet; only with ``if_complete``)."""

    state: str
    out_root: Path
    index_set: IndexSet | None = None
    missing: list[str] = field(default_factory=list)
    installed: list[Path] = field(default_factory=list)
    merged: Manifest | None = None


def join_slices(
    out_root: Path,
    num_shards: int,
    *,
    if_complete: bool = False,
    into: Path | None = None,
    merge: Path | None = None,
    merge_type: str | None = None,
    progress: bool = True,
) -> JoinResult:
    """Join the N slices staged for ``out_root`` into the set published there (module doc).

    Then, if given, ``into``: install shard i at ``into/shard-<i>/<name>`` (what sharded
    retrievers serve with ``OPENBOOK_INDEX_ROOT=into/shard-<i>``), and ``merge``: write one
    unsharded index there (:func:`merge_slices`). Both are no-ops where already done, so any
    number of pods may run the same join: they take turns (a lock), and the first does the work.
    """
    out_root = Path(out_root)
    if num_shards < 1:
        raise InvalidArgument(f"num-shards must be >= 1, got {num_shards}")
    if merge_type is not None and merge is None:
        raise InvalidArgument("merge_type needs merge (the directory of the merged index)")
    with _join_lock(out_root):
        if out_root.exists():
            index_set = read_index_set(out_root)
            if index_set.num_shards != num_shards:
                raise InvalidArgument(
                    f"{out_root} holds a set of {index_set.num_shards} shards, not {num_shards}"
                )
            res = JoinResult("already joined", out_root, index_set)
        else:
            res = _join_staged(out_root, num_shards, if_complete)
            if res.index_set is None:
                return res
        if into is not None:
            res.installed = install_shards(out_root, into)
        if merge is not None:
            res.merged = merge_slices(
                out_root, merge, index_type=merge_type, options=BuildOptions(progress=progress)
            )
    return res


def _join_staged(out_root: Path, num_shards: int, if_complete: bool) -> JoinResult:
    parts = parts_dir(out_root)
    found: dict[int, tuple[Path, Manifest]] = {}
    missing: list[str] = []
    for i in range(num_shards):
        d = parts / f"shard-{i}"
        visible = [p for p in d.iterdir() if not p.name.startswith(".")] if d.is_dir() else []
        published = [p for p in visible if (p / MANIFEST).is_file()]
        if len(published) > 1:
            raise InvalidArgument(
                f"{d} holds slices of several indexes: {sorted(p.name for p in published)}"
            )
        if published:
            found[i] = (published[0], Manifest.from_file(published[0] / MANIFEST))
        else:
            partial = d.is_dir() and any(p.name.endswith(".partial") for p in d.iterdir())
            missing.append(f"shard {i}" + (" (partial build present)" if partial else ""))
    extra = sorted(
        p.name
        for p in (parts.iterdir() if parts.is_dir() else [])
        if p.name.startswith("shard-")
        and p.name.removeprefix("shard-").isdigit()
        and int(p.name.removeprefix("shard-")) >= num_shards
    )
    if extra:
        raise InvalidArgument(
            f"{parts} holds {', '.join(extra)} beyond the {num_shards} shards asked for: "
            "slices built for another shard count"
        )
    if missing:
        if if_complete:
            return JoinResult("incomplete", out_root, missing=missing)
        raise InvalidArgument(
            f"{len(found)} of {num_shards} slices built; missing: {', '.join(missing)}"
        )

    index_set = _check_slices(found, num_shards)
    for i in range(num_shards):
        _remove_leftovers(parts / f"shard-{i}", keep=index_set.name)
    for p in parts.iterdir():
        if not p.name.startswith("shard-"):
            raise InvalidArgument(
                f"{parts}: unexpected {p.name!r}; nothing but slices belongs there"
            )
    try:
        publish(parts, out_root, manifests={SET_MANIFEST: index_set.to_json()})
    except FileExistsError:  # appeared while we worked: only another join, under our lock, can
        # only another join could have published it, and joins take turns (our lock): a bug
        raise InternalError(f"{out_root} already exists") from None
    return JoinResult("joined", out_root, index_set)


def _check_slices(found: dict[int, tuple[Path, Manifest]], num_shards: int) -> IndexSet:
    """Every slice complete, and all of them slices of one build; errors name what differs."""
    first: dict[str, Any] | None = None
    for i, (path, m) in sorted(found.items()):
        check_files(path, m)
        shard = m.shard
        if shard is None or "build" not in shard:
            raise InvalidArgument(
                f"{path} is not a slice of a parallel build (no shard build record)"
            )
        build = shard["build"]
        if identity_checksum(build) != shard["parent_checksum"]:
            raise InvalidArgument(f"{path}: parent_checksum does not match its build record")
        if shard["index"] != i:
            raise InvalidArgument(f"{path} was built as shard {shard['index']}, found at shard-{i}")
        if first is None:
            first = build
        elif build != first:
            raise InvalidArgument(
                f"shard {i} cannot join shard 0: "
                + difference_text(build, first, f"shard {i}", "shard 0")
            )
        if (m.name, m.encoder, m.dim, m.index_type, m.score_scale) != (
            build["name"],
            build["encoder"],
            build["dim"],
            build["index_type"],
            build["score_scale"],
        ):
            raise InvalidArgument(f"{path}: manifest disagrees with its build record")
    assert first is not None
    total = first["total"]
    if first["num_shards"] != num_shards:
        raise InvalidArgument(
            f"the slices were built as {first['num_shards']} shards, not {num_shards}"
        )
    shards = []
    for i, (start, stop) in enumerate(shard_spans(total, num_shards)):
        path, m = found[i]
        assert m.shard is not None
        first_row, parent_count = m.shard["row_offset"], m.shard["parent_count"]
        if (first_row, m.count, parent_count) != (start, stop - start, total):
            raise InvalidArgument(
                f"shard {i} holds rows {first_row}..{first_row + m.count - 1} of {parent_count}, "
                f"expected {start}..{stop - 1} of {total}"
            )
        shards.append(SetShard(i, f"shard-{i}/{path.name}", start, m.count, m.checksum))
    return IndexSet(
        name=first["name"],
        count=total,
        num_shards=num_shards,
        parent_checksum=identity_checksum(first),
        build=first,
        shards=shards,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def _remove_leftovers(d: Path, keep: str) -> None:
    """Remove what finished or killed slice builds left beside slice ``keep`` (lock files,
    partial dirs, interrupted publishes); refuse while a rebuild of it (``--overwrite``) runs:
    its lock is held and its partial dir exists. A held lock without a partial dir is a build
    that has just published and is letting go of its lock."""
    entries = list(d.iterdir())
    building = any(p.name.endswith(".partial") for p in entries) and any(
        p.name.endswith(".lock") and lock_is_free(p) is False for p in entries
    )
    if building:
        raise InvalidArgument(f"{d / keep} is being rebuilt (its build lock is held); wait for it")
    for p in entries:
        if p.name == keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def _join_lock(out_root: Path) -> Iterator[None]:
    """One join of ``out_root`` at a time; the others wait (and then find it joined). Like
    ``stages.build_lock`` the file is removed afterwards, so a waiter re-checks that the file it
    locked is still the one in place."""
    out_root.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_root.parent / f".{out_root.name}.join.lock"
    while True:
        lock = open(lock_path, "a+")  # noqa: SIM115 - closed below
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if locked_file_in_place(lock_path, lock):
                break
        except BaseException:
            lock.close()
            raise
        lock.close()  # its holder finished and removed it: lock the new one
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


# ----------------------------------------------------------------------------- installing


def install_shards(set_root: Path, into: Path) -> list[Path]:
    """Install the set at ``set_root`` into a serving tree: shard i at ``into/shard-<i>/<name>``,
    beside other indexes' shards. Files are hard-linked (copied where the file system cannot
    link), each shard directory published whole by a rename; a shard already there with the
    same checksum is kept, and any other index of that name is refused before anything is
    installed."""
    set_root, into = Path(set_root), Path(into)
    index_set = read_index_set(set_root)
    dests = [(s, into / f"shard-{s.index}" / index_set.name) for s in index_set.shards]
    todo = [(s, dest) for s, dest in dests if not _installed(dest, s)]
    for s, dest in todo:
        src = set_root / s.path
        with staging_dir(dest) as tmp:
            # The manifest goes in last, as publish writes every manifest: until then the
            # directory does not look like an index to anything listing the tree.
            _link_tree(src, tmp, skip=MANIFEST)
            try:
                publish(tmp, dest, manifests={MANIFEST: (src / MANIFEST).read_text()})
            except FileExistsError:  # another installer was faster: fine if it is this shard
                if not _installed(dest, s):
                    raise
    return [dest for _, dest in dests]


def _installed(dest: Path, s: SetShard) -> bool:
    if not dest.exists():
        return False
    try:
        m = Manifest.from_file(dest / MANIFEST)
    except IndexLoadError:
        m = None
    if m is None or m.checksum != s.checksum:
        raise InvalidArgument(
            f"{dest} exists and is another index: build under a new name and swap to it"
        )
    return True


def _link_tree(src: Path, dst: Path, skip: str) -> None:
    for p in sorted(src.rglob("*")):
        target = dst / p.relative_to(src)
        if p.relative_to(src).as_posix() == skip:
            continue
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)
        except OSError:  # no hard links here (another file system, SMB): copy
            shutil.copy2(p, target)


# ----------------------------------------------------------------------------- merging


def merge_slices(
    set_root: Path,
    out_dir: Path,
    *,
    index_type: str | None = None,
    options: BuildOptions | None = None,
) -> Manifest:
    """One unsharded index at ``out_dir`` from the set at ``set_root``: its passages and vectors
    in row order, indexed as ``build_index`` would (so a flat merge searches exactly like an
    unsharded build over the same vectors). ``index_type`` (default: the slices') may be any
    dense type for dense slices, e.g. ``hnsw-sq8``, trained here on all vectors. Resumable like
    a build; an existing ``out_dir`` that is this merge already is returned as it is.
    ``options``: its ``shard_size`` and ``progress`` (nothing is encoded)."""
    started = time.monotonic()
    options = options or BuildOptions()
    set_root, out_dir = Path(set_root), Path(out_dir)
    index_set = read_index_set(set_root)
    paths = [set_root / s.path for s in index_set.shards]
    m0 = Manifest.from_file(paths[0] / MANIFEST)
    index_type = index_type or m0.index_type
    if m0.dense != (index_type != "bm25"):
        raise InvalidArgument(
            f"cannot merge {m0.index_type} slices into a {index_type} index: dense slices merge "
            "into a dense type, bm25 slices into bm25"
        )
    if index_type not in INDEX_TYPES:
        raise InvalidArgument(f"unknown index type {index_type!r}")
    if out_dir.exists():
        m = Manifest.from_file(out_dir / MANIFEST)
        same = (m.name, m.count, m.encoder, m.dim, m.index_type, m.shard) == (
            index_set.name,
            index_set.count,
            m0.encoder,
            m0.dim,
            index_type,
            None,
        )
        if not same:
            raise InvalidArgument(f"{out_dir} already exists and is not this merge")
        return m

    # The slices' spec, and their parameters where the merge keeps their type; one bm25 view
    # is rebuilt over all passages (the slices' are per slice).
    spec = IndexSpec.from_manifest(m0)
    if index_type != m0.index_type:
        spec = replace(spec, index_type=index_type, ann=AnnParams())
    vectors = None
    if m0.dense:
        vectors = VectorSource.like(
            m0,
            digest=lambda: index_set.parent_checksum,
            produce=_slice_vectors(paths, [s.row_offset for s in index_set.shards]),
            desc="merging",
            inputs=tuple(p / VECTORS_FILE for p in paths),
        )

    def passages() -> Iterator[Passage]:
        for p, s in zip(paths, index_set.shards, strict=True):
            store = PassageStore(p / PASSAGES_FILE)
            try:
                for batch in store.iter_passages(0, s.count):
                    yield from batch
            finally:
                store.close()

    source = BuildSource(
        inputs=[set_root / SET_MANIFEST],
        input_format=m0.input_format,
        vectors=vectors,
        passages=passages,
        fingerprint_extra={"merge_of": index_set.parent_checksum},
        fusion=m0.fusion,  # the slices' fusion, if one was fitted on them
    )
    with build_lock(out_dir):
        return stage_and_publish(out_dir, spec, options, source, started)


def _slice_vectors(paths: list[Path], offsets: list[int]) -> ShardProducer:
    """A ``ShardProducer`` reading global rows from the slices' ``vectors.npy`` files."""

    def produce(work: ShardWork) -> Iterator[tuple[int, np.ndarray]]:
        mats = [open_array(p / VECTORS_FILE) for p in paths]
        ends = [o + len(m) for o, m in zip(offsets, mats, strict=True)]
        for i in work.todo:
            a, b = work.spans[i]
            out = np.empty((b - a, mats[0].shape[1]), dtype=np.float32)
            for off, end, mat in zip(offsets, ends, mats, strict=True):
                lo, hi = max(a, off), min(b, end)
                if lo < hi:
                    out[lo - a : hi - a] = mat[lo - off : hi - off]
            work.update(b - a)
            yield i, out

    return produce
