"""build_index: passages -> SQLite store -> sharded, resumable embeddings -> index -> manifest.

The build happens in ``<out_dir.parent>/.<out_dir.name>.partial`` and is published as ``out_dir``
with its manifest only once complete (:func:`openbook.artifacts.publish`: fsync, manifest,
rename, fsync), so a half-built index never looks like an index. Re-running the same build
after an interruption reuses the passage store and every embedding shard already written and
verified (shape, dtype and sha256), which matters when a shard is hours of encoder time.

The vectors come from a :class:`VectorSource`: the document encoder run over the passages
here, or precomputed embedding files (``importer.py``); everything else is shared.
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

import numpy as np
import torch
from tqdm.auto import tqdm

from openbook.artifacts import clean_stale_partials, partial_dir, publish, sha256_file
from openbook.index import faiss_index
from openbook.index.bm25 import BM25_DIR, build_bm25
from openbook.index.encoders import (
    DEFAULT_ENCODER,
    Encoder,
    encoder_id,
    load_encoder,
    resolve_precision,
)
from openbook.index.manifest import (
    MANIFEST,
    Manifest,
    checksum_fields,
    score_scale_problem,
)
from openbook.index.passages import FORMATS, read_passages
from openbook.index.store import PassageStore, PassageWriter
from openbook.types import Passage

INDEX_TYPES = (*faiss_index.DENSE_TYPES, "bm25")
PASSAGES_FILE = "passages.sqlite"
VECTORS_FILE = "vectors.npy"
_STATE = "_build"  # scratch space inside the partial dir, removed before the final rename


def _encoding_device(device: str | None) -> torch.device:
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu or cuda[:N]")
    return dev


def build_index(
    inputs: list[Path],
    out_dir: Path,
    *,
    name: str,
    encoder: str = DEFAULT_ENCODER,
    query_encoder: str | None = None,
    index_type: str = "flat",
    input_format: str = "auto",
    batch_size: int = 64,
    shard_size: int = 50_000,
    hnsw_m: int = 32,
    ef_construction: int = 128,
    ef_search: int = 128,
    progress: bool = True,
    hnsw_transform: str = "none",
    max_words: int = 100,
    nlist: int | None = None,
    pq_m: int | None = None,
    nprobe: int = 16,
    rerank: int = 0,
    overwrite: bool = False,
    device: str | None = None,
    score_scale: float | None = None,
    precision: str = "auto",
    bm25: bool = True,
) -> Manifest:
    """Build an index directory at ``out_dir`` and return its manifest. See module docstring.

    A dense index also gets a BM25 view of the same passages (``bm25/``, manifest ``views``
    ``["dense", "bm25"]``: hybrid retrieval, :mod:`openbook.index.fusion`) unless ``bm25`` is
    False; ``index_type="bm25"`` builds only that view.

    ``device`` (e.g. ``cuda``) runs the document encoder there; the default is the CPU.
    ``precision`` is the dtype it runs in (:func:`openbook.index.encoders.resolve_precision`:
    ``auto`` is float32 on the CPU, bfloat16 or float16 on CUDA).
    ``score_scale`` multiplies every returned score (default: :func:`default_score_scale`).
    """
    t0 = time.monotonic()
    out_dir = Path(out_dir)
    inputs = [Path(p) for p in inputs]
    _check_args(inputs, out_dir, name, index_type, input_format, batch_size, shard_size, overwrite)
    _check_index_options(hnsw_transform, rerank, score_scale)

    source: VectorSource | None = None
    doc_enc: Encoder | None = None
    if index_type != "bm25":
        doc_enc, q_name, precision = document_encoder(
            encoder, query_encoder, device, precision, index_type=index_type, pq_m=pq_m
        )
        source = encoder_source(doc_enc, q_name, batch_size, precision)

    if score_scale is None:
        score_scale = default_score_scale(doc_enc)
    with _build_lock(out_dir):
        return _build_locked(
            inputs,
            out_dir,
            name=name,
            index_type=index_type,
            input_format=input_format,
            max_words=max_words,
            vectors=source,
            shard_size=shard_size,
            progress=progress,
            hnsw_m=hnsw_m,
            ef_construction=ef_construction,
            ef_search=ef_search,
            hnsw_transform=hnsw_transform,
            nlist=nlist,
            pq_m=pq_m,
            nprobe=nprobe,
            rerank=rerank,
            score_scale=score_scale,
            t0=t0,
            bm25=bm25,
        )


def document_encoder(
    encoder: str,
    query_encoder: str | None,
    device: str | None,
    precision: str,
    *,
    index_type: str,
    pq_m: int | None = None,
) -> tuple[Encoder, str, str]:
    """The document encoder on its device, the query encoder's manifest name, and the resolved
    precision; the query encoder must have the document encoder's dim."""
    encode_on = _encoding_device(device)
    precision = resolve_precision(precision, encode_on)
    # A private copy when it moves: the shared one may serve queries on the CPU.
    doc_enc = load_encoder(encoder, role="document", cached=encode_on.type == "cpu")
    doc_enc.to(encode_on)
    q_name = encoder_id(query_encoder) if query_encoder else doc_enc.name
    q_enc = load_encoder(query_encoder, role="query") if query_encoder else doc_enc
    if q_enc.dim != doc_enc.dim:
        raise ValueError(
            f"query encoder {q_enc.name!r} dim {q_enc.dim} != document encoder "
            f"{doc_enc.name!r} dim {doc_enc.dim}"
        )
    if index_type == "ivfpq" and pq_m is not None and doc_enc.dim % pq_m:
        raise ValueError(f"pq_m={pq_m} must divide the encoder dim {doc_enc.dim}")
    return doc_enc, q_name, precision


