"""The stages of writing an index, shared by every way of building one.

Write side. ``build_index``, ``build_slice`` (``parallel.py``), ``import_embeddings``
(``importer.py``) and ``merge_slices`` (``join.py``) differ only in where the passages and
vectors come from (a :class:`BuildSource`); each then takes :func:`build_lock` and calls
:func:`stage_and_publish`, which runs the stages: passages -> SQLite store -> resumable
embedding shards -> ``vectors.npy`` -> faiss index and/or BM25 view -> manifest.

Invariants:

* The build happens in ``<out_dir.parent>/.<out_dir.name>.partial`` and is published as
  ``out_dir`` with its manifest only once complete (:func:`openbook.storage.artifacts.publish`:
  fsync, manifest, rename, fsync), so a half-built index never looks like an index.
* Re-running the same build after an interruption reuses the passage store and every embedding
  shard already written and verified (shape, dtype and sha256), which matters when a shard is
  hours of encoder time. "The same build" is a fingerprint of the inputs (path, size, mtime),
  ``max_words``, ``shard_size``, the vector source's digest and the caller's extra identity;
  a partial directory with another fingerprint is discarded.
* One build per output directory at a time (:func:`build_lock`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm.auto import tqdm

from openbook.errors import InternalError, InvalidArgument
from openbook.index import faiss_index
from openbook.index.arrays import open_array
from openbook.index.bm25 import BM25_DIR, build_bm25
from openbook.index.layout import BUILD_STATE_DIR, PASSAGES_FILE, VECTORS_FILE, build_lock_path
from openbook.index.manifest import MANIFEST, Manifest, checksum_fields
from openbook.index.passages import read_passages
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.store import PassageStore, PassageWriter
from openbook.index.vectors import ShardWork, VectorSource
from openbook.storage.artifacts import clean_stale_partials, partial_dir, publish, sha256_file
from openbook.types import Passage

BM25_PARAMS = {"k1": 1.5, "b": 0.75, "method": "lucene", "stopwords": "en"}


@dataclass(frozen=True)
class BuildSource:
    """Where one build's passages and vectors come from, and what its manifest records beyond
    the spec.

    ``inputs``: the files the build reads (fingerprinted for resuming); ``input_format``: the
    manifest's; ``passages``: where the passages come from if not ``read_passages(inputs,
    input_format, spec.max_words)``; ``vectors``: a dense index's vectors (None: bm25);
    ``shard``: the manifest's ``shard`` (a slice of a parallel build); ``fingerprint_extra``:
    anything else the passages or vectors depend on, so that a partial build of something else
    is never resumed; ``fusion``: the manifest's ``fusion`` (a merge keeps its slices');
    ``bm25``: writes the BM25 view into the directory it is given, instead of indexing the
    staged passages anew (a compacted shard keeps its parent's statistics: compaction.py).
    """

    inputs: list[Path]
    input_format: str
    vectors: VectorSource | None
    passages: Callable[[], Iterator[Passage]] | None = None
    shard: dict[str, Any] | None = None
    fingerprint_extra: dict[str, Any] | None = None
    fusion: dict[str, Any] | None = None
    bm25: Callable[[Path], None] | None = None


def check_files(inputs: list[Path]) -> None:
    """There are input files, and each exists."""
    if not inputs:
        raise InvalidArgument("no input files given")
    for p in inputs:
        if not p.is_file():
            raise InvalidArgument(f"{p}: no such file")


def check_inputs(inputs: list[Path], out_dir: Path, overwrite: bool) -> None:
    """The input files exist, and ``out_dir`` is free unless it may be overwritten."""
    check_files(inputs)
    if out_dir.exists() and not overwrite:
        raise InvalidArgument(f"{out_dir} already exists (pass overwrite=True / --overwrite)")


def locked_file_in_place(lock_path: Path, lock: IO[str]) -> bool:
    """Whether the file ``lock`` (open, locked) is still the one at ``lock_path``: its holder
    removes it when done, also between any two looks at it (one stat, not an exists() and a
    stat: the file going in between raised FileNotFoundError)."""
    try:
        return os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino
    except FileNotFoundError:
        return False


@contextmanager
def build_lock(out_dir: Path) -> Iterator[None]:
    """One build per index directory at a time (e.g. two init containers on one volume):
    the second fails at once with a clear error instead of corrupting the first's work dir.
    The OS releases the lock when its process dies, so it never goes stale; the lock file is
    removed afterwards, and a holder checks it locked the file that is still in place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = build_lock_path(out_dir)
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not locked_file_in_place(lock_path, lock):
                raise BlockingIOError  # its holder just finished and removed it: retry later
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise RuntimeError(
                f"index {out_dir.name!r} is being built by {holder}; wait for it to finish"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


def stage_and_publish(
    out_dir: Path, spec: IndexSpec, options: BuildOptions, source: BuildSource, started: float
) -> Manifest:
    """Build ``spec`` from ``source`` in ``out_dir``'s partial dir and publish it (module
    docstring); the caller holds :func:`build_lock`. ``spec.score_scale`` must be resolved
    (the encoder's default already chosen); ``started``: ``time.monotonic()`` at the start.

    A dense spec gets a BM25 view too unless ``spec.bm25`` is False (a bm25 index is nothing
    else); ``options.shard_size`` and ``options.progress`` are the options this reads.
    """
    if spec.score_scale is None:
        # a caller's bug, not a client's mistake
        raise InternalError("score_scale must be resolved before the build stages")
    if spec.dense != (source.vectors is not None):
        raise InvalidArgument(
            f"a {spec.index_type} index needs {'' if spec.dense else 'no '}vectors"
        )
    vectors, progress = source.vectors, options.progress
    work = partial_dir(out_dir)
    state = work / BUILD_STATE_DIR
    prepare_workdir(work, state, build_fingerprint(spec, options, source))

    try:
        read = source.passages or (
            lambda: read_passages(source.inputs, source.input_format, spec.max_words)
        )
        count = stage_passages(work, state, read)
        if count == 0:
            raise InvalidArgument("no passages found in the inputs")
    except BaseException:
        # Nothing expensive has been computed yet, so don't leave a partial dir behind.
        shutil.rmtree(work, ignore_errors=True)
        raise

    params: dict[str, Any]
    if vectors is not None:
        stage_vectors(work, state, vectors, count, options.shard_size, progress)
        params = stage_faiss(work, spec, count, vectors.dim, progress)
        if spec.bm25:
            _stage_bm25_view(work, count, progress, source)
    else:
        _stage_bm25_view(work, count, progress, source)
        params = dict(BM25_PARAMS)
    views = spec.views
    fusion = source.fusion if views == ["dense", "bm25"] else None  # needs both views

    shutil.rmtree(state)
    manifest = Manifest(
        name=spec.name,
        encoder=vectors.encoder if vectors else None,
        query_encoder=vectors.query_encoder if vectors else None,
        dim=vectors.dim if vectors else 0,
        count=count,
        index_type=spec.index_type,
        index_params=params,
        **checksum_fields(work),
        normalize=vectors.normalize if vectors else False,
        score_scale=float(spec.score_scale),
        build_seconds=round(time.monotonic() - started, 3),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        input_format=source.input_format,
        max_words=spec.max_words,
        shard=source.shard,
        views=views,
        fusion=fusion,
    )
    # An old version moved aside by a publish that was interrupted: nothing else removes it.
    clean_stale_partials(out_dir.parent, name=out_dir.name)
    publish(work, out_dir, manifests={MANIFEST: manifest.to_json()}, replace=True)
    return manifest


def build_fingerprint(spec: IndexSpec, options: BuildOptions, source: BuildSource) -> str:
    """What a build's passages and vectors are computed from (module docstring): a partial
    build of another fingerprint is never resumed."""
    return _fingerprint(
        source.inputs,
        source.input_format,
        spec.max_words,
        source.vectors,
        options.shard_size,
        source.fingerprint_extra,
    )


def _fingerprint(
    inputs: list[Path],
    input_format: str,
    max_words: int,
    vectors: VectorSource | None,
    shard_size: int,
    extra: dict | None = None,
) -> str:
    """Identifies what the partial dir's passages and shards were computed from."""
    desc = {
        "inputs": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in inputs],
        "input_format": input_format,
        "max_words": max_words,
        "encoder": vectors.encoder if vectors else None,
        "encoder_weights": vectors.digest() if vectors else None,
        "shard_size": shard_size,
    }
    if vectors is not None and vectors.inputs:
        desc["vector_inputs"] = [
            (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in vectors.inputs
        ]
    if extra:
        desc["extra"] = extra
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def prepare_workdir(work: Path, state: Path, fingerprint: str) -> None:
    """``work`` holding ``state`` of the build of ``fingerprint``: a work directory of
    another build is emptied first (nothing in it can be reused)."""
    fp_file = state / "fingerprint"
    if work.exists() and (not fp_file.is_file() or fp_file.read_text() != fingerprint):
        shutil.rmtree(work)  # a partial build of something else: nothing to reuse
    state.mkdir(parents=True, exist_ok=True)
    fp_file.write_text(fingerprint)


def _batched(it: Iterator, n: int) -> Iterator[list]:
    while chunk := list(islice(it, n)):
        yield chunk


def stage_passages(work: Path, state: Path, passages: Callable[[], Iterator[Passage]]) -> int:
    """Write the passage store (kept from an interrupted run); returns the passage count."""
    done = state / "passages.done"
    if done.is_file() and (work / PASSAGES_FILE).is_file():
        return int(done.read_text())
    writer = PassageWriter(work / PASSAGES_FILE)
    try:
        for chunk in _batched(passages(), 10_000):
            writer.add(chunk)
    finally:
        writer.close()
    done.write_text(str(writer.count))
    return writer.count


def _shard_ok(path: Path, rows: int, dim: int) -> bool:
    digest = path.with_suffix(".sha256")
    if not path.is_file() or not digest.is_file():
        return False
    try:
        arr = open_array(path)
    except (ValueError, OSError):
        return False
    return (
        arr.shape == (rows, dim)
        and arr.dtype == np.float32
        and digest.read_text().strip() == sha256_file(path)
    )


def stage_vectors(
    work: Path,
    state: Path,
    source: VectorSource,
    count: int,
    shard_size: int,
    progress: bool,
) -> None:
    """Write ``vectors.npy`` from ``source`` shard by shard; verified shards of an interrupted
    run are kept, so only the missing ones are produced again."""
    out = work / VECTORS_FILE
    if (state / "vectors.done").is_file() and out.is_file():
        return
    dim = source.dim
    shards = state / "shards"
    shards.mkdir(exist_ok=True)
    n_shards = (count + shard_size - 1) // shard_size
    spans = [(i * shard_size, min((i + 1) * shard_size, count)) for i in range(n_shards)]
    paths = [shards / f"shard-{i:05d}.npy" for i in range(n_shards)]
    todo = [i for i, (a, b) in enumerate(spans) if not _shard_ok(paths[i], b - a, dim)]
    done_rows = count - sum(spans[i][1] - spans[i][0] for i in todo)
    produced: list[int] = []
    store = PassageStore(work / PASSAGES_FILE)
    try:
        with tqdm(
            total=count, initial=done_rows, unit="psg", desc=source.desc, disable=not progress
        ) as bar:
            for i, vecs in source.produce(ShardWork(store, spans, todo, bar.update)):
                produced.append(i)
                check_shard_vectors(i, vecs, spans[i], dim)
                tmp = paths[i].with_suffix(".tmp.npy")
                np.save(tmp, vecs)
                tmp.replace(paths[i])
                paths[i].with_suffix(".sha256").write_text(sha256_file(paths[i]))
    finally:
        store.close()
    if produced != todo:
        raise RuntimeError(f"vector shards {sorted(set(todo) - set(produced))[:5]} not produced")

    # One contiguous memory-mappable matrix: the trainer and rerankers read rows from it.
    tmp = work / "vectors.tmp.npy"
    mat = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(count, dim))
    for (a, b), p in zip(spans, paths, strict=True):
        mat[a:b] = open_array(p)
    mat.flush()
    del mat
    tmp.replace(out)
    (state / "vectors.done").write_text("ok")
    shutil.rmtree(shards)


def check_shard_vectors(i: int, vecs: np.ndarray, span: tuple[int, int], dim: int) -> None:
    """Shard ``i`` of rows ``span`` as a source produced it: float32 ``(rows, dim)``
    (InternalError otherwise: the sources check what they read) and finite (InvalidArgument
    naming the rows)."""
    a, b = span
    if vecs.shape != (b - a, dim) or vecs.dtype != np.float32:
        raise InternalError(
            f"shard {i}: got {vecs.dtype} {vecs.shape}, expected float32 ({b - a}, {dim})"
        )
    if not np.isfinite(vecs).all():
        raise InvalidArgument(f"non-finite vectors in rows {a}..{b - 1}")


def stage_faiss(work: Path, spec: IndexSpec, count: int, dim: int, progress: bool) -> dict:
    """Index ``vectors.npy`` with faiss as ``spec`` says; returns the manifest's params."""
    params = faiss_index.default_params(spec.index_type, count, dim, spec.ann)
    vectors = open_array(work / VECTORS_FILE)
    desc = f"indexing ({spec.index_type})"
    with tqdm(total=count, unit="vec", desc=desc, disable=not progress) as bar:
        index, params = faiss_index.build_faiss(vectors, spec.index_type, params, bar.update)
    faiss_index.write(index, work / faiss_index.INDEX_FILE)
    return params


def _stage_bm25_view(work: Path, count: int, progress: bool, source: BuildSource) -> None:
    if source.bm25 is None:
        stage_bm25(work, count, progress)
        return
    out = work / BM25_DIR
    if out.exists():
        shutil.rmtree(out)
    source.bm25(out)


def stage_bm25(work: Path, count: int, progress: bool) -> None:
    """The BM25 view of the staged passages (``bm25/``)."""
    store = PassageStore(work / PASSAGES_FILE)
    try:
        texts = [f"{t} {x}" for batch in store.iter_batches(0, count) for t, x in batch]
    finally:
        store.close()
    out = work / BM25_DIR
    if out.exists():
        shutil.rmtree(out)
    build_bm25(texts, out, progress=progress)