# The similarity scale that sentence-transformers' MultipleNegativesRankingLoss trains with
# (all-MiniLM-L6-v2 included): softmax(20 x cosine) is the distribution such an encoder learned.
COSINE_SCORE_SCALE = 20.0


def default_score_scale(doc_encoder: Encoder | None) -> float:
    """How much to multiply inner products by so that softmax over them is a useful prior.

    DPR (RAG's retriever) scores with raw inner products that lie tens of units apart, so the
    prior softmax(d·q) is peaked as is: scale 1. Encoders that normalise their vectors score
    with cosine similarities in [-1, 1], whose softmax over the top k is nearly uniform — with
    MiniLM that let wrong passages outvote the right one in RAG-Token (docs/results.md) — so
    they get the scale they were trained with. BM25 scores are left as they are.
    """
    if doc_encoder is not None and doc_encoder.normalize:
        return COSINE_SCORE_SCALE
    return 1.0


@contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """One build per index directory at a time (e.g. two init containers on one volume):
    the second fails at once with a clear error instead of corrupting the first's work dir.
    The OS releases the lock when its process dies, so it never goes stale; the lock file is
    removed afterwards, and a holder checks it locked the file that is still in place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if (
                not lock_path.exists()
                or os.stat(lock_path).st_ino != os.fstat(lock.fileno()).st_ino
            ):
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


def _build_locked(
    inputs: list[Path],
    out_dir: Path,
    *,
    name: str,
    index_type: str,
    input_format: str,
    max_words: int,
    vectors: VectorSource | None,
    shard_size: int,
    progress: bool,
    hnsw_m: int,
    ef_construction: int,
    ef_search: int,
    hnsw_transform: str,
    nlist: int | None,
    pq_m: int | None,
    nprobe: int,
    rerank: int,
    score_scale: float,
    t0: float,
    passages: Callable[[], Iterator[Passage]] | None = None,
    shard: dict | None = None,
    fingerprint_extra: dict | None = None,
    bm25: bool = True,
    fusion: dict | None = None,
) -> Manifest:
    """``passages``: where the passages come from if not ``read_passages(inputs, ...)``.
    ``shard``: the manifest's ``shard`` field (a slice of a parallel build). Anything else the
    passages or vectors depend on goes in ``fingerprint_extra``, so that a partial build of
    something else is never resumed. ``bm25``: a dense index gets a BM25 view too (a bm25 index
    is nothing else); ``fusion``: the manifest's ``fusion`` (e.g. a merge keeps its slices').
    """
    work = partial_dir(out_dir)
    state = work / _STATE
    fingerprint = _fingerprint(
        inputs, input_format, max_words, vectors, shard_size, fingerprint_extra
    )
    _prepare_workdir(work, state, fingerprint)

    try:
        read = passages or (lambda: read_passages(inputs, input_format, max_words))
        count = _stage_passages(work, state, read)
        if count == 0:
            raise ValueError("no passages found in the inputs")
    except BaseException:
        # Nothing expensive has been computed yet, so don't leave a partial dir behind.
        shutil.rmtree(work, ignore_errors=True)
        raise

    params: dict = {}
    if vectors is not None:
        _stage_vectors(work, state, vectors, count, shard_size, progress)
        params = _stage_faiss(
            work,
            index_type,
            count,
            vectors.dim,
            progress,
            hnsw_m=hnsw_m,
            ef_construction=ef_construction,
            ef_search=ef_search,
            hnsw_transform=hnsw_transform,
            nlist=nlist,
            pq_m=pq_m,
            nprobe=nprobe,
            rerank=rerank,
        )
        if bm25:
            _stage_bm25(work, count, progress)
        views = ["dense", "bm25"] if bm25 else ["dense"]
    else:
        _stage_bm25(work, count, progress)
        params = {"k1": 1.5, "b": 0.75, "method": "lucene", "stopwords": "en"}
        views = ["bm25"]
    if fusion is not None and views != ["dense", "bm25"]:
        fusion = None  # a fusion belongs to an index with both views

    shutil.rmtree(state)
    manifest = Manifest(
        name=name,
        encoder=vectors.encoder if vectors else None,
        query_encoder=vectors.query_encoder if vectors else None,
        dim=vectors.dim if vectors else 0,
        count=count,
        index_type=index_type,
        index_params=params,
        **checksum_fields(work),
        normalize=vectors.normalize if vectors else False,
        score_scale=float(score_scale),
        build_seconds=round(time.monotonic() - t0, 3),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        input_format=input_format,
        max_words=max_words,
        shard=shard,
        views=views,
        fusion=fusion,
    )
    # An old version moved aside by a publish that was interrupted: nothing else removes it.
    clean_stale_partials(out_dir.parent, name=out_dir.name)
    publish(work, out_dir, manifests={MANIFEST: manifest.to_json()}, replace=True)
    return manifest


def _check_args(
    inputs: list[Path],
    out_dir: Path,
    name: str,
    index_type: str,
    input_format: str,
    batch_size: int,
    shard_size: int,
    overwrite: bool,
) -> None:
    if not name or not name.strip():
        raise ValueError("index name must not be empty")
    if index_type not in INDEX_TYPES:
        raise ValueError(f"unknown index type {index_type!r}; expected one of {INDEX_TYPES}")
    if input_format not in FORMATS:
        raise ValueError(f"unknown input format {input_format!r}; expected one of {FORMATS}")
    if batch_size < 1 or shard_size < 1:
        raise ValueError("batch_size and shard_size must be >= 1")
    if not inputs:
        raise ValueError("no input files given")
    for p in inputs:
        if not p.is_file():
            raise ValueError(f"{p}: no such file")
    if out_dir.exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists (pass overwrite=True / --overwrite)")


def _check_index_options(hnsw_transform: str, rerank: int, score_scale: float | None) -> None:
    """The faiss-stage options every build checks (``score_scale`` None: the default)."""
    if hnsw_transform not in faiss_index.HNSW_TRANSFORMS:
        raise ValueError(
            f"unknown hnsw_transform {hnsw_transform!r}; expected {faiss_index.HNSW_TRANSFORMS}"
        )
    if rerank < 0:
        raise ValueError(f"rerank must be >= 0, got {rerank}")
    if score_scale is not None and (problem := score_scale_problem(float(score_scale))):
        raise ValueError(problem)


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


def _weights_digest(enc: Encoder) -> str:
    """Cheap digest of the weights so shards from a since-retrained encoder are not reused."""
    h = hashlib.sha256()
    for k, v in sorted(enc.model.state_dict().items()):
        flat = v.detach().reshape(-1)
        h.update(k.encode())
        h.update(flat[:64].float().cpu().numpy().tobytes())
        h.update(str(float(flat.float().sum())).encode())
    return h.hexdigest()


def _prepare_workdir(work: Path, state: Path, fingerprint: str) -> None:
    fp_file = state / "fingerprint"
    if work.exists() and (not fp_file.is_file() or fp_file.read_text() != fingerprint):
        shutil.rmtree(work)  # a partial build of something else: nothing to reuse
    state.mkdir(parents=True, exist_ok=True)
    fp_file.write_text(fingerprint)


def _batched(it: Iterator, n: int) -> Iterator[list]:
    while chunk := list(islice(it, n)):
        yield chunk


def _stage_passages(work: Path, state: Path, passages: Callable[[], Iterator[Passage]]) -> int:
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
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError):
        return False
    return (
        arr.shape == (rows, dim)
        and arr.dtype == np.float32
        and digest.read_text().strip() == sha256_file(path)
    )


# Yields (shard number, its float32 (rows, dim) vectors) for the shards in ``todo`` (ascending),
# given the passage store, every shard's [start, stop) rows, and a progress callback (rows).
ShardProducer = Callable[
    [PassageStore, list[tuple[int, int]], list[int], Callable[[int], None]],
    Iterator[tuple[int, np.ndarray]],
]


@dataclass(frozen=True)
class VectorSource:
    """Where a dense index's document vectors come from: an encoder run over the passages
    (``build_index``) or precomputed embedding files (``import_embeddings``)."""

    encoder: str  # the manifest's document encoder
    query_encoder: str  # the manifest's query encoder: what the retriever loads
    dim: int
    normalize: bool
    digest: Callable[[], str]  # what the vectors are computed from (resume fingerprint)
    produce: ShardProducer
    desc: str = "embedding"
    inputs: tuple[Path, ...] = ()  # files the vectors are read from, if any


def encoder_source(
    enc: Encoder, q_name: str | None, batch_size: int, precision: str = "float32"
) -> VectorSource:
    """Vectors from ``enc`` run over the passages in ``precision`` (a resolved name)."""

    def produce(
        store: PassageStore,
        spans: list[tuple[int, int]],
        todo: list[int],
        update: Callable[[int], None],
    ) -> Iterator[tuple[int, np.ndarray]]:
        for i in todo:
            a, b = spans[i]
            rows = [row for batch in store.iter_batches(a, b) for row in batch]
            # One call per embedding shard: the encoder sorts by length across the whole shard
            # (fuller batches than a smaller window) and tokenizes ahead of the model.
            vecs = enc.encode(
                [r[1] for r in rows],
                batch_size,
                titles=[r[0] for r in rows],
                precision=precision,
                on_progress=update,
            )
            yield i, vecs

    def digest() -> str:
        # float32 keeps the digest builds had before precisions existed (their partial builds
        # stay resumable); shards encoded in another precision are never mixed with them.
        weights = _weights_digest(enc)
        return weights if precision == "float32" else f"{weights}+{precision}"

    return VectorSource(
        encoder=enc.name,
        query_encoder=q_name or enc.name,
        dim=enc.dim,
        normalize=bool(enc.normalize),
        digest=digest,
        produce=produce,
    )


def _stage_vectors(
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
            for i, vecs in source.produce(store, spans, todo, bar.update):
                produced.append(i)
                a, b = spans[i]
                if vecs.shape != (b - a, dim) or vecs.dtype != np.float32:
                    raise ValueError(
                        f"shard {i}: got {vecs.dtype} {vecs.shape}, expected "
                        f"float32 ({b - a}, {dim})"
                    )
                if not np.isfinite(vecs).all():
                    raise ValueError(f"non-finite vectors in rows {a}..{b - 1}")
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
        mat[a:b] = np.load(p, mmap_mode="r")
    mat.flush()
    del mat
    tmp.replace(out)
    (state / "vectors.done").write_text("ok")
    shutil.rmtree(shards)


def _stage_faiss(work: Path, index_type: str, count: int, dim: int, progress: bool, **kw) -> dict:
    params = faiss_index.default_params(index_type, count, dim, **kw)
    vectors = np.load(work / VECTORS_FILE, mmap_mode="r")
    desc = f"indexing ({index_type})"
    with tqdm(total=count, unit="vec", desc=desc, disable=not progress) as bar:
        index, params = faiss_index.build_faiss(vectors, index_type, params, bar.update)
    faiss_index.write(index, work / faiss_index.INDEX_FILE)
    return params


def _stage_bm25(work: Path, count: int, progress: bool) -> None:
    store = PassageStore(work / PASSAGES_FILE)
    try:
        texts = [f"{t} {x}" for batch in store.iter_batches(0, count) for t, x in batch]
    finally:
        store.close()
    out = work / BM25_DIR
    if out.exists():
        shutil.rmtree(out)
    build_bm25(texts, out, progress=progress)
